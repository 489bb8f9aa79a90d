"""docs/openapi.json's request schemas are generated from appliance/openai_api/fields.py, the tables validation.py
walks: the checked-in document is what the generator writes, and the generated schemas accept exactly what the
parsers accept (field by field, for any Limits). No server, no model: unit tests of the generator."""

from __future__ import annotations

import copy
import json

import pytest

from appliance.limits import Limits
from appliance.openai_api import fields as F
from appliance.openai_api.chat import parse_chat
from appliance.openai_api.completions import parse_completion
from appliance.openai_api.errors import ApiError
from appliance.openai_api.openapi import DOC_PATH, document, render, request_schema
from appliance.openai_api.validation import parse_tokenize

PARSE = {"CompletionRequest": parse_completion, "ChatCompletionRequest": parse_chat, "TokenizeRequest": parse_tokenize}
BASE = {
    "CompletionRequest": {"model": "m", "prompt": "hi"},
    "ChatCompletionRequest": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "TokenizeRequest": {"model": "m", "prompt": "hi"},
}
SAMPLES = [
    None,
    True,
    False,
    0,
    1,
    -1,
    2,
    3,
    19,
    20,
    21,
    0.5,
    1.0,
    1.5,
    1.9999,
    2.0,
    2.0001,
    -2.0,
    -2.0001,
    9.99,
    10.0,
    10.5,
    -10.0,
    -10.5,
    86400,
    86400.5,
    1e-9,
    -1e-9,
    2**32 - 1,
    2**32,
    -(2**31),
    10**400,
    "s",
    "",
    [],
    [1],
    [0, 7],
    ["a"],
    ["a"] * 17,
    ["x" * 257],
    [[1]],
    {},
    {"a": 1},
    {"5": 1.5},
    {"05": 1},
    {"5": 101},
    {"include_usage": True},
    {"include_usage": 1},
    {"type": "text"},
    {"type": "json_object"},
    [None],
    [{}],
]
# where JSON Schema and the server differ on purpose (the fuzz hook in tests/e2e/test_fuzz.py turns 2.0 into 2)
INTEGRAL_FLOATS = (1.0, 2.0, 10.0, -10.0, -2.0)


def test_document_is_what_the_generator_writes():
    """Regenerate with `python -m appliance.openai_api.openapi` when this fails."""
    text = DOC_PATH.read_text()
    assert text == render(document(json.loads(text))), (
        "docs/openapi.json is stale: run python -m appliance.openai_api.openapi"
    )


def test_a_stale_document_is_caught():
    doc = json.loads(DOC_PATH.read_text())
    stale = copy.deepcopy(doc)
    stale["components"]["schemas"]["CompletionRequest"]["properties"]["temperature"]["maximum"] = 3.0
    del stale["components"]["schemas"]["ChatCompletionRequest"]["properties"]["top_logprobs"]
    assert render(stale) != render(doc)
    assert render(document(stale)) == render(doc)  # the generated parts are rewritten, the rest is kept


def test_schema_bounds_follow_the_limits():
    lim = Limits(temperature=1.5, n=4, best_of=3, stop_strings=2, prompts=7, max_tokens=100, messages=9, depth=5)
    completion, chat = request_schema("CompletionRequest", lim), request_schema("ChatCompletionRequest", lim)
    props = completion["properties"]
    assert props["temperature"]["maximum"] == 1.5
    assert (props["n"]["maximum"], props["best_of"]["maximum"]) == (4, 3)
    assert props["stop"]["anyOf"][1]["maxItems"] == 2
    assert props["prompt"]["anyOf"][2]["maxItems"] == 7
    assert props["max_tokens"]["maximum"] == 100 and props["max_tokens"]["minimum"] == 0
    assert chat["properties"]["max_tokens"]["minimum"] == chat["properties"]["max_completion_tokens"]["minimum"] == 1
    assert chat["properties"]["messages"]["maxItems"] == 9
    assert "nest at most 5 deep" in completion["description"]
    assert [rule["if"]["properties"]["best_of"]["const"] for rule in completion["allOf"][2]["allOf"]] == [1, 2, 3]


@pytest.mark.parametrize(
    "limits",
    [
        Limits(),
        Limits(temperature=1.0, n=3, best_of=2, stop_strings=1, max_tokens=20, penalty=1.0, timeout=10.0, logprobs=2),
    ],
)
@pytest.mark.parametrize("request_name", list(F.REQUESTS))
def test_schema_accepts_what_validation_accepts(request_name, limits):
    """Field by field, every sample value: the generated schema and the parser agree on valid vs 400."""
    from jsonschema import Draft202012Validator

    validator = Draft202012Validator(request_schema(request_name, limits))
    table, _ = F.REQUESTS[request_name]
    checked = 0
    for f in table:
        for value in SAMPLES:
            body = {**BASE[request_name], f.name: value}
            if f.name == "stream_options" or f.name in ("include_stop_str_in_output", "best_of"):
                body["stream"] = f.name == "stream_options"  # each alone, without the stream rules
            if f.name == "top_logprobs":
                body["logprobs"] = True
            if f.name == "max_tokens" and value == 0 and request_name == "CompletionRequest":
                body["echo"] = True
            integral = f.kind in ("integer", "number") or f.name == "seed"  # completions: seed or a seed list
            if integral and isinstance(value, float) and value in INTEGRAL_FLOATS:
                continue
            if f.name == "tools" and not value and value is not None:
                continue  # the server ignores a falsy non-list `tools` (as before); the schema says array
            try:
                PARSE[request_name](body, limits)
                accepted = True
            except ApiError as exc:
                assert exc.status == 400
                accepted = False
            assert validator.is_valid(body) == accepted, (f.name, value, accepted)
            checked += 1
    assert checked >= 40 * len(table)
