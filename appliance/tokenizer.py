"""Tokenizer for the runtime: `tokenizers` for the vocabulary, jinja2 for the chat template. No transformers.

Reads a HF model folder: tokenizer.json, tokenizer_config.json (special tokens, inline chat template),
chat_template.jinja (preferred over the inline template, as transformers does) and generation_config.json
(extra EOS ids). `decode` is the raw `tokenizers` decode; transformers' `clean_up_tokenization_spaces` is not
applied because it is not incremental (the streaming detokenizer could not reproduce it).
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


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
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """A HF tokenizer folder, loaded without transformers."""

    def __init__(self, tok: tokenizers.Tokenizer, config: dict | None = None,
                 chat_template: str | dict | list | None = None, generation_config: dict | None = None):
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
            i for b in range(256) if has_byte_fallback and (i := tok.token_to_id(f"<0x{b:02X}>")) is not None)
        self._bytes_cache: dict[int, bytes] = {}

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
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
        return cls(tokenizers.Tokenizer.from_file(str(tok_file)), config, template,
                   _read_json(path / "generation_config.json"))

    # -- vocabulary ---------------------------------------------------------------------------------------------
    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Default False: chat templates already spell out BOS and friends in the text."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

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

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, documents: list[dict] | None = None, **kwargs) -> str:
        """Render like transformers' apply_chat_template(tokenize=False). Template errors (including its own
        raise_exception) become ValueError so the HTTP layer can answer 400."""
        source = self._select_template(tools)
        variables = {**self.special_tokens, "additional_special_tokens": self.additional_special_tokens, **kwargs}
        try:
            return _compile_template(source).render(messages=messages, tools=tools, documents=documents,
                                                    add_generation_prompt=add_generation_prompt, **variables)
        except Exception as e:  # TemplateError, or e.g. a TypeError from messages the template did not expect
            raise ValueError(f"chat template error: {e}") from e
