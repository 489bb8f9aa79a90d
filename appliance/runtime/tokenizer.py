"""Tokenizer for the runtime: `tokenizers` for the vocabulary, jinja2 for the chat template. No transformers.

Reads a HF model folder: tokenizer.json, tokenizer_config.json (special tokens, inline chat template),
chat_template.jinja (preferred over the inline template, as transformers does) and generation_config.json
(extra EOS ids). `decode` is the raw `tokenizers` decode; transformers' `clean_up_tokenization_spaces` is not
applied because it is not incremental (the streaming detokenizer could not reproduce it).

Chat content stays content (`encode_chat`): a special token's text inside a message (`<|im_end|>` typed by a user)
is encoded as plain text, never as the control token, as the OpenAI API does; otherwise a user could close their
turn and open a `system` one against the operator's prompt. Raw prompts (`encode`) keep mapping special-token text
to the special tokens (what completions clients and OVMS expect).

Encoding never holds the GIL for long: every encode goes through `tokenizers`' `encode_batch(_fast)`, which releases it
while the Rust side works (`encode` keeps it for the whole call: 1,000,000 digits took 3.6 s, during which another
Python thread ticking every 10 ms ran once). The engine process runs every model's engine thread, the probes and
the watchdog, so one long prompt must not stop them. And text that cannot fit is refused before it is encoded at
all: `max_token_chars` (below) bounds how many characters one token can stand for, so a text longer than
tokens x that cannot become `tokens` tokens or fewer (`TextTooLong`).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
# Markers for special-token text in chat content are built from one character of the Private Use Area that occurs
# in no input (see encode_chat); tried from the top of the area down.
_PRIVATE_USE = range(0xF8FF, 0xE000 - 1, -1)
_PRIVATE_USE_CHAR = re.compile("[\ue000-\uf8ff]")


@lru_cache(maxsize=1)
def gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE spells every byte as one printable character."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens either as strings or as serialized AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _strings(x: Any) -> Iterable[str]:
    """Every string in a JSON-like value (dict keys included: a template may render them, e.g. with tojson)."""
    if isinstance(x, str):
        yield x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _strings(v)


def _map_strings(x: Any, f) -> Any:
    """`x` with `f` applied to every string in it (same structure: dicts, lists and tuples are copied)."""
    if isinstance(x, str):
        return f(x)
    if isinstance(x, dict):
        return {_map_strings(k, f): _map_strings(v, f) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_map_strings(v, f) for v in x)
    return x


def _never_prepend(node: Any) -> bool:
    """Turn Metaspace's prepend_scheme "first" into "never" in a serialized tokenizer (in place); True if found."""
    found = False
    if isinstance(node, dict):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
            node["prepend_scheme"] = "never"
            found = True
        for v in node.values():
            found = _never_prepend(v) or found
    elif isinstance(node, list):
        for v in node:
            found = _never_prepend(v) or found
    return found


# Pipeline parts that never make the text shorter (so every input character is still covered by some token):
# normalizers that only add or expand characters, pre-tokenizers that only split or map one-to-one.
_GROWING_NORMALIZERS = frozenset({"Prepend", "NFD", "NFKD", "Lowercase"})
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Digits", "Metaspace", "UnicodeScripts"})
_SPLITTERS = frozenset({"Split", "Punctuation"})


def _never_shrinks(node: Any, kind: str) -> bool:
    """Whether a serialized normalizer / pre-tokenizer keeps every input character (None: no such step)."""
    if node is None:
        return True
    t = node.get("type")
    if t == "Sequence":
        return all(_never_shrinks(n, kind) for n in node.get(kind + "s", node.get("normalizers", [])))
    if kind == "normalizer":
        if t in _GROWING_NORMALIZERS:
            return True
        if t == "Replace":  # a plain string replaced by one at least as long
            pattern = node.get("pattern") or {}
            return "String" in pattern and len(node.get("content", "")) >= len(pattern["String"])
        return False
    if t in _KEEPING_PRE_TOKENIZERS:
        return True
    return t in _SPLITTERS and str(node.get("behavior", "")).lower() != "removed"


def max_token_chars(state: dict) -> int | None:
    """The most input characters one token can stand for, for a tokenizer serialized as `state` (tokenizer.json),
    or None when no such bound holds (then texts are not refused by length before encoding).

    Why it is sound: every character of the input (after normalization) belongs to exactly one token's span, the
    spans do not overlap, and a token's span is its own text: its string in the vocabulary (byte-level BPE writes
    one vocabulary character per byte, and a character is at least one byte, so the string is at least as long
    as the characters it covers; SentencePiece writes one per character, `<0xNN>` a single byte), or an added
    token's content. So a text of C characters becomes at least C / L tokens, L the longest such string, and a
    text longer than T x L characters cannot be T tokens or fewer. This holds only while nothing drops or merges
    characters, so the bound is None for anything that might: a normalizer that can shorten the text (NFC/NFKC
    compose, Strip, StripAccents, Bert's cleaning, SentencePiece's precompiled map), a pre-tokenizer that drops
    (Whitespace, Bert, a Split that removes), a model that gives one token to a run of unknown characters (BPE
    with fuse_unk and no byte fallback, Unigram without it, WordPiece, WordLevel), or an added token that eats the
    whitespace around it (lstrip/rstrip). Adding characters (a prefix space, post-processor tokens) only makes more
    tokens, so it never breaks the bound."""
    model = state.get("model") or {}
    kind = model.get("type")
    if kind == "BPE":
        if model.get("unk_token") is not None and model.get("fuse_unk") and not model.get("byte_fallback"):
            return None
    elif kind == "Unigram":
        if not model.get("byte_fallback"):
            return None
    else:
        return None
    if not (
        _never_shrinks(state.get("normalizer"), "normalizer")
        and _never_shrinks(state.get("pre_tokenizer"), "pretokenizer")
    ):
        return None
    added = state.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None
    vocab = model.get("vocab") or {}
    pieces = vocab.keys() if isinstance(vocab, dict) else (v[0] for v in vocab)  # Unigram: [[piece, score], ...]
    return max((len(p) for p in [*pieces, *(a.get("content", "") for a in added)]), default=None) or None


class _Spellings:
    """A finer `max_token_chars` for one text: a token covering part of a text is spelled with that text's
    characters (after normalization; byte-level BPE spells each of their UTF-8 bytes as one character) and the
    ones the pipeline inserts (a prefix space, Metaspace's replacement, a Prepend or Replace content), so only
    vocabulary entries made of those characters can occur, and the longest of them bounds the characters per
    token. Added tokens are matched as they are written, so their own characters must be the text's too;
    byte-fallback and unknown tokens stand for one character or byte each (the floor of 1). 600,000 digits: at
    most 1 character a token for the default model (no piece of its vocabulary is two digits) instead of 81, so
    such a text is refused before it is encoded (its encoding would be +160 MB). Each vocabulary character is a
    bit and each piece the mask of its characters, so a text's bound is one pass over the distinct masks (at
    most ~80 ms for 600,000 characters with the default model; built once, ~0.2 s, when the tokenizer loads)."""

    def __init__(self, state: dict, normalizer: Any):
        vocab = state["model"].get("vocab") or {}
        pieces = vocab.keys() if isinstance(vocab, dict) else (v[0] for v in vocab)
        added = [a.get("content", "") for a in state.get("added_tokens") or []]
        self.bit: dict[str, int] = {}
        longest: dict[int, int] = {}  # the longest piece per character mask
        for piece in [*pieces, *added]:
            if len(piece) > 1:
                mask = 0
                for c in piece:
                    mask |= 1 << self.bit.setdefault(c, len(self.bit))
                longest[mask] = max(longest.get(mask, 0), len(piece))
        self.longest_first = sorted(longest.items(), key=lambda kv: -kv[1])
        pre = state.get("pre_tokenizer")
        inserted = {" "} if any(v is True for v in _values(pre, "add_prefix_space")) else set()
        for part in (state.get("normalizer"), pre):
            for key in ("content", "prepend", "replacement"):
                inserted.update(c for v in _values(part, key) if isinstance(v, str) for c in v)
        self.inserted = frozenset(inserted)
        self.bytelevel = '"ByteLevel"' in json.dumps(pre)
        self.normalizer = normalizer

    def longest(self, text: str) -> int:
        """The most characters of `text` one token can stand for (at least 1)."""
        chars = set(text) | self.inserted  # as written: what added tokens match
        if self.normalizer is not None:
            chars |= set(self.normalizer.normalize_str(text))
        if self.bytelevel:
            table = _byte_to_unicode()
            chars |= {table[b] for c in list(chars) for b in c.encode("utf-8", "surrogatepass")}
        have = 0
        for c in chars:
            if (b := self.bit.get(c)) is not None:
                have |= 1 << b
        return next((n for mask, n in self.longest_first if not mask & ~have), 1)


def _values(node: Any, key: str) -> Iterable[Any]:
    """Every string or flag stored under `key` anywhere in a serialized pipeline part."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key and isinstance(v, (str, bool)):
                yield v
            else:
                yield from _values(v, key)
    elif isinstance(node, list):
        for v in node:
            yield from _values(v, key)


@lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    return {b: c for c, b in gpt2_unicode_to_byte().items()}


class TextTooLong(ValueError):
    """A text with more characters than the tokens it may become can hold (refused before encoding)."""


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask marker in some templates): render the body as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Like transformers: jinja's own tojson HTML-escapes, which changes what the model sees.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """A HF tokenizer folder, loaded without transformers."""

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        config: dict | None = None,
        chat_template: str | dict | list | None = None,
        generation_config: dict | None = None,
    ):
        self._tok = tok
        config = config or {}
        self.config = config
        self.chat_template = chat_template
        added = tok.get_added_tokens_decoder()
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._added_content = {i: t.content for i, t in added.items()}
        self.special_tokens: dict[str, str] = {k: c for k in _NAMED_SPECIALS if (c := _token_content(config.get(k)))}
        extra = config.get("additional_special_tokens") or []
        self.additional_special_tokens = [c for t in extra if (c := _token_content(t))]
        eos = (generation_config or {}).get("eos_token_id")
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.eos_token is not None and (i := tok.token_to_id(self.eos_token)) is not None:
            eos_ids.add(i)
        self.eos_token_ids: list[int] = sorted(eos_ids)
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        self._decoder_kind, has_byte_fallback = self._detect_decoder()
        # <0xNN> tokens a ByteFallback decoder merges run-wise (a run decodes only if all of it is valid UTF-8)
        self.byte_fallback_ids: frozenset[int] = frozenset(
            i for b in range(256) if has_byte_fallback and (i := tok.token_to_id(f"<0x{b:02X}>")) is not None
        )
        self._bytes_cache: dict[int, bytes] = {}
        # encode_chat: the special tokens' texts, longest first so the regex prefers "<|a|>b" over "<|a|>"
        self._special_texts = sorted({self._added_content[i] for i in self.special_ids}, key=len, reverse=True)
        self._special_index = {t: k for k, t in enumerate(self._special_texts)}
        self._special_re = re.compile("|".join(map(re.escape, self._special_texts))) if self._special_texts else None
        self._plain: tuple[tokenizers.Tokenizer, tokenizers.Tokenizer] | None = None  # built on first use
        self._plain_lock = threading.Lock()
        state = json.loads(tok.to_str())
        self.max_token_chars: int | None = max_token_chars(state)
        # built here, not on the first long text (~0.2 s for a 49k vocabulary, which would hold the GIL then)
        self._spellings = _Spellings(state, tok.normalizer) if self.max_token_chars is not None else None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json")
        config = _read_json(path / "tokenizer_config.json")
        for k, v in _read_json(path / "special_tokens_map.json").items():  # legacy file: fills what the config lacks
            config.setdefault(k, v)
        template: str | dict | None = config.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif (path / "chat_template.json").is_file():
            template = _read_json(path / "chat_template.json").get("chat_template", template)
        return cls(
            tokenizers.Tokenizer.from_file(str(tok_file)), config, template, _read_json(path / "generation_config.json")
        )

    # -- vocabulary ---------------------------------------------------------------------------------------------
    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    def encode(self, text: str, add_special_tokens: bool = False, token_budget: int | None = None) -> list[int]:
        """Default False: chat templates already spell out BOS and friends in the text. `token_budget`: the most
        tokens the text may become (for a prompt, the model's context; not a request's max_tokens, which caps what is
        generated): a text that cannot be that many tokens or fewer is refused (TextTooLong) before it is encoded."""
        self.check_length(text, token_budget)
        return self.encode_many([text], add_special_tokens)[0]

    def encode_many(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """Each text's ids, encoded without holding the GIL (`encode_batch_fast`, tokenizers >= 0.21: the same ids
        as `encode_batch` without the character offsets, which nothing here needs; the encoding of 600,000 digits
        peaks at +162 MB instead of +232 MB and takes 2.3 s instead of 2.8 s)."""
        if not texts:
            return []
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]

    def check_length(self, text: str, token_budget: int | None) -> None:
        """TextTooLong when `text` has more characters than `token_budget` tokens can stand for (max_token_chars,
        then, for a text long enough to be in doubt, the finer bound of its own characters: _Spellings); nothing
        when either bound is unknown."""
        self.check_chars(len(text), token_budget)
        if token_budget is None or self._spellings is None or len(text) <= token_budget:
            return  # (a token is at least one character: no text this short can be refused)
        per = self._spellings.longest(text)
        if len(text) > token_budget * per:
            raise TextTooLong(
                f"the text has {len(text)} characters, more than {token_budget} tokens can hold "
                f"(at most {per} characters per token for the characters it uses)"
            )

    def check_chars(self, chars: int, token_budget: int | None) -> None:
        """check_length for a text of `chars` characters (several texts' total, say)."""
        per = self.max_token_chars
        if token_budget is not None and per is not None and chars > token_budget * per:
            raise TextTooLong(
                f"the text has {chars} characters, more than {token_budget} tokens can hold "
                f"(at most {per} characters per token with this tokenizer)"
            )

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def _detect_decoder(self) -> tuple[str, bool]:
        state = self._tok.decoder.__getstate__().decode() if self._tok.decoder is not None else ""
        byte_fallback = '"ByteFallback"' in state
        if '"ByteLevel"' in state:
            return "bytelevel", byte_fallback
        if byte_fallback or '"Metaspace"' in state or "▁" in state or "\\u2581" in state:
            return "sentencepiece", byte_fallback
        return "plain", byte_fallback

    def token_bytes(self, i: int) -> bytes:
        """The raw bytes token `i` stands for, e.g. for grammar-constrained decoding. Byte-level BPE: through the
        GPT-2 byte table; SentencePiece: `<0xNN>` is one byte and `▁` a space (the leading space is kept: this is
        the token's own text, not `decode([i])`, which strips it). Added tokens: their content as UTF-8."""
        if (b := self._bytes_cache.get(i)) is not None:
            return b
        if i in self._added_content:
            b = self._added_content[i].encode()
        else:
            tok = self._tok.id_to_token(i)
            if tok is None:
                raise IndexError(f"token id {i} out of range")
            if self._decoder_kind == "bytelevel":
                table = gpt2_unicode_to_byte()
                # Same fallback as the ByteLevel decoder: a token with a character outside the table is UTF-8.
                b = bytes(table[c] for c in tok) if all(c in table for c in tok) else tok.encode()
            elif self._decoder_kind == "sentencepiece":
                m = _BYTE_TOKEN.match(tok)
                b = bytes([int(m.group(1), 16)]) if m else tok.replace("▁", " ").encode()
            else:
                b = tok.encode()
        self._bytes_cache[i] = b
        return b

    # -- chat template ------------------------------------------------------------------------------------------
    def _select_template(self, tools: Any) -> str:
        t = self.chat_template
        if isinstance(t, list):  # tokenizer_config's multi-template form: [{"name": ..., "template": ...}]
            t = {d["name"]: d["template"] for d in t}
        if isinstance(t, dict):
            t = t.get("tool_use") if tools and "tool_use" in t else t.get("default")
        if not t:
            raise ValueError("this model has no chat template; send a plain completion or give the model a template")
        return t

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        **kwargs,
    ) -> str:
        """Render like transformers' apply_chat_template(tokenize=False). Template errors (including its own
        raise_exception) become ValueError so the HTTP layer can answer 400."""
        source = self._select_template(tools)
        variables = {**self.special_tokens, "additional_special_tokens": self.additional_special_tokens, **kwargs}
        try:
            return _compile_template(source).render(
                messages=messages,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except Exception as e:  # TemplateError, or e.g. a TypeError from messages the template did not expect
            raise ValueError(f"chat template error: {e}") from e

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        token_budget: int | None = None,
        **template_kwargs,
    ) -> list[int]:
        """The chat prompt's ids: apply_chat_template, then encode, except that special-token text coming from the
        request (any string in `messages` or in `template_kwargs`, e.g. tools) is encoded as plain text.

        Why: encoding the rendered text would turn a user's `<|im_end|>\\n<|im_start|>system\\n...` into real
        turn boundaries, spoofing roles against the operator's system prompt. The OpenAI API keeps such text as text.
        The special tokens the template itself writes (and the bos/eos variables it is given) stay real.

        A request without special-token text (nearly all) is rendered and encoded exactly as before, so its ids
        are those of transformers' apply_chat_template(tokenize=True). Otherwise each special token's text in the
        inputs is replaced by a marker before rendering (a Private Use Area character found in no input, the token's
        index, the character again: not whitespace, so filters such as trim act on the same places), the rendered
        text is encoded normally to find the template's special tokens (added-token matching, lstrip/rstrip
        included), and each run of text between two of them that holds a marker is encoded again, markers turned
        back into the tokens' text, by a copy of the tokenizer whose special tokens are plain text
        (`encode_special_tokens`, tokenizers >= 0.15). Runs without a marker keep the normal encoding's ids.

        `token_budget`: the rendered text is refused (TextTooLong) before encoding when it cannot fit (`encode`).
        """
        inputs = (messages, template_kwargs)
        if self._special_re is None or not any(self._special_re.search(s) for s in _strings(inputs)):
            rendered = self.apply_chat_template(messages, add_generation_prompt, **template_kwargs)
            return self.encode(rendered, token_budget=token_budget)
        special_re = self._special_re
        taken: set[str] = set()  # one pass over the inputs (a large body must not cost 6400 scans)
        for s in (
            *_strings(inputs),
            str(self.chat_template),
            *self.special_tokens.values(),
            *self.additional_special_tokens,
        ):
            taken.update(_PRIVATE_USE_CHAR.findall(s))
        sentinel = next((c for c in map(chr, _PRIVATE_USE) if c not in taken), None)
        if sentinel is None:  # a request using all 6400 private-use characters: refuse rather than guess
            raise ValueError("messages use every private-use character; cannot keep special-token text as text")

        def mark(s: str) -> str:
            return special_re.sub(lambda m: f"{sentinel}{self._special_index[m.group()]}{sentinel}", s)

        rendered = self.apply_chat_template(
            _map_strings(messages, mark), add_generation_prompt, **_map_strings(template_kwargs, mark)
        )
        # what gets encoded: the markers back as the special tokens' texts (each piece of them still a token of at
        # most max_token_chars characters)
        plain = re.sub(f"{sentinel}(\\d+){sentinel}", lambda m: self._special_texts[int(m.group(1))], rendered)
        self.check_length(plain, token_budget)
        return self._encode_marked(rendered, sentinel)

    def _encode_marked(self, rendered: str, sentinel: str) -> list[int]:
        marker = re.compile(f"{sentinel}(\\d+){sentinel}")
        enc = self._tok.encode_batch([rendered], add_special_tokens=False)[0]
        ids: list[int] = []
        run: list[int] = []  # the normal encoding of the text since the last real special token
        start = 0  # where that text starts in `rendered`

        def end_run(end: int) -> None:
            text = rendered[start:end]
            if sentinel not in text:
                ids.extend(run)
                return
            # A marker a template filter cut in two leaves a lone sentinel: it is ours, not the user's, so drop it
            text = marker.sub(lambda m: self._special_texts[int(m.group(1))], text).replace(sentinel, "")
            plain = self._plain_tokenizer(first=start == 0)
            ids.extend(plain.encode_batch([text], add_special_tokens=False)[0].ids)

        for i, (a, b) in zip(enc.ids, enc.offsets):
            # A special id is a template token only if it matched its text (an <unk> may stand for a marker)
            if i in self.special_ids and self._added_content[i] in rendered[a:b]:
                end_run(a)
                ids.append(i)
                run, start = [], b
            else:
                run.append(i)
        end_run(len(rendered))
        return ids

    def _plain_tokenizer(self, first: bool) -> tokenizers.Tokenizer:
        """A copy of the tokenizer that encodes special-token text as plain text. Two copies, because Metaspace's
        prepend_scheme "first" prepends "▁" only to the text at offset 0 of the whole input: a run encoded alone
        that does not start the prompt must not get it. Copies, not a flag toggled on the shared tokenizer,
        because several threads encode with it at once."""
        with self._plain_lock:
            if self._plain is None:
                state = json.loads(self._tok.to_str())
                at_start = tokenizers.Tokenizer.from_str(json.dumps(state))
                later = tokenizers.Tokenizer.from_str(json.dumps(state)) if _never_prepend(state) else at_start
                for t in (at_start, later):
                    t.encode_special_tokens = True
                self._plain = at_start, later
            return self._plain[0 if first else 1]
