"""Tool calls in the generated text: the parsers of the common formats and the grammar that forces calls.

Formats (the model's chat template picks one engine-side, appliance/server/tool_prompt.py; `--tool-parser` overrides):
- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated (Qwen2.5/3, Hermes, and the
  prompt the appliance writes for a template that knows no tools);
- llama3_json: `{"name": ..., "parameters": {...}}` at the start of the output, optionally after `<|python_tag|>`,
  several separated by `;`;
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (a bare array at the start too: the marker is a
  special token a detokenizer may drop).

One incremental parser serves unary and streaming (unary feeds the whole text at once), so both give the same
calls and content. Text that may be the start of a marker is held back, as a stop-string matcher does; a call's
arguments are emitted only once the call is complete and its JSON parsed, so streamed arguments always concatenate
to valid JSON. Text shaped like a call that is not valid JSON stays content. Whitespace between content and a
call is dropped (models write newlines around calls).

JSON nested deeper than Python's recursion limit (~1000 levels; the stdlib decoder recurses per level) is no call
either: the decoder's RecursionError is caught and the text stays content, so such output (steerable with a
regex response_format or injected text) is a normal answer, never a 500 or a broken stream.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from appliance.api.parsers import canonical_schema, inline_one_of_refs
from appliance.params import TOOL_CALL_FORMATS, Grammar

FORMATS = TOOL_CALL_FORMATS  # the parser names (`--tool-parser`, EngineStatus.tool_parser)
_OPEN = {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}
_CLOSE = {"hermes": "</tool_call>"}
_BARE = {"llama3_json": "{", "mistral": "["}  # a call that starts the output (or follows a call) without a marker
_ARGS = {"hermes": "arguments", "llama3_json": "parameters", "mistral": "arguments"}
# JSON layout of constrained calls: no free whitespace (a small model may emit it forever), json.dumps' separators
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_decoder = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object; of its start only when `cut`
    cut: bool = False  # max_tokens ended the output inside this call (finish_reason stays "length")

    def to_openai(self, call_id: str) -> dict:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _call(value: object) -> ToolCall | None:
    """{"name": str, "arguments" | "parameters": object (or its JSON text)} -> ToolCall; anything else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    try:
        if isinstance(args, str):
            args = json.loads(args)
        if not isinstance(args, dict) or set(value) - {"name", "arguments", "parameters", "id", "type"}:
            return None
        return ToolCall(value["name"], json.dumps(args, ensure_ascii=False))
    except (ValueError, RecursionError):  # not JSON, or nested past the recursion limit: not a call
        return None


def _calls(value: object) -> list[ToolCall] | None:
    """A call or a list of calls (mistral's array); None unless every item is a call."""
    items = value if isinstance(value, list) else [value]
    calls = [_call(v) for v in items]
    return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (it may become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


Event = tuple[str, "str | ToolCall"]  # ("content", text) | ("call", ToolCall)


class ToolCallParser:
    """Feed text as it comes (`feed`), then `finish`; each returns ("content", text) and ("call", ToolCall) events."""

    def __init__(self, fmt: str):
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool call format {fmt!r}: one of {', '.join(FORMATS)}")
        self.open, self.close, self.bare = _OPEN[fmt], _CLOSE.get(fmt), _BARE.get(fmt)
        self.buf = ""
        self.raw = ""  # the call's text so far (marker included), content again if it does not parse
        self.in_call = False
        self.at_start = True  # nothing but whitespace since the output's start or the last call: a bare call may come
        self.after_call = False
        self.ws = ""  # whitespace held until we know whether a call follows it
        self.calls = 0

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self, cut: bool = False) -> list[Event]:
        """The end of the output. `cut`: max_tokens ended it where only calls may be (tool_choice required /
        named): a call it cut is returned as far as it got (_cut_calls), as OpenAI returns it, not as content."""
        out: list[Event] = []
        while self._step(out, final=True):
            pass
        if self.in_call and cut:
            if so_far := _cut_calls(self.buf):
                self._emit_calls(out, so_far)
            self.in_call, self.raw, self.buf = False, "", ""
        if self.in_call:  # cut, or closed by the end of the output: a call if its JSON is whole, else content
            calls = self._parse(self.buf)
            if calls:
                self._emit_calls(out, calls)
            else:
                self._content(out, self.raw + self.buf)
            self.in_call, self.raw, self.buf = False, "", ""
        if self.buf:
            self._content(out, self.buf)
            self.buf = ""
        if self.ws and not self.after_call:
            out.append(("content", self.ws))
        self.ws = ""
        return out

    # ---- one step of the state machine; True while it made progress
    def _step(self, out: list[Event], final: bool) -> bool:
        if not self.buf:
            return False
        if self.in_call:
            return self._step_call(out)
        if self.at_start:
            stripped = self.buf.lstrip()
            if not stripped:
                return False
            if self.after_call and stripped.startswith(";") and self.bare:  # llama3's separator between calls
                self.buf = stripped[1:]
                return True
            if self.bare and stripped.startswith(self.bare):
                self.buf, self.in_call, self.raw, self.at_start = stripped, True, "", False
                return True
        at = self.buf.find(self.open)
        if at >= 0:
            self._content(out, self.buf[:at])
            self.buf, self.in_call, self.raw, self.at_start = self.buf[at + len(self.open) :], True, self.open, False
            return True
        keep = 0 if final else _held(self.buf, self.open)
        self._content(out, self.buf[: len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep :]
        return False

    def _step_call(self, out: list[Event]) -> bool:
        if self.close is not None:
            at = self.buf.find(self.close)
            if at < 0:
                return False
            body, self.buf = self.buf[:at], self.buf[at + len(self.close) :]
            calls = self._parse(body)
            if calls:
                self._emit_calls(out, calls)
            else:
                self._content(out, self.raw + body + self.close)
            self.in_call, self.raw = False, ""
            return True
        stripped = self.buf.lstrip()
        if not stripped or "}" not in stripped and "]" not in stripped:
            return False
        try:
            value, end = _decoder.raw_decode(stripped)
        except RecursionError:  # nested past the recursion limit: no call's arguments are, so it is content
            self._content(out, self.raw + self.buf)
            self.buf, self.in_call, self.raw = "", False, ""
            return True
        except ValueError:
            return False  # incomplete (or invalid: then finish() makes it content)
        calls = _calls(value)
        lead = self.buf[: len(self.buf) - len(stripped)]
        if calls:
            self._emit_calls(out, calls)
        else:
            self._content(out, self.raw + lead + stripped[:end])
        self.buf, self.in_call, self.raw = stripped[end:], False, ""
        return True

    def _parse(self, body: str) -> list[ToolCall] | None:
        try:
            return _calls(json.loads(body))
        except (ValueError, RecursionError):
            return None

    def _emit_calls(self, out: list[Event], calls: list[ToolCall]) -> None:
        self.ws = ""  # whitespace before a call is the call's layout
        out.extend(("call", c) for c in calls)
        self.calls += len(calls)
        self.after_call = self.at_start = True

    def _content(self, out: list[Event], text: str) -> None:
        """Content, with whitespace that touches a call dropped: trailing whitespace waits for what follows."""
        if not text:
            return
        body = text.rstrip()
        if not body:
            self.ws += text
            return
        lead = "" if self.after_call else self.ws
        if self.after_call:
            body = body.lstrip()
        out.append(("content", lead + body))
        self.ws, self.after_call, self.at_start = text[len(text.rstrip()) :], False, False


_CUT_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*(,\s*"(?:arguments|parameters)"\s*:\s*)?')


def _cut_calls(body: str) -> list[ToolCall]:
    """The calls in a call's text that max_tokens cut (one call, or mistral's array of them): the whole ones, then
    the last as far as it got: its name and its arguments' text so far (the start of a JSON object, "" before it),
    marked `cut`. That is how OpenAI returns a call cut by max_tokens (finish_reason "length"), so a client keeps
    what was generated instead of a message with neither content nor calls. A call whose name is not complete
    yet is none. Only where a grammar allowed nothing but calls (tool_choice required / named): the text is then
    the grammar's layout (`{"name": "f", "arguments": ...`), and the name one of the tools'."""
    text = body.lstrip()
    text = text[1:] if text.startswith("[") else text
    calls: list[ToolCall] = []
    while text := text.lstrip().removeprefix(",").lstrip():
        try:
            value, end = _decoder.raw_decode(text)
        except (ValueError, RecursionError):
            head = _CUT_HEAD.match(text)
            if head:
                calls.append(ToolCall(json.loads(head[1]), text[head.end() :] if head[2] else "", cut=True))
            break
        call = _call(value)
        if call is None:
            break
        calls.append(call)
        text = text[end:]
    return calls


def parse_tool_calls(text: str, fmt: str, cut: bool = False) -> tuple[str, list[ToolCall]]:
    """Unary: (content, calls). `cut`: as ToolCallParser.finish's."""
    p = ToolCallParser(fmt)
    events = p.feed(text) + p.finish(cut)
    content = "".join(v for k, v in events if k == "content")  # type: ignore[misc]
    return content, [v for k, v in events if k == "call"]  # type: ignore[misc]


# ---- grammars for tool_choice "required" / named (SamplingParams.grammar = Grammar("lark", ...))
def _lark_string(s: str) -> str:
    return json.dumps(s)


_SUBSCHEMAS = ("items", "additionalItems", "not", "if", "then", "else", "contains")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def closed_objects(schema: Any) -> Any:
    """A copy of a parameters schema in which every object that lists `properties` and says nothing of
    `additionalProperties` allows no other keys (OpenAI's strict mode, xgrammar's default for tools). Without it
    a small model fills an open object with keys of its own until max_tokens (seen with the default model and
    LangChain's non-strict pydantic tools): a call's arguments are meant to be the declared ones."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = closed_objects(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_objects(v) for k, v in out[key].items()}
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _arguments_schema(tool: dict, budget: int) -> tuple[dict, int]:
    """The schema a call's arguments follow, and the characters the oneOf inlining added to it (at most `budget`):
    the tool's parameters (closed_objects, and oneOf branches inlined as a response_format's are:
    parsers.inline_one_of_refs), compiled as a JSON document of its own, as a response_format's schema is, so that
    its `$ref`s ("#/$defs/Address", "#" for a recursive model) resolve against the parameters, where the client
    wrote them. Its layout is the appliance's (no free whitespace, json.dumps' separators) unless the schema's own
    "x-guidance" says otherwise."""
    closed = closed_objects(tool["function"].get("parameters") or {"type": "object", "properties": {}})
    params = inline_one_of_refs(closed, budget)
    added = len(canonical_schema(params)) - len(canonical_schema(closed))
    own = params.get("x-guidance")
    return {**params, "x-guidance": {**_JSON_LAYOUT, **own} if isinstance(own, dict) else _JSON_LAYOUT}, added


def _call_rules(i: int, tool: dict, fmt: str, budget: int) -> tuple[list[str], int]:
    """tool{i}: the call's fixed head (its name, then the arguments key) as a literal, then the arguments; and the
    characters the arguments' oneOf inlining added (out of `budget`)."""
    head = f'{{"name": {json.dumps(tool["function"]["name"])}, "{_ARGS[fmt]}": '
    arguments, added = _arguments_schema(tool, budget)
    schema = json.dumps(arguments, separators=(",", ":"))  # one line (Grammar.parts counts lines)
    return [f'tool{i}: {_lark_string(head)} args{i} "}}"', f"args{i}: %json {schema}"], added


def _label(tool: dict) -> str:
    return f"the parameters of function {tool['function']['name']!r}"


class GrammarTooLong(ValueError):
    """The tools' grammar is over the limits table's `grammar_chars` (a 400 naming `tools`)."""


def tool_grammar(
    tools: list[dict], fmt: str, *, parallel: bool, name: str | None = None, max_chars: int | None = None
) -> Grammar:
    """A Lark grammar (llguidance) for one call of `name`, else one or more calls (one unless `parallel`) of the
    given tools, each call's arguments constrained by its tool's parameters schema. Markers that are special tokens
    in their models (`<|python_tag|>`, `[TOOL_CALLS]`) are left out: the parsers take bare calls.

    `max_chars` (the limits table's `grammar_chars`, which bounds a response_format's schema as canonical JSON):
    the chosen tools' parameters schemas, as canonical JSON, must not be longer together, else GrammarTooLong. So
    tool_choice "required" or a named tool meets the same bound as a response_format (without it the body size
    was the only bound: 128 tools of any size). The grammar adds 260 to 320 characters of its own per tool (the
    call's head and layout; 33,000 for 128 tools with 64-character names), and `"additionalProperties":false` to
    each object closed_objects closes: bounded by the schemas' own size, not the client's to grow. The oneOf
    branches parsers.inline_one_of_refs inlines add at most what is left of `max_chars` (all tools together;
    without `max_chars`, at most the schemas' own size).

    Each call is its head as a literal (`{"name": "f", "arguments": `) and then the arguments as a `%json` block
    of their own: a JSON schema's `$ref`s are pointers from its document's root, so the parameters must be that
    root ("#/$defs/Address" and a recursive model's "#" then mean what they mean in a response_format). The
    `%json` lines are labelled by tool (Grammar.parts): a schema that does not compile is a 400 on `tools`
    naming the function."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool call format {fmt!r}")
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise ValueError(f"no tool named {name!r}")
    size = sum(len(json.dumps(t["function"].get("parameters") or {}, separators=(",", ":"))) for t in chosen)
    if max_chars is not None:
        if size > max_chars:
            which = f"tool {name!r}" if name is not None else f"the {len(chosen)} tools"
            raise GrammarTooLong(
                f"tools: the parameters schemas tool_choice constrains the output to ({which}) are {size} "
                f"characters of JSON, longer than {max_chars}"
            )
    budget = max_chars - size if max_chars is not None else size  # what oneOf inlining may add, all tools together
    rules: list[str] = []
    for i, t in enumerate(chosen):
        tool_rules, added = _call_rules(i, t, fmt, budget)
        rules += tool_rules
        budget -= max(added, 0)
    body = " | ".join(f"tool{i}" for i in range(len(chosen)))
    many = parallel and name is None
    if fmt == "hermes":
        call = f'call: "<tool_call>\\n" ({body}) "\\n</tool_call>"'
        start = 'start: call ("\\n" call)*' if many else "start: call"
    elif fmt == "llama3_json":
        call = f"call: {body}"
        start = 'start: call ("; " call)*' if many else "start: call"
    else:
        call = f"call: {body}"
        start = 'start: "[" call (", " call)* "]"' if many else 'start: "[" call "]"'
    text = "\n".join([start, call, *rules]) + "\n"
    return Grammar("lark", text, param="tools", parts=tuple(_label(t) for t in chosen))
