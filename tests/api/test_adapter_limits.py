"""Every count, length and range the Responses and Anthropic Messages adapters accept comes from the one limits
table (appliance/limits.py): for each bound, a body just past it (with a small limit, so the body stays small) is a
400 that names its field, and the same body is accepted under the default limits. The table below is walked
against `Limits`: every field of the adapters' own group must have a row for each API that reads it, so a new
bound without its check here fails. The HTTP error shapes (OpenAI's for Responses, Anthropic's for Messages) are
the routes' and are checked end to end in tests/openai_api/test_responses_e2e.py and
tests/anthropic_api/test_anthropic_api.py; the Ollama
adapter maps everything onto chat's fields and so onto chat's checks (tests/test_ollama_api.py). docs/openapi.json's
request schemas, generated from the same limits, state the same bounds (the last test)."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from appliance.anthropic_api.request import parse_messages
from appliance.limits import Limits
from appliance.openai_api.errors import ApiError
from appliance.openai_api.openapi import DOC_PATH, document
from appliance.openai_api.responses import parse_responses

# the adapters' own group in Limits (the fields from the first to the last of these, in declaration order)
OWN_FIRST, OWN_LAST = "content_parts", "input_items_page"
ROUTE_ONLY = {
    "input_items_page": "GET /v3/responses/{id}/input_items (tests/openai_api/test_responses_e2e.py test_refusals)"
}

SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "description": "x" * 64}}}
PARTS = [{"type": "input_text", "text": "a"}] * 3
BLOCKS = [{"type": "text", "text": "a"}] * 3


def responses(**fields) -> dict:
    return {"model": "m", "input": "hi", **fields}


def messages(**fields) -> dict:
    return {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], **fields}


def tool_result(use_id: str) -> list[dict]:
    return [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": use_id, "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use_id, "content": "ok"}]},
    ]


# (Limits field, the value that makes the body too much, API, body, the param the 400 names)
CASES = [
    # Responses: its own fields
    ("content_parts", 2, "responses", responses(input=[{"role": "user", "content": PARTS}]), "input"),
    (
        "content_parts",
        2,
        "responses",
        responses(input=[{"type": "function_call_output", "call_id": "c", "output": PARTS}]),
        "input",
    ),
    ("id_chars", 8, "responses", responses(previous_response_id="resp_" + "0" * 8), "previous_response_id"),
    ("id_chars", 8, "responses", responses(user="u" * 9), "user"),
    ("id_chars", 8, "responses", responses(safety_identifier="u" * 9), "safety_identifier"),
    ("id_chars", 8, "responses", responses(prompt_cache_key="k" * 9), "prompt_cache_key"),
    (
        "id_chars",
        8,
        "responses",
        responses(input=[{"type": "message", "id": "m" * 9, "role": "user", "content": "hi"}]),
        "input",
    ),
    (
        "id_chars",
        8,
        "responses",
        responses(input=[{"type": "function_call_output", "call_id": "c" * 9, "output": "ok"}]),
        "input",
    ),
    ("metadata", 2, "responses", responses(metadata={"a": "1", "b": "2", "c": "3"}), "metadata"),
    ("metadata_key_chars", 4, "responses", responses(metadata={"kkkkk": "1"}), "metadata"),
    ("metadata_chars", 4, "responses", responses(metadata={"k": "vvvvv"}), "metadata"),
    # Responses: what it maps onto chat keeps chat's bounds, named in this API's fields
    ("messages", 2, "responses", responses(input=[{"role": "user", "content": "x"}] * 3), "input"),
    ("tools", 1, "responses", responses(tools=[{"type": "function", "name": n} for n in "ab"]), "tools"),
    ("max_tokens", 8, "responses", responses(max_output_tokens=9), "max_output_tokens"),
    ("temperature", 1.0, "responses", responses(temperature=1.5), "temperature"),
    ("penalty", 1.0, "responses", responses(frequency_penalty=1.5), "frequency_penalty"),
    ("penalty", 1.0, "responses", responses(presence_penalty=-1.5), "presence_penalty"),
    (
        "grammar_chars",
        32,
        "responses",
        responses(text={"format": {"type": "json_schema", "name": "s", "schema": SCHEMA}}),
        "text.format",
    ),
    ("depth", 3, "responses", responses(input=[{"role": "user", "content": PARTS}]), None),
    # Anthropic Messages
    ("content_parts", 2, "messages", messages(messages=[{"role": "user", "content": BLOCKS}]), "messages"),
    ("content_parts", 2, "messages", messages(system=BLOCKS), "system"),
    (
        "content_parts",
        2,
        "messages",
        messages(
            messages=[
                *tool_result("t")[:2],
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": BLOCKS}]},
            ]
        ),
        "messages",
    ),
    ("id_chars", 8, "messages", messages(messages=tool_result("t" * 9)), "messages"),
    ("messages", 2, "messages", messages(messages=[{"role": "user", "content": "x"}] * 3), "messages"),
    (
        "tools",
        1,
        "messages",
        messages(tools=[{"name": n, "input_schema": {"type": "object"}} for n in "ab"]),
        "tools",
    ),
    ("stop_strings", 1, "messages", messages(stop_sequences=["a", "b"]), "stop_sequences"),
    ("stop_chars", 4, "messages", messages(stop_sequences=["abcde"]), "stop_sequences"),
    ("max_tokens", 8, "messages", messages(max_tokens=9), "max_tokens"),
    (
        "grammar_chars",
        32,
        "messages",
        messages(output_config={"format": {"type": "json_schema", "schema": SCHEMA}}),
        "output_config",
    ),
    ("depth", 3, "messages", messages(metadata={"a": {"b": {"c": {}}}}), None),
]

PARSE = {
    "responses": lambda b, limits: parse_responses(b, limits),
    "messages": lambda b, limits: parse_messages(b, limits),
}


@pytest.mark.parametrize(
    ("name", "small", "api", "body", "param"), CASES, ids=lambda v: v if isinstance(v, str) else ""
)
def test_each_bound_is_a_400_naming_its_field(name, small, api, body, param):
    PARSE[api](body, Limits())  # within the default limits: accepted
    with pytest.raises(ApiError) as info:
        PARSE[api](body, Limits(**{name: small}))
    assert info.value.status == 400, info.value.message
    if param is not None:
        assert info.value.param == param, (info.value.param, info.value.message)


def test_every_bound_of_the_adapters_group_is_checked_for_each_api():
    names = [f.name for f in fields(Limits)]
    own = names[names.index(OWN_FIRST) : names.index(OWN_LAST) + 1]
    checked = {(name, api) for name, _, api, _, _ in CASES}
    for name in own:
        if name in ROUTE_ONLY:
            continue
        assert (name, "responses") in checked, f"Limits.{name}: no 400 checked for the Responses adapter"
        if name in ("content_parts", "id_chars"):  # the two the Messages adapter reads too
            assert (name, "messages") in checked, f"Limits.{name}: no 400 checked for the Messages adapter"
    assert set(ROUTE_ONLY) <= set(own)


SCHEMA_OF = {"responses": "ResponsesRequest", "messages": "MessagesRequest"}
BASE = json.loads(DOC_PATH.read_text())


@pytest.mark.parametrize(
    ("name", "small", "api", "body", "param"), CASES, ids=lambda v: v if isinstance(v, str) else ""
)
def test_the_openapi_schemas_state_the_same_bounds(name, small, api, body, param):
    """docs/openapi.json's request schemas are generated with the same limits: the body the parser accepts is
    valid by the schema of the default limits, and where the schema can say the bound (a count, a length, a
    range; not the depth or the grammar's size), the schema of the small limits refuses it as the parser does."""
    from jsonschema import Draft202012Validator

    def valid(limits: Limits) -> bool:
        return Draft202012Validator(document(BASE, limits)["components"]["schemas"][SCHEMA_OF[api]]).is_valid(body)

    assert valid(Limits()), "the schema refuses a body the parser accepts"
    if name not in ("depth", "grammar_chars", "messages"):  # not in JSON Schema's terms (messages: items + previous)
        assert not valid(Limits(**{name: small})), f"the schema does not state Limits.{name}"
