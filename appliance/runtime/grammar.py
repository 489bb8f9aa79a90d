r"""Structured output: grammars compiled by llguidance into a token mask applied at every step.

Why llguidance (1.9.1): it builds its tokenizer from the model's tokenizer.json alone, compiles JSON schemas,
regexes, Lark and (converted) GBNF grammars, and computes a step's mask in tens of microseconds. xgrammar was
rejected: its Python package requires torch, transformers and triton, which the serving side must not have.

- `GrammarCompiler` (Engine.grammars): the LLTokenizer is built lazily, once (about 0.25 s for the default model),
  with the logits width as n_vocab and the engine's EOS ids. `check` compiles a grammar on the caller's thread
  (LLMatcher's construction drops the GIL) and keeps a prototype matcher per grammar in a bounded LRU; an invalid
  schema / regex / grammar raises GrammarError (a 400) with llguidance's message trimmed to its point. `matcher`
  (engine thread) deep-copies the prototype (about 10 us).
- JSON schemas compile without free whitespace and with json.dumps' separators (", ", ": "): a small model may
  otherwise emit whitespace forever where the schema allows it, and one canonical layout is what clients parse.
  A schema's own "x-guidance" options still override these (they are defaults, not overrides). Unknown keywords
  are refused, not ignored (llguidance's lenient mode is off): a constraint is implemented or refused. A Lark
  grammar's `%json {...}` gets llguidance's flexible layout unless that schema carries the same "x-guidance"
  (api/tool_calls.py's does).
- Regexes: Rust regex syntax, fullmatched; \d means [0-9] (as in JSON schema patterns: the Unicode class let
  the default model write "🯸🯸🯸-🯸🯸🯸🯸" for \d{3}-\d{4}), \w and \s stay Unicode.
- `apply_grammar_masks`: each grammar row's bitmask, filled one matcher after another (16 rows mid-JSON on the
  2-core box: 0.45 ms in a loop, 0.50 ms through LLExecutor's thread pool, which also competes with the model's
  threads), unpacked with np.unpackbits and applied as an additive 0 / -inf penalty. Measured in the engine at
  batch 1 (default model): mask + consume about 0.35 ms of a 22 ms decode step; bench/structured.py measures the
  throughput cost at 1 and 16 concurrent. The grammar wins over every earlier mask: a row left
  with no finite logit (min_tokens masking EOS where only EOS may follow, a banned word the grammar requires) is
  recomputed as the raw logits under the grammar mask alone. EOS is allowed only where the grammar accepts.
- A finished grammar (llguidance is_stopped: nothing but EOS can follow) ends its sequence with finish_reason
  "stop" (Engine._append), with or without ignore_eos: ignore_eos cannot extend text the grammar has closed.
  A token the grammar rejects raises in `consume`, which fails that request alone (Engine._isolated).
- LIMITS bound what one grammar may cost per step, so a pathological schema fails its own request instead of
  stalling the batch.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import llguidance
import numpy as np

from appliance.params import Grammar

# Compiled grammars kept (LRU): an agent workload repeats a handful of schemas (its tools, its response format),
# and a compiled matcher holds its lexer states (tens of kB to a few MB), so a few dozen cover reuse in bounded RAM.
GRAMMAR_CACHE_SIZE = 64
# llguidance's per-step bounds (its speed estimates: lexer fuel ~14k/ms, Earley items ~20k/ms): about 5 ms + 1 ms
# of one row's mask at worst (the defaults allow ~14 + 2.5 ms); the one-off build (caller's thread) keeps its
# defaults. Verbose errors off: messages name the problem without dumping the parser state.
LIMITS = dict(step_lexer_fuel=70_000, step_max_items=20_000, verbose_errors=False)
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_MESSAGE_CHARS = 300  # an error message longer than this (a quoted schema) is cut
_NEG_INF_BITS = np.float32(-np.inf).view(np.int32)
_KIND_NAMES = {"json_schema": "JSON schema", "regex": "regex", "lark": "Lark grammar", "gbnf": "GBNF grammar"}


class GrammarError(ValueError):
    """The request's schema, regex or grammar cannot be compiled (HTTP 400 naming the problem)."""


def _readable(kind: str, message: str) -> str:
    """llguidance's message cut to its point: 'invalid regex "[a-z": unclosed character class'."""
    lines = [line.strip() for line in message.strip().splitlines()]
    head = lines[0] if lines else "cannot be compiled"
    if "regex parse error" in message:  # the regex crate's report: the quoted regex, then 'error: <what>'
        what = next((line[len("error: ") :] for line in lines if line.startswith("error: ")), "")
        head = re.sub(r" \(in regex\)$|: regex parse error:?$", "", head.split(": regex parse error")[0])
        head = f"{head}: {what}" if what else head
    if kind == "regex":  # positions refer to the Lark wrapper llguidance builds around the regex, not to it
        head = re.sub(r"^at \d+\(\d+\): ", "", head)
    if not head.startswith("invalid "):
        head = f"invalid {_KIND_NAMES.get(kind, kind)}: {head}"
    return head if len(head) <= _MESSAGE_CHARS else head[: _MESSAGE_CHARS - 3] + "..."


def _message(grammar: Grammar, message: str) -> str:
    """_readable's message; for a Lark grammar whose `%json` lines are labelled (Grammar.parts: tool calls), an error
    in one of those schemas names what it is instead of the grammar the client never wrote:
    "invalid JSON schema in the parameters of function 'f': Pointer '/$defs/A' does not exist"."""
    found = (
        re.match(r"\s*at (\d+)\(\d+\): (?:failed to compile JSON schema: )?(.*)", message) if grammar.parts else None
    )
    lines = grammar.text.splitlines()
    if found and 0 < (line := int(found[1])) <= len(lines) and "%json" in lines[line - 1]:
        i = sum("%json" in text for text in lines[:line]) - 1
        if i < len(grammar.parts):
            return _readable("json_schema", f"invalid JSON schema in {grammar.parts[i]}: {found[2]}")
    return _readable(grammar.kind, message)


def _source(grammar: Grammar) -> str:
    """The grammar in llguidance's own form (raises on malformed input)."""
    if grammar.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(grammar.text, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if grammar.kind == "regex":  # \d as [0-9]: Unicode digits (U+1FBF8 ...) are not what a pattern's author means
        return llguidance.LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(grammar.text, 'd')}/")
    if grammar.kind == "gbnf":
        from llguidance.gbnf_to_lark import any_to_lark  # also passes Lark through unchanged

        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(grammar.text))
    if grammar.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(grammar.text)
    raise GrammarError(f"unknown grammar kind {grammar.kind!r}")


class GrammarMatcher:
    """One sequence's position in its grammar (engine thread only)."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int):
        self._m = matcher
        self.words = words  # int32 words of its bitmask: ceil(n_vocab / 32)

    def consume(self, token_id: int) -> None:
        """Advance past a sampled token; one the grammar rejects raises (the request fails alone)."""
        if not self._m.consume_token(token_id):
            raise RuntimeError(f"grammar rejected token {token_id}: {self._m.get_error()}")

    @property
    def finished(self) -> bool:
        """Nothing but EOS can follow (the text is complete under the grammar)."""
        return self._m.is_stopped()

    def fill_mask(self, mask: np.ndarray, row: int) -> None:
        """The allowed next tokens into mask[row] (int32 words, bit t % 32 of word t // 32 set: token t allowed)."""
        v = mask[row]
        self._m.unsafe_compute_mask_ptr(v.ctypes.data, v.nbytes)
        if self._m.is_error():  # a step bound (LIMITS) ran out: this request fails alone
            raise RuntimeError(f"grammar: {self._m.get_error()}")


class GrammarCompiler:
    """Engine.grammars: compiles grammars against the model's tokenizer and hands out matchers."""

    def __init__(self, tokenizer_file: str | Path, n_vocab: int, eos_token_ids: list[int]):
        self.tokenizer_file, self.n_vocab, self.eos_token_ids = str(tokenizer_file), n_vocab, list(eos_token_ids)
        self.words = (n_vocab + 31) // 32
        self.limits = llguidance.LLParserLimits(**LIMITS)  # type: ignore[arg-type]
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[Grammar, llguidance.LLMatcher] = OrderedDict()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # built once, by the first caller; the others wait for it
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self.tokenizer_file, n_vocab=self.n_vocab, eos_token=self.eos_token_ids
                )
            return self._tokenizer

    def check(self, grammar: Grammar) -> None:
        """Compile (caller's thread) and cache; GrammarError if the grammar is invalid."""
        self._prototype(grammar)

    def matcher(self, grammar: Grammar) -> GrammarMatcher:
        """A fresh matcher at the grammar's start (engine thread: a copy of the cached prototype)."""
        return GrammarMatcher(self._prototype(grammar).deep_copy(), self.words)

    def _prototype(self, grammar: Grammar) -> llguidance.LLMatcher:
        with self._lock:
            if (proto := self._cache.get(grammar)) is not None:
                self._cache.move_to_end(grammar)
                return proto
        # compiled outside the lock (two callers of one new grammar may both compile it: harmless). Reached on the
        # engine thread only when more than GRAMMAR_CACHE_SIZE grammars were admitted since this one was checked.
        try:
            source = _source(grammar)
        except GrammarError:
            raise
        except Exception as exc:  # malformed JSON, a GBNF rule that does not exist, ...
            raise GrammarError(_message(grammar, str(exc))) from None
        proto = llguidance.LLMatcher(self.tokenizer, source, log_level=0, limits=self.limits)
        if proto.is_error():
            raise GrammarError(_message(grammar, proto.get_error()))
        with self._lock:
            self._cache[grammar] = proto
            self._cache.move_to_end(grammar)
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return proto


def apply_grammar_masks(x: np.ndarray, logits: np.ndarray, seqs: list[Any]) -> None:
    """Rows of x (processed logits, [B, V]) whose sampler has a grammar: tokens it disallows -> -inf. A row left
    with no finite value becomes the raw logits row under the grammar mask alone (the grammar wins)."""
    rows = [(i, s.grammar) for i, s in enumerate(seqs) if s.grammar is not None]
    if not rows:
        return
    V = x.shape[1]
    mask = np.empty((len(rows), rows[0][1].words), np.int32)
    if mask.shape[1] * 32 < V:
        raise ValueError(f"grammar masks cover {mask.shape[1] * 32} tokens, the logits {V}")
    for j, (_, g) in enumerate(rows):
        g.fill_mask(mask, j)
    # bit -> additive penalty, branch-free: (bit - 1) & bits(-inf) is 0 (allowed) or -inf (banned) as float32.
    # A boolean-masked store (x[~bits] = -inf, np.copyto where=) is ~10x slower on mixed masks (0.27 vs 3.2 ms at
    # 16 x 49152: its per-element branch mispredicts).
    pen = np.unpackbits(mask.view(np.uint8), axis=1, count=V, bitorder="little").astype(np.int32)
    pen -= 1
    pen &= _NEG_INF_BITS
    penalty = pen.view(np.float32)
    idx = [i for i, _ in rows]
    sub = x if len(idx) == len(x) else x[idx]  # every row has a grammar: in place
    sub += penalty
    if (dead := ~np.isfinite(sub.max(axis=1))).any():
        sub[dead] = logits[np.asarray(idx)[dead]] + penalty[dead]
    if sub is not x:
        x[idx] = sub
