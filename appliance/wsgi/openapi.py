"""docs/openapi.json's generated parts, so that the document cannot drift from what the server checks.

The request schemas (CompletionRequest, ChatCompletionRequest, TokenizeRequest) come from the field tables in
appliance/openai_api/fields.py, the same tables appliance/api/table.py walks, with bounds from `Limits()` defaults;
the rules across fields are written here in JSON-schema form (the code that enforces them is in
appliance/openai_api/validation.py, completions.py and chat.py). ResponsesRequest is written here from
responses.py's field list (chat's schemas for the fields it hands on unchanged); MessagesRequest and
CountTokensRequest (Anthropic's) come from the Messages adapter's field table (appliance/anthropic_api/request.py).
Each is no stricter than its parser (the negative fuzz run of tests/e2e/test_fuzz.py checks the converse on the running
server) and every bound comes from `Limits` (tests/api/test_adapter_limits.py). The Responses routes' path and query
parameters get their bounds here too. The `limits` object of the Config schema comes from `appliance.limits.Limits`.
The rest of the document (paths, responses, response schemas) is written by hand in docs/openapi.json itself: edit
it there, then regenerate.

    python -m appliance.wsgi.openapi           # rewrite docs/openapi.json in place
    python -m appliance.wsgi.openapi --check   # exit 1 if it is not current (tests/api/test_openapi_generated.py)
"""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import appliance
from appliance.anthropic_api.request import COUNT_TOKENS, MESSAGES
from appliance.api.table import Field
from appliance.limits import Limits
from appliance.openai_api.fields import CHAT, REQUESTS
from appliance.openai_api.responses import ACCEPTED_IGNORED, EFFORTS, FIELDS, IDENTIFIERS, SUMMARIES

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"


def field_schema(f: Field, limits: Limits) -> dict:
    """One property's JSON schema; an optional field also takes null ("not set")."""
    if f.kind == "any":
        schema: dict[str, Any] = {}
    elif f.kind == "custom":
        assert f.schema is not None, f.name
        schema = f.schema(limits)
    else:
        schema = {"type": f.kind, **_bounds(f, limits)}
        if f.also:
            schema = {"anyOf": [schema, *({"type": f.kind, "const": v} for v in f.also)]}
    if not f.required and f.kind != "any":
        schema = _nullable(schema)
    if f.description:
        schema["description"] = f.text(f.description, limits)
    return schema


def _bounds(f: Field, limits: Limits) -> dict:
    """The tightest bound on each side (a limit that is None is no bound)."""
    out: dict[str, Any] = {}
    for side, tighter in (("min", max), ("max", min)):
        resolved = [(b.resolve(limits), b.exclusive) for b in f.bounds if b.side == side]
        edges: list[tuple[float, bool]] = [(v, x) for v, x in resolved if v is not None]
        if edges:
            value = tighter(v for v, _ in edges)
            exclusive = any(x for v, x in edges if v == value)
            key = (
                ("exclusiveMinimum" if exclusive else "minimum")
                if side == "min"
                else ("exclusiveMaximum" if exclusive else "maximum")
            )
            out[key] = value
    return out


def _nullable(schema: dict) -> dict:
    if "anyOf" in schema:
        return {**schema, "anyOf": [*schema["anyOf"], {"type": "null"}]}
    return {**schema, "type": [schema["type"], "null"]}


def _when(name: str, condition: dict, then: dict) -> dict:
    return {"if": {"required": [name], "properties": {name: condition}}, "then": then}


def _rules(request: str, limits: Limits) -> list[dict]:
    """validation.py's rules across fields, as JSON Schema (for schemathesis and readers)."""
    if request == "TokenizeRequest":
        return []
    rules = [
        {
            "description": "\"stream_options provided, but stream not set to true\"",
            **_when(
                "stream_options",
                {"type": "object"},
                {"required": ["stream"], "properties": {"stream": {"const": True}}},
            ),
        },
        {
            "description": "\"best_of cannot be used in streaming mode\"",
            # include_stop_str_in_output: any value with a stream (a no-op kept in the rule: without it
            # schemathesis's canonicalizer gives up on the completions request's combined rules, tests/e2e/test_fuzz.py)
            **_when(
                "stream",
                {"const": True},
                {
                    "properties": {
                        "best_of": {"type": "null"},
                        "include_stop_str_in_output": {"enum": [True, False, None]},
                    }
                },
            ),
        },
        {
            "description": "\"n value cannot be greater than best_of\" (JSON Schema cannot compare two fields: "
            "one rule per best_of value)",
            "allOf": [
                _when("best_of", {"const": k}, {"properties": {"n": {"type": ["integer", "null"], "maximum": k}}})
                for k in range(1, min(limits.best_of + 1, limits.n))
            ],
        },
        {
            "description": "structured output (response_format) and beam search (best_of above 1) exclude each other",
            **_when("response_format", _GRAMMAR, {"properties": {"best_of": _NO_BEAMS}}),
        },
        {
            "description": "\"num_assistant_tokens and assistant_confidence_threshold are mutually exclusive and "
            "cannot both be set.\"",
            **_when(
                "num_assistant_tokens",
                {"type": "integer"},
                {"properties": {"assistant_confidence_threshold": {"type": "null"}}},
            ),
        },
    ]
    if request == "CompletionRequest":
        rules.extend(_completion_rules(limits))
    else:
        rules.append(
            {
                "description": "\"top_logprobs requires logprobs to be true\"",
                **_when(
                    "top_logprobs",
                    {"type": "integer"},
                    {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
                ),
            }
        )
        rules.append(
            {
                "description": "\"tool_choice is only allowed when tools are specified\"; a response_format "
                "grammar excludes tool_choice required or named",
                **_when(
                    "tool_choice",
                    {"type": ["string", "object"]},
                    {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
                ),
            }
        )
        rules.append(
            _when(
                "tool_choice",
                {"anyOf": [{"const": "required"}, {"type": "object"}]},
                {"properties": {"response_format": _NO_GRAMMAR}},
            )
        )
    return rules


_NO_GRAMMAR = {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"type": {"const": "text"}}}]}
_GRAMMAR = {  # a response_format that constrains the output
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"enum": ["json_object", "json_schema", "regex", "grammar"]}},
}
_NO_BEAMS = {"enum": [1, None]}


def _completion_rules(limits: Limits) -> list[dict]:
    """The rules across Friendli's and Cerebras's completions fields (completions.py `parse_completion`,
    `_friendli`)."""
    beam = {"type": "integer", "minimum": 2}
    return [
        {
            "description": "\"max_tokens value should be greater than 0 unless echo is set\"",
            **_when("max_tokens", {"const": 0}, {"required": ["echo"], "properties": {"echo": {"const": True}}}),
        },
        {
            "description": "\"prompt is missing\" unless `tokens` is given; not both",
            "anyOf": [
                {
                    "required": ["prompt"],
                    "properties": {"prompt": {"type": ["string", "array"]}, "tokens": {"type": "null"}},
                },
                {"required": ["tokens"], "properties": {"tokens": {"type": "array"}, "prompt": {"type": "null"}}},
            ],
        },
        {
            "description": "num_beams is best_of's other name: not both, not streaming, n <= num_beams (one rule "
            "per value)",
            "allOf": [
                _when("num_beams", {"type": "integer"}, {"properties": {"best_of": {"type": "null"}}}),
                _when("stream", {"const": True}, {"properties": {"num_beams": {"type": "null"}}}),
                *(
                    _when("num_beams", {"const": k}, {"properties": {"n": {"type": ["integer", "null"], "maximum": k}}})
                    for k in range(1, min(limits.best_of + 1, limits.n))
                ),
                _when("response_format", _GRAMMAR, {"properties": {"num_beams": _NO_BEAMS}}),
            ],
        },
        {
            "description": "early_stopping true needs beam search",
            **_when(
                "early_stopping",
                {"const": True},
                {
                    "anyOf": [
                        {"required": ["best_of"], "properties": {"best_of": beam}},
                        {"required": ["num_beams"], "properties": {"num_beams": beam}},
                    ]
                },
            ),
        },
        {
            "description": "grammar_root and a response_format grammar exclude each other",
            **_when(
                "grammar_root",
                {"type": "string"},
                {"properties": {"response_format": _NO_GRAMMAR, "best_of": _NO_BEAMS, "num_beams": _NO_BEAMS}},
            ),
        },
        {
            "description": "max_tokens and max_total_tokens exclude each other",
            **_when("max_total_tokens", {"type": "integer"}, {"properties": {"max_tokens": {"type": "null"}}}),
        },
        {
            "description": "a seed list has one seed per choice (one rule per n)",
            "allOf": [
                _when(
                    "seed",
                    {"type": "array", "minItems": k, "maxItems": k},
                    {"properties": {"n": {"enum": [1, None]}}}
                    if k == 1
                    else {"required": ["n"], "properties": {"n": {"const": k}}},
                )
                for k in range(1, limits.n + 1)
            ],
        },
    ]


def request_schema(request: str, limits: Limits = Limits()) -> dict:
    """components.schemas[request]: required fields first, then the table's order."""
    table, description = REQUESTS[request]
    ordered = sorted(table, key=lambda f: not f.required)
    schema: dict[str, Any] = {
        "type": "object",
        "required": [f.name for f in ordered if f.required],
        "description": description.format(**vars(limits)),
        "properties": {f.name: field_schema(f, limits) for f in ordered},
    }
    rules = _rules(request, limits)
    if rules:
        schema["allOf"] = rules
    schema["additionalProperties"] = True  # unknown fields are accepted (and logged)
    return schema


def limits_schema() -> dict:
    """Config's `limits` object: every Limits field, its type and help."""
    props = {}
    for f in fields(Limits):
        kind = {"int": "integer", "float": "number"}[str(f.type).split(" | ")[0]]
        nullable = f.default is not MISSING and f.default is None
        props[f.name] = {"type": [kind, "null"] if nullable else kind, "description": f.metadata["help"]}
    return {"type": "object", "additionalProperties": False, "required": list(props), "properties": props}


def table_schema(table: tuple[Field, ...], description: str, limits: Limits) -> dict:
    """The schema of another API's body from its field table (the Anthropic adapter's): unknown fields refused."""
    ordered = sorted(table, key=lambda f: not f.required)
    return {
        "type": "object",
        "required": [f.name for f in ordered if f.required],
        "description": description,
        "properties": {f.name: field_schema(f, limits) for f in ordered},
        "additionalProperties": False,
    }


def responses_request_schema(limits: Limits) -> dict:
    """ResponsesRequest: what appliance/openai_api/responses.py reads (other fields are a 400); the fields it hands
    to chat unchanged have chat's schemas (chat's field table), its own ones their bounds from the limits table."""
    chat = {f.name: f for f in CHAT}

    def like_chat(name: str) -> dict:
        return field_schema(chat[name], limits)

    identifier = {"type": ["string", "null"], "maxLength": limits.id_chars}
    choice = {"enum": ["none", "auto", "required"]}
    named = {"type": "object", "required": ["type"], "properties": {"type": {"const": "function"}}}
    reasoning = {
        "type": ["object", "null"],
        "additionalProperties": False,
        "properties": {
            "effort": {"enum": [*EFFORTS, None]},
            "summary": {"enum": [*SUMMARIES, None]},
            "generate_summary": {"enum": [*SUMMARIES, None]},
        },
        "description": "effort none / minimal: the model's thinking off (the chat template's enable_thinking), "
        "low and up: on. On a model without a reasoning parser anything but none is a 400.",
    }
    props: dict[str, Any] = {
        "model": {"type": "string"},
        "input": {
            "anyOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "maxItems": limits.messages,
                    "items": _input_item(limits),
                },
            ],
            "description": "A string (one user message) or items: messages (role + content string or input_text "
            "parts; a user message's input_image parts as chat's image_url: a data URL or a listed host's URL, "
            "file_id refused), function_call, function_call_output, reasoning (skipped). Required unless "
            "previous_response_id.",
        },
        "instructions": {"type": ["string", "null"]},
        "max_output_tokens": like_chat("max_tokens"),
        "temperature": like_chat("temperature"),
        "top_p": like_chat("top_p"),
        "frequency_penalty": like_chat("frequency_penalty"),
        "presence_penalty": like_chat("presence_penalty"),
        "text": {
            "type": ["object", "null"],
            "additionalProperties": False,
            "properties": {"format": {"type": ["object", "null"]}, "verbosity": {}},
            "description": "format: text, json_object or json_schema (name, schema, strict).",
        },
        "tools": {
            "type": ["array", "null"],
            "maxItems": limits.tools,
            "items": {"type": "object", "required": ["type"], "properties": {"type": {"const": "function"}}},
            "description": "Function tools only: {type: function, name, description, parameters, strict}.",
        },
        "tool_choice": {
            "anyOf": [choice, named, {"type": "null"}],
            "description": "none, auto, required or {type: function, name}.",
        },
        "parallel_tool_calls": like_chat("parallel_tool_calls"),
        "reasoning": reasoning,
        "stream": {"type": ["boolean", "null"]},
        "store": {"type": ["boolean", "null"], "description": "Default true."},
        "previous_response_id": identifier,
        "truncation": {"enum": ["disabled", None]},
        "background": {"enum": [False, None]},
        "top_logprobs": {"enum": [0, None]},
        "max_tool_calls": {"type": "null"},
        "metadata": {
            "type": ["object", "null"],
            "maxProperties": limits.metadata,
            "propertyNames": {"maxLength": limits.metadata_key_chars},
            "additionalProperties": {"type": "string", "maxLength": limits.metadata_chars},
        },
        **{name: identifier for name in IDENTIFIERS},
        "include": {},
        "service_tier": {},
    }
    assert set(props) == set(FIELDS) | set(ACCEPTED_IGNORED), "every field responses.py reads, and no other"
    return {
        "type": "object",
        "required": ["model"],
        "additionalProperties": False,
        "description": "OpenAI's Responses API (docs/responses.md): translated to one chat request, so chat's "
        "bounds hold. Fields not listed are a 400.",
        "properties": props,
    }


def _input_item(limits: Limits) -> dict:
    """A Responses input item, as far as its bounds go (ids, content parts); responses.py checks the rest."""
    parts = {"anyOf": [{"type": "string"}, {"type": "array", "maxItems": limits.content_parts}]}
    message = {
        "anyOf": [{"required": ["type"], "properties": {"type": {"const": "message"}}}, {"not": {"required": ["type"]}}]
    }
    output = {"required": ["type"], "properties": {"type": {"const": "function_call_output"}}}
    return {
        "type": "object",
        "properties": {"id": {"maxLength": limits.id_chars}, "call_id": {"maxLength": limits.id_chars}},
        "allOf": [
            {"if": message, "then": {"properties": {"content": parts}}},
            {"if": output, "then": {"properties": {"output": parts}}},
        ],
        "additionalProperties": True,
    }


def _response_paths(doc: dict, limits: Limits) -> None:
    """The Responses routes' path and query parameters: ids and the input_items page, bounded by the limits."""
    for path, item in doc["paths"].items():
        if "/responses/" not in path:
            continue
        for op in item.values():
            for param in op.get("parameters", []):
                if param["name"] in ("response_id", "after"):
                    param["schema"] = {"type": "string", "maxLength": limits.id_chars}
                elif param["name"] == "limit":
                    param["schema"] = {"type": "integer", "minimum": 1, "maximum": limits.input_items_page}


def document(base: dict, limits: Limits = Limits()) -> dict:
    """`base` (the hand-written document) with its generated parts replaced."""
    doc = copy.deepcopy(base)
    doc["info"]["version"] = appliance.__version__
    schemas = doc["components"]["schemas"]
    for request in REQUESTS:
        schemas[request] = request_schema(request, limits)
    schemas["ResponsesRequest"] = responses_request_schema(limits)
    _response_paths(doc, limits)
    messages = "Anthropic's Messages API (docs/anthropic.md): translated to one chat request, so chat's bounds hold."
    schemas["MessagesRequest"] = table_schema(MESSAGES, messages, limits)
    schemas["CountTokensRequest"] = table_schema(COUNT_TOKENS, messages + " max_tokens is not needed.", limits)
    schemas["Config"]["additionalProperties"]["properties"]["limits"] = limits_schema()
    return doc


def render(doc: dict) -> str:
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def current(path: Path = DOC_PATH) -> tuple[str, str]:
    """(the document as it is, as it should be)."""
    text = path.read_text()
    return text, render(document(json.loads(text)))


def main(argv: list[str]) -> int:
    text, wanted = current()
    if "--check" in argv:
        if text != wanted:
            print(f"{DOC_PATH} is stale: run python -m appliance.wsgi.openapi", file=sys.stderr)
            return 1
        return 0
    if text != wanted:
        DOC_PATH.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
