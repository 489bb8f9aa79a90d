"""End to end: structured output through the official `openai` client against the real server and default model
(the proof it works). `response_format` json_object / json_schema / regex / grammar, unary and streamed, with n > 1
and logprobs, the SDK's `chat.completions.parse(response_format=<pydantic model>)`, and the 400s for a schema,
regex or grammar that does not compile.

What is asserted is validity, never the exact text (the default precision's numerics vary by CPU and batch). A
135M model under a grammar can still run into max_tokens (a long string, a number's digits): such an output is cut
and only a prefix of a valid one, so validity is checked where finish_reason is "stop", and a separate test checks
that most outputs do stop. The schemas bound every string (maxLength) and array (maxItems) so a finished output
fits well inside MAX_TOKENS. The json_schema cases (12 schemas x unary and streamed) are sent all at once in one
module fixture: the engine batches them, which keeps this file to a few batched decodes.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

MAX_TOKENS = 96
MIN_STOP_FRACTION = 0.75  # of the schema-constrained outputs that must end on "stop" rather than "length"


def obj(properties: dict, required: list[str] | None = None) -> dict:
    """A closed object schema (additionalProperties false): all properties required unless `required` says."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


def text(max_length: int) -> dict:
    return {"type": "string", "maxLength": max_length}


# name -> (user message, schema)
SCHEMAS: dict[str, tuple[str, dict]] = {
    "flat": ("Describe a person as JSON with name and age.", obj({"name": text(16), "age": {"type": "integer"}})),
    "nested": (
        "Give a user with a name and an address (city, zip code) as JSON.",
        obj(
            {
                "user": obj(
                    {
                        "name": text(12),
                        "address": obj({"city": text(16), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
                    }
                )
            }
        ),
    ),
    "array_bounds": (
        "List one to three tags for a blog post about cooking, as JSON.",
        obj({"tags": {"type": "array", "items": text(10), "minItems": 1, "maxItems": 3}}),
    ),
    "enums": (
        "Pick a shirt color and size, as JSON.",
        obj({"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]}}),
    ),
    "number_bounds": (
        "Give today's weather as JSON: temperature in Celsius and humidity in percent.",
        obj(
            {
                "temperature": {"type": "number", "minimum": -50, "maximum": 50},
                "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
            }
        ),
    ),
    "booleans": (
        "Is the task done, and is it urgent? Answer as JSON.",
        obj({"done": {"type": "boolean"}, "urgent": {"type": "boolean"}}),
    ),
    "optional": (
        "Describe a book as JSON: title, and optionally a subtitle and year.",
        obj(
            {"title": text(20), "subtitle": text(20), "year": {"type": "integer", "minimum": 1000, "maximum": 2100}},
            required=["title"],
        ),
    ),
    "any_of": (
        "Give a value as JSON: a number or a short word.",
        obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, text(8)]}}),
    ),
    "array_of_objects": (
        "A shopping list with one or two items (name and quantity), as JSON.",
        obj(
            {
                "items": {
                    "type": "array",
                    "items": obj({"name": text(10), "qty": {"type": "integer", "minimum": 1, "maximum": 9}}),
                    "minItems": 1,
                    "maxItems": 2,
                }
            }
        ),
    ),
    "pattern": (
        "Give a flight code like ABC-123 as JSON.",
        obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}),
    ),
    "format_date": (
        "When was the meeting? Answer as JSON with a date.",
        obj({"date": {"type": "string", "format": "date"}}),
    ),
    "top_level_array": (
        "List two to four small numbers as a JSON array.",
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
    ),
    "const_and_null": (
        "Report the status as JSON.",
        obj({"status": {"const": "ok"}, "note": {"type": ["string", "null"], "maxLength": 10}}),
    ),
}


def validate(schema: dict, value: Any) -> None:
    """jsonschema with formats checked too (by default `format` is only an annotation)."""
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    validator.validate(value)


def json_schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v3", api_key="unused", max_retries=0, timeout=300)


def chat(client, model_name, content: str, **kw):
    return client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": content}], **{"max_tokens": MAX_TOKENS, **kw}
    )


def streamed_chat(client, model_name, content: str, **kw) -> tuple[str, str | None]:
    """(concatenated content deltas, finish_reason) of a streamed chat completion."""
    parts, finish = [], None
    for chunk in chat(client, model_name, content, stream=True, **kw):
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(parts), finish


# ---------------------------------------------------------------- json_schema: every schema, unary and streamed


@pytest.fixture(scope="module")
def schema_outputs(client, model_name) -> dict[tuple[str, str], tuple[str, str | None]]:
    """(schema name, "unary" | "stream") -> (content, finish_reason), all requests in flight together."""

    def run(name: str, mode: str) -> tuple[str, str | None]:
        prompt, schema = SCHEMAS[name]
        kw = {"response_format": json_schema_format(name, schema), "temperature": 0}
        if mode == "stream":
            return streamed_chat(client, model_name, prompt, **kw)
        r = chat(client, model_name, prompt, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason

    keys = [(name, mode) for name in SCHEMAS for mode in ("unary", "stream")]
    with ThreadPoolExecutor(len(keys)) as pool:
        futures = {key: pool.submit(run, *key) for key in keys}
        return {key: f.result() for key, f in futures.items()}


@pytest.mark.parametrize("mode", ["unary", "stream"])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_output_validates(schema_outputs, name, mode):
    content, finish = schema_outputs[name, mode]
    assert finish in ("stop", "length"), finish
    if finish == "stop":
        validate(SCHEMAS[name][1], json.loads(content))
    else:  # cut by max_tokens: at least it is the start of a JSON value
        assert content.lstrip()[:1] in ("{", "["), content


def out_of_order(schema: dict, value: Any, where: str = "$") -> list[str]:
    """Where an object's keys are not in the order of its schema's properties (OpenAI: "outputs will be produced in
    the same order as the ordering of keys in the schema"; a schema that puts "reasoning" before "answer" relies
    on it)."""
    found = []
    if isinstance(value, dict) and "properties" in schema:
        order = [k for k in schema["properties"] if k in value]
        if list(value) != order:
            found.append(f"{where}: {list(value)} vs schema {order}")
        for k, v in value.items():
            found += out_of_order(schema["properties"].get(k, {}), v, f"{where}.{k}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            found += out_of_order(schema["items"], v, f"{where}[{i}]")
    return found


def test_keys_come_in_schema_order(schema_outputs):
    wrong = {}
    for (name, mode), (content, finish) in schema_outputs.items():
        if finish == "stop":
            wrong.update({f"{name}/{mode} {w}": content for w in out_of_order(SCHEMAS[name][1], json.loads(content))})
    assert not wrong, wrong


def test_most_schema_outputs_finish(schema_outputs):
    stopped = [key for key, (_, finish) in schema_outputs.items() if finish == "stop"]
    cut = sorted(set(schema_outputs) - set(stopped))
    assert len(stopped) >= MIN_STOP_FRACTION * len(schema_outputs), f"cut by max_tokens: {cut}"


# ---------------------------------------------------------------- json_object


JSON_OBJECT_PROMPTS = (
    "Give a JSON object with the keys city and country for Paris.",
    "Give a JSON object with the keys name and age for a person called Ann who is 30.",
    "Give a JSON object with the key colour for the sky.",
)


def test_json_object_parses(client, model_name):
    """json_object bounds nothing, so a greedy answer may run to max_tokens: each answer must open an object, and
    those that end (at least one must) parse as one."""
    finished = []
    for prompt in JSON_OBJECT_PROMPTS:
        choice = chat(client, model_name, prompt, response_format={"type": "json_object"}, temperature=0).choices[0]
        assert choice.message.content.lstrip().startswith("{"), choice.message.content
        if choice.finish_reason == "stop":
            finished.append(choice.message.content)
    assert finished, f"none of {len(JSON_OBJECT_PROMPTS)} json_object answers ended within {MAX_TOKENS} tokens"
    for content in finished:
        assert isinstance(json.loads(content), dict), content


def test_json_object_with_schema_string_on_completions(client, model_name):
    """Friendli's form: json_object with the schema as a JSON string, on /v3/completions."""
    schema = SCHEMAS["enums"][1]
    r = client.completions.create(
        model=model_name,
        prompt="A red shirt in size M, as JSON:",
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"response_format": {"type": "json_object", "schema": json.dumps(schema)}},
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].text
    validate(schema, json.loads(r.choices[0].text))


# ---------------------------------------------------------------- regex

REGEXES = {
    "phone": ("My phone number is ", r"[0-9]{3}-[0-9]{4}"),
    "yes_no": ("Is the sky blue? Answer: ", r"(yes|no)"),
    "two_words": ("The name of a famous person: ", r"[A-Z][a-z]{1,10} [A-Z][a-z]{1,10}"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("name", list(REGEXES))
def test_regex_on_completions(client, model_name, name, stream):
    prompt, pattern = REGEXES[name]
    kw = dict(model=model_name, prompt=prompt, max_tokens=32, temperature=0)
    kw["extra_body"] = {"response_format": {"type": "regex", "schema": pattern}}
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        out = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["stop"]
    else:
        r = client.completions.create(**kw)
        out = r.choices[0].text
        assert r.choices[0].finish_reason == "stop"  # a bounded regex: EOS is the only choice once it is matched
    assert re.fullmatch(pattern, out), out


def test_regex_on_chat(client, model_name):
    pattern = r"(yes|no)"
    r = chat(
        client,
        model_name,
        "Is water wet? Answer yes or no.",
        max_tokens=16,
        extra_body={"response_format": {"type": "regex", "schema": pattern}},
    )
    assert r.choices[0].finish_reason == "stop"
    assert re.fullmatch(pattern, r.choices[0].message.content), r.choices[0].message.content


# ---------------------------------------------------------------- n > 1, logprobs


def test_n2_with_a_schema(client, model_name):
    prompt, schema = SCHEMAS["flat"]
    r = chat(client, model_name, prompt, n=2, temperature=0.8, seed=7, response_format=json_schema_format("p", schema))
    assert len(r.choices) == 2 and {c.index for c in r.choices} == {0, 1}
    for choice in r.choices:
        if choice.finish_reason == "stop":
            validate(schema, json.loads(choice.message.content))
    assert any(c.finish_reason == "stop" for c in r.choices)


def test_logprobs_with_a_schema(client, model_name):
    prompt, schema = SCHEMAS["enums"]
    r = chat(
        client,
        model_name,
        prompt,
        logprobs=True,
        top_logprobs=2,
        temperature=0,
        response_format=json_schema_format("e", schema),
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    validate(schema, json.loads(choice.message.content))
    entries = choice.logprobs.content
    assert len(entries) == r.usage.completion_tokens
    assert "".join(e.token for e in entries) == choice.message.content
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 2


# ---------------------------------------------------------------- the SDK's parse() helper


class Pet(BaseModel):
    name: str = Field(max_length=12)
    species: Literal["cat", "dog", "bird"]
    age: int = Field(ge=0, le=30)
    vaccinated: bool


def test_sdk_parse_with_a_pydantic_model(client, model_name):
    """The SDK turns the model into a strict json_schema response_format and parses the reply into an instance."""
    r = client.chat.completions.parse(
        model=model_name,
        messages=[{"role": "user", "content": "Describe a pet as JSON."}],
        response_format=Pet,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    message = r.choices[0].message
    assert isinstance(message.parsed, Pet), message.content
    assert message.parsed == Pet.model_validate_json(message.content)


# ---------------------------------------------------------------- grammars (Lark, GBNF)

GRAMMARS = {
    "lark": 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"',
    "gbnf": 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no"',
}


def grammar_format(syntax: str, definition: str) -> dict:
    return {"type": "grammar", "grammar": {"syntax": syntax, "definition": definition}}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("syntax", list(GRAMMARS))
def test_grammar(client, model_name, syntax, endpoint):
    kw = dict(model=model_name, max_tokens=16, temperature=0)
    kw["extra_body"] = {"response_format": grammar_format(syntax, GRAMMARS[syntax])}
    if endpoint == "chat":
        r = client.chat.completions.create(messages=[{"role": "user", "content": "Is the sky blue?"}], **kw)
        out = r.choices[0].message.content
    else:
        r = client.completions.create(prompt="Is the sky blue?", **kw)
        out = r.choices[0].text
    assert r.choices[0].finish_reason == "stop"
    assert out in ("The answer is yes.", "The answer is no."), out


# ---------------------------------------------------------------- what does not compile is a 400 naming it

BAD = {
    "schema_type": (
        json_schema_format("bad", {"type": "object", "properties": {"a": {"type": "nonsense"}}}),
        "nonsense",
    ),
    "regex": ({"type": "regex", "schema": "(abc"}, "regex"),
    "lark": (grammar_format("lark", "start: foo"), "foo"),
    "gbnf": (grammar_format("gbnf", "root ::= undefined_rule"), "undefined_rule"),
    "unknown_type": ({"type": "xml"}, "xml"),
}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("name", list(BAD))
def test_what_does_not_compile_is_a_400(client, model_name, name, endpoint):
    response_format, named = BAD[name]
    kw = dict(model=model_name, max_tokens=8, extra_body={"response_format": response_format})
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], stream=name == "regex", **kw)
        else:
            client.completions.create(prompt="Hi", **kw)
    error = info.value.body
    assert info.value.status_code == 400
    assert error["type"] == "invalid_request_error" and (error["param"] or "").startswith("response_format"), error
    assert named in error["message"], error["message"]
