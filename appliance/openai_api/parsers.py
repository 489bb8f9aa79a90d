"""Parsers of the structured request fields of issue 11: structured output (`response_format`, Cerebras's
`grammar_root`), chat tools, and Friendli's list-valued completions fields (`tokens`, `seed` as a list,
`stop_tokens`, `bad_words`, `bad_word_tokens`), and OpenAI's `prediction` (speculative decoding, issue 12).

Each is a validation.py `Parser`, (value, limits, fields read so far) -> value, checking one field alone; the rules
across fields are in validation.py, and the JSON schemas (docs/openapi.json) in fields.py. Whether a schema, regex or
grammar compiles is decided engine-side (runtime/grammar.py, a 400 naming `response_format` from there): the HTTP
workers do not import llguidance. JSON schemas are written as canonical JSON (sorted keys, no spaces) so that equal
schemas share one compilation, whatever key order or spacing each client sends.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from appliance.limits import Limits
from appliance.openai_api import fields as F
from appliance.openai_api.errors import invalid
from appliance.params import Grammar

_TOOL_NAME = re.compile(F.TOOL_NAME_PATTERN)
# Cerebras grammar_root values with no JSON-value meaning: the rules of its own tool-call grammar
_TOOL_ROOTS = ("funcall", "tool_name", "tool_args", "tool_call", "tool_calls")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _id(value: Any) -> bool:
    return _is_int(value) and 0 <= value <= F.UINT32_MAX


def canonical_schema(schema: dict) -> str:
    """The schema as compact JSON text, keys in the client's order: the output's properties follow the order of
    `properties` (as OpenAI documents; a schema that puts "reasoning" before "answer" relies on it), so sorting
    the keys for a better cache hit rate would change the output."""
    return json.dumps(schema, separators=(",", ":"))


def _grammar(kind: str, text: str, limits: Limits, param: str = "response_format") -> Grammar:
    if len(text) > limits.grammar_chars:
        raise invalid(f"{param}: the {kind} is longer than {limits.grammar_chars} characters", param)
    return Grammar(kind, text)  # type: ignore[arg-type]


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(f"response_format.{what} must be a non-empty string", "response_format")
    return value


def response_format(value: Any, limits: Limits, read: dict) -> Grammar | None:
    """OpenAI's text / json_object / json_schema, Friendli's json_object with a `schema` string and regex, and a
    Lark or GBNF grammar -> the Grammar the output must match (None: free text)."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid("response_format must be an object with a string type", "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema = value.get("schema")
        if schema is None:
            return _grammar("json_schema", canonical_schema({"type": "object"}), limits)
        if isinstance(schema, str):  # Friendli: the JSON schema as a string
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise invalid(f"response_format.schema is not valid JSON: {exc}", "response_format") from None
        if not isinstance(schema, dict):
            raise invalid("response_format.schema must be a JSON schema (an object)", "response_format")
        return _grammar("json_schema", canonical_schema(schema), limits)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise invalid("response_format json_schema needs a json_schema object", "response_format")
        for name, types in (("name", str), ("description", str), ("strict", bool)):
            if spec.get(name) is not None and not isinstance(spec[name], types):
                raise invalid(f"response_format.json_schema.{name} has the wrong type", "response_format")
        if not isinstance(spec.get("schema"), dict):
            raise invalid("response_format.json_schema.schema must be a JSON schema (an object)", "response_format")
        return _grammar("json_schema", canonical_schema(spec["schema"]), limits)
    if kind == "regex":
        return _grammar("regex", _text(value.get("schema"), "schema"), limits)
    if kind == "grammar":
        form: dict = value["grammar"] if isinstance(value.get("grammar"), dict) else value
        syntax = form.get("syntax")
        if syntax not in ("lark", "gbnf"):
            raise invalid("response_format grammar syntax must be \"lark\" or \"gbnf\"", "response_format")
        return _grammar(syntax, _text(form.get("definition"), "definition"), limits)
    raise invalid(
        f"response_format type {kind!r} is not one of text, json_object, json_schema, regex, grammar", "response_format"
    )


def grammar_root(value: Any, limits: Limits, read: dict) -> Grammar:
    """Cerebras's grammar_root: a JSON value of one kind (a JSON schema); its tool-call roots are refused."""
    if isinstance(value, str) and value in F.GRAMMAR_ROOTS:
        return Grammar("json_schema", canonical_schema(F.GRAMMAR_ROOTS[value]))
    if value in _TOOL_ROOTS:
        raise invalid(
            f"grammar_root {value!r} is a rule of Cerebras's tool-call grammar, which this server does not have: "
            "use chat tools with tool_choice \"required\" or a named function",
            "grammar_root",
        )
    raise invalid(f"grammar_root must be one of {', '.join(F.GRAMMAR_ROOTS)}", "grammar_root")


def tools(value: Any, limits: Limits, read: dict) -> tuple[dict, ...]:
    """Each {"type": "function", "function": {...}}, kept with only the fields a template and a parser use."""
    if not isinstance(value, list):
        raise invalid("tools is not an array", "tools")
    if len(value) > limits.tools:
        raise invalid(f"tools must have no more than {limits.tools} functions", "tools")
    out, names = [], set()
    for tool in value:
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise invalid("each tool must be {\"type\": \"function\", \"function\": {...}}", "tools")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise invalid("tool function names must match ^[a-zA-Z0-9_-]{1,64}$", "tools")
        if name in names:
            raise invalid(f"tool function names must be unique: {name!r} is given twice", "tools")
        names.add(name)
        kept: dict[str, Any] = {"name": name}
        for key, types, what in (
            ("description", str, "a string"),
            ("parameters", dict, "a JSON schema (an object)"),
            ("strict", bool, "a boolean"),
        ):
            if fn.get(key) is not None:
                if not isinstance(fn[key], types):
                    raise invalid(f"tool {name!r}: function.{key} must be {what}", "tools")
                kept[key] = fn[key]
        out.append({"type": "function", "function": kept})
    return tuple(out)


def tool_choice(value: Any, limits: Limits, read: dict) -> tuple[str, str | None]:
    """(ChatRequest.tool_choice, tool_name)."""
    if value in ("none", "auto", "required"):
        return value, None
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        if isinstance(name, str) and name:
            return "named", name
    raise invalid(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def seeds(value: Any, limits: Limits, read: dict) -> int | tuple[int, ...]:
    """A seed, or (Friendli) a list of one seed per choice (its length is checked against n by the caller)."""
    if _is_int(value):
        if not _id(value):
            raise invalid("seed out of range [0, 4294967295]", "seed")
        return value
    if not isinstance(value, list):
        raise invalid("seed is not an integer", "seed")
    if value and len(value) <= limits.n and all(_id(s) for s in value):
        return tuple(value)
    raise invalid("a seed list must hold one integer in [0, 4294967295] per choice", "seed")


def tokens(value: Any, limits: Limits, read: dict) -> tuple[int, ...]:
    """Friendli's prompt as token ids (each checked against the vocabulary engine-side)."""
    if not isinstance(value, list) or not value or not all(_is_int(t) and t >= 0 for t in value):
        raise invalid("tokens is not a non-empty array of token ids", "tokens")
    return tuple(value)


def token_lists(name: str, count: str) -> Callable[[Any, Limits, dict], tuple[tuple[int, ...], ...]]:
    """Friendli's [{"tokens": [ids]}] (stop_tokens, bad_word_tokens): at most `count` (a Limits field) entries."""

    def parse(value: Any, limits: Limits, read: dict) -> tuple[tuple[int, ...], ...]:
        most = getattr(limits, count)
        if not isinstance(value, list):
            raise invalid(f'{name} is not an array of {{"tokens": [token ids]}}', name)
        if len(value) > most:
            raise invalid(f"{name} must have no more than {most} entries", name)
        out = []
        for entry in value:
            ids = entry.get("tokens") if isinstance(entry, dict) else None
            if not isinstance(ids, list) or not ids or not all(_id(t) for t in ids):
                raise invalid(f'{name} entries must be {{"tokens": [token ids]}} with at least one id', name)
            if len(ids) > limits.token_sequence:
                raise invalid(f"{name} entries must have no more than {limits.token_sequence} token ids", name)
            out.append(tuple(ids))
        return tuple(dict.fromkeys(out))

    return parse


def bad_words(value: Any, limits: Limits, read: dict) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(w, str) and w for w in value):
        raise invalid("bad_words is not an array of non-empty strings", "bad_words")
    if len(value) > limits.bad_words:
        raise invalid(f"bad_words must have no more than {limits.bad_words} entries", "bad_words")
    if any(len(w) > limits.stop_chars for w in value):
        raise invalid(f"bad_words strings must be at most {limits.stop_chars} characters long", "bad_words")
    return tuple(dict.fromkeys(value))


def prediction(value: Any, limits: Limits, read: dict) -> str:
    """OpenAI's Predicted Outputs: {"type": "content", "content": text or [{"type": "text", "text"}]} -> the text
    (parts joined as they are: the answer is expected to repeat them in order)."""
    if not isinstance(value, dict):
        raise invalid("prediction is not an object", "prediction")
    if set(value) - {"type", "content"}:
        raise invalid("prediction accepts only type and content", "prediction")
    if value.get("type") != "content":
        raise invalid('prediction type must be "content"', "prediction")
    content = value.get("content")
    if isinstance(content, list):
        ok = all(
            isinstance(p, dict) and set(p) == {"type", "text"} and p["type"] == "text" and isinstance(p["text"], str)
            for p in content
        )
        if not ok:
            raise invalid('prediction content parts must be {"type": "text", "text": string}', "prediction")
        content = "".join(p["text"] for p in content)
    elif not isinstance(content, str):
        raise invalid("prediction content is not a string or an array of text parts", "prediction")
    if len(content) > limits.prediction_chars:
        raise invalid(f"prediction content must be at most {limits.prediction_chars} characters", "prediction")
    return content
