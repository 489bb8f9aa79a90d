"""Unit tests of the request validation layer (appliance/openai_api/validation.py): OVMS's rules and messages,
JSON null = not set, and how defaults are filled from generation_config.json and OVMS's built-ins."""

from __future__ import annotations

from dataclasses import fields

import pytest

from appliance.api.errors import ApiError
from appliance.api.sampling import to_sampling_params
from appliance.openai_api import fields as F
from appliance.openai_api.chat import parse_chat
from appliance.openai_api.completions import parse_completion
from appliance.openai_api.validation import Limits, parse_tokenize

MODEL = "m"


def params(req, generation_defaults=None):
    """The SamplingParams a parsed request means (the model's generation_config.json: none unless given)."""
    return to_sampling_params(req.sampling, generation_defaults or {})


def completion(**fields):
    return parse_completion({"model": MODEL, "prompt": "hi", **fields})


def chat(**fields):
    return parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields})


def error_of(fn, *args, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args, **kwargs)
    assert info.value.status == 400
    return info.value


# ---------------------------------------------------------------- the field tables (appliance/openai_api/fields.py)
# Tests over "every field" take their fields from the tables, so a Field added there is under them at once.

ENDPOINTS = {"completions": (F.COMPLETION, parse_completion), "chat": (F.CHAT, parse_chat)}
TYPE_SAMPLES = {"boolean": "yes", "integer": "1", "number": "x", "string": 5}  # a value of another JSON type


def base_body(endpoint: str, without: str = "") -> dict:
    """The smallest valid body of `endpoint` that does not set `without` (completions: `tokens` as the prompt when
    `without` is prompt)."""
    if endpoint == "chat":
        return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    return {"model": MODEL, **({"tokens": [1]} if without == "prompt" else {"prompt": "hi"})}


def json_types(f: F.Field) -> set[str]:
    """The JSON types a field's value may have at its top level (custom fields: by their declared schema)."""
    if f.kind != "custom":
        return {f.kind}
    assert f.schema is not None
    schema = f.schema(Limits())
    found: set[str] = set()
    for part in [schema, *schema.get("anyOf", [])]:
        kind = part.get("type", [])
        found |= {kind} if isinstance(kind, str) else set(kind)
    return found


def table_params(select) -> list:
    """pytest params (endpoint, field) of every field of the completions and chat tables that `select` takes."""
    return [
        pytest.param(endpoint, f, id=f"{endpoint}-{f.name}")
        for endpoint, (table, _) in ENDPOINTS.items()
        for f in table
        if select(f)
    ]


# ---------------------------------------------------------------- OVMS messages, one row per rule

COMMON_ERRORS = [
    ({"stream": "yes"}, "Stream is not bool", "stream"),
    ({"stream": 1}, "Stream is not bool", "stream"),
    (
        {"stream_options": {"include_usage": True}},
        "stream_options provided, but stream not set to true",
        "stream_options",
    ),
    ({"stream": False, "stream_options": {}}, "stream_options provided, but stream not set to true", "stream_options"),
    ({"stream": True, "stream_options": [1]}, "stream_options is not an object", "stream_options"),
    (
        {"stream": True, "stream_options": {"include_usage": True, "other": 1}},
        "Found unexpected stream options. Properties accepted in stream_options: include_usage",
        "stream_options",
    ),
    (
        {"stream": True, "stream_options": {"include_usage": "yes"}},
        "stream_options.include_usage is not a boolean",
        "stream_options",
    ),
    ({"ignore_eos": "no"}, "ignore_eos accepts values true or false", "ignore_eos"),
    ({"max_tokens": -1}, "max_tokens is not an unsigned integer", "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens is not an unsigned integer", "max_tokens"),
    ({"max_tokens": "10"}, "max_tokens is not an unsigned integer", "max_tokens"),
    ({"max_tokens": True}, "max_tokens is not an unsigned integer", "max_tokens"),
    ({"max_tokens": 4294967296}, "max_tokens is not an unsigned integer", "max_tokens"),
    ({"frequency_penalty": 2.5}, "frequency_penalty out of range(-2.0, 2.0)", "frequency_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty out of range(-2.0, 2.0)", "frequency_penalty"),
    ({"presence_penalty": 3}, "presence_penalty out of range(-2.0, 2.0)", "presence_penalty"),
    ({"frequency_penalty": "x"}, "frequency_penalty is not a valid number", "frequency_penalty"),
    ({"repetition_penalty": "x"}, "repetition_penalty is not a valid number", "repetition_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty must be greater than 0", "repetition_penalty"),
    ({"length_penalty": [1]}, "length_penalty is not a valid number", "length_penalty"),
    ({"temperature": 2.1}, "temperature out of range(0.0, 2.0)", "temperature"),
    ({"temperature": -0.1}, "temperature out of range(0.0, 2.0)", "temperature"),
    ({"temperature": "hot"}, "temperature is not a valid number", "temperature"),
    ({"temperature": False}, "temperature is not a valid number", "temperature"),
    ({"top_p": 1.5}, "top_p out of range(0.0, 1.0)", "top_p"),
    ({"top_p": -0.5}, "top_p out of range(0.0, 1.0)", "top_p"),
    ({"min_p": 1.0}, "min_p out of range [0.0, 1.0)", "min_p"),
    ({"min_p": -0.1}, "min_p out of range [0.0, 1.0)", "min_p"),
    ({"top_k": 0}, "top_k must be -1 (all tokens) or a positive integer", "top_k"),
    ({"top_k": -2}, "top_k must be -1 (all tokens) or a positive integer", "top_k"),
    ({"top_k": 1.5}, "top_k is not an integer", "top_k"),
    ({"seed": -1}, "seed out of range [0, 4294967295]", "seed"),
    ({"seed": 4294967296}, "seed out of range [0, 4294967295]", "seed"),
    ({"seed": "1"}, "seed is not an integer", "seed"),
    ({"stop": ["s"] * 17}, "stop array must have no more than 16 strings", "stop"),
    ({"stop": ["a", 1]}, "stop array contains non string element", "stop"),
    ({"stop": 5}, "stop is not a string or array of strings", "stop"),
    ({"stop": {"a": 1}}, "stop is not a string or array of strings", "stop"),
    (
        {"include_stop_str_in_output": "yes"},
        "include_stop_str_in_output accepts values true or false",
        "include_stop_str_in_output",
    ),
    ({"best_of": 0}, "best_of value should be greater than 0", "best_of"),
    ({"best_of": 21}, "best_of exceeds limit provided in graph config: 20", "best_of"),
    ({"best_of": 2, "stream": True}, "best_of cannot be used in streaming mode", "best_of"),
    ({"best_of": 1, "n": 2}, "n value cannot be greater than best_of", "n"),
    ({"n": 0}, "n value should be greater than 0", "n"),
    ({"n": 21}, "n exceeds limit provided in graph config: 20", "n"),
    ({"n": "2"}, "n is not an integer", "n"),
    ({"skip_special_tokens": 0}, "skip_special_tokens is not a bool", "skip_special_tokens"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids is not an array of token ids", "stop_token_ids"),
    ({"min_tokens": -2}, "min_tokens is not an unsigned integer", "min_tokens"),
    ({"logit_bias": [1]}, "logit_bias is not an object", "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias keys must be token ids", "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias values must be numbers in [-100, 100]", "logit_bias"),
    ({"timeout": 0}, "timeout must be a positive number of seconds", "timeout"),
    ({"timeout": "1"}, "timeout must be a positive number of seconds", "timeout"),
    # speculative decoding (OVMS's names and messages where OVMS has them)
    ({"num_assistant_tokens": -1}, "num_assistant_tokens out of range [0, 32]", "num_assistant_tokens"),
    ({"num_assistant_tokens": 33}, "num_assistant_tokens out of range [0, 32]", "num_assistant_tokens"),
    ({"num_assistant_tokens": 2.5}, "num_assistant_tokens is not an unsigned integer", "num_assistant_tokens"),
    ({"num_assistant_tokens": "5"}, "num_assistant_tokens is not an unsigned integer", "num_assistant_tokens"),
    (
        {"assistant_confidence_threshold": 0},
        "assistant_confidence_threshold must be greater than 0",
        "assistant_confidence_threshold",
    ),
    (
        {"assistant_confidence_threshold": 1.0},
        "assistant_confidence_threshold must be less than 1",
        "assistant_confidence_threshold",
    ),
    (
        {"assistant_confidence_threshold": "0.5"},
        "assistant_confidence_threshold must be a positive number",
        "assistant_confidence_threshold",
    ),
    (
        {"num_assistant_tokens": 3, "assistant_confidence_threshold": 0.4},
        "num_assistant_tokens and assistant_confidence_threshold are mutually exclusive and cannot both be set.",
        "assistant_confidence_threshold",
    ),
    ({"max_ngram_size": 0}, "max_ngram_size out of range [1, 16]", "max_ngram_size"),
    ({"max_ngram_size": 17}, "max_ngram_size out of range [1, 16]", "max_ngram_size"),
    ({"max_ngram_size": True}, "max_ngram_size is not an unsigned integer", "max_ngram_size"),
    ({"prediction": "text"}, "prediction is not an object", "prediction"),
    ({"prediction": {"type": "text", "content": "x"}}, 'prediction type must be "content"', "prediction"),
    ({"prediction": {"type": "content"}}, "prediction content is not a string or an array of text parts", "prediction"),
    (
        {"prediction": {"type": "content", "content": [{"type": "image_url", "image_url": "x"}]}},
        'prediction content parts must be {"type": "text", "text": string}',
        "prediction",
    ),
    (
        {"prediction": {"type": "content", "content": "x", "extra": 1}},
        "prediction accepts only type and content",
        "prediction",
    ),
]


@pytest.mark.parametrize("parse", [completion, chat], ids=["completions", "chat"])
@pytest.mark.parametrize("fields,message,param", COMMON_ERRORS, ids=[m for _, m, _ in COMMON_ERRORS])
def test_common_rules(parse, fields, message, param):
    err = error_of(parse, **fields)
    assert (err.message, err.param) == (message, param)
    assert err.body() == {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}


COMPLETION_ERRORS = [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens value should be greater than 0 unless echo is set"),
    ({"prompt": "hi", "echo": "yes"}, "echo accepts values true or false"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs out of range [0, 20]"),
    ({"prompt": "hi", "logprobs": -1}, "logprobs out of range [0, 20]"),
    ({"prompt": "hi", "logprobs": True}, "logprobs is not an integer"),
    ({}, "prompt is missing"),
    ({"prompt": None}, "prompt is missing"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": []}, "prompt is empty"),
    ({"prompt": [[]]}, "prompt is empty"),
    ({"prompt": ["a", ""]}, "prompt is empty"),
    (
        {"prompt": 5},
        "prompt is not a string, an array of strings, an array of token ids or an array of arrays of token ids",
    ),
    (
        {"prompt": ["a", 1]},
        "prompt is not a string, an array of strings, an array of token ids or an array of arrays of token ids",
    ),
    ({"prompt": [[1, -2]]}, "prompt token ids must be non-negative integers"),
    ({"prompt": [[1, "a"]]}, "prompt token ids must be non-negative integers"),
]


@pytest.mark.parametrize("fields,message", COMPLETION_ERRORS, ids=[m for _, m in COMPLETION_ERRORS])
def test_completion_rules(fields, message):
    assert error_of(parse_completion, {"model": MODEL, **fields}).message == message


CHAT_ERRORS = [
    ({}, "messages missing in request"),
    ({"messages": None}, "messages missing in request"),
    ({"messages": "hi"}, "messages is not an array"),
    ({"messages": []}, "messages array is empty"),
    ({"messages": ["hi"]}, "message is not an object"),
    ({"messages": [{"content": "hi"}]}, "message role is missing or not a string"),
    ({"messages": [{"role": "user", "content": 5}]}, "message content is not a string or an array of content parts"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content[0].image_url.url: the image URL must be a data: URL (base64) or an http(s) URL",
    ),
]


@pytest.mark.parametrize("fields,message", CHAT_ERRORS, ids=[m for _, m in CHAT_ERRORS])
def test_chat_message_rules(fields, message):
    assert error_of(parse_chat, {"model": MODEL, **fields}).message == message


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"max_tokens": 0}, "max_tokens value should be greater than 0"),
        ({"max_completion_tokens": 0}, "max_completion_tokens value should be greater than 0"),
        ({"max_completion_tokens": -3}, "max_completion_tokens is not an unsigned integer"),
        ({"logprobs": 1}, "logprobs accepts values true or false"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs out of range [0, 20]"),
        ({"top_logprobs": 2}, "top_logprobs requires logprobs to be true"),
        ({"tool_choice": "auto"}, "tool_choice is only allowed when tools are specified"),
        ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tool function names must match"),
    ],
)
def test_chat_rules(fields, message):
    assert error_of(chat, **fields).message.startswith(message)


@pytest.mark.parametrize(
    "body,message",
    [
        ([1, 2], "Received json is not an object"),
        ("text", "Received json is not an object"),
        ({"prompt": "hi"}, "model missing in request"),
        ({"model": None, "prompt": "hi"}, "model missing in request"),
        ({"model": 5, "prompt": "hi"}, "model is not a string"),
    ],
)
def test_body_and_model(body, message):
    assert error_of(parse_completion, body).message == message
    assert error_of(parse_chat, body).message == message


def test_configured_max_tokens_limit():
    limits = Limits(max_tokens=100)
    assert params(parse_completion({"model": MODEL, "prompt": "x", "max_tokens": 100}, limits)).max_tokens == 100
    err = error_of(parse_completion, {"model": MODEL, "prompt": "x", "max_tokens": 101}, limits)
    assert err.message == "max_tokens exceeds limit provided in graph config: 100"


def test_stop_limit_is_configurable_and_16_is_fine():
    assert len(params(completion(stop=[f"s{i}" for i in range(16)])).stop) == 16
    assert (
        error_of(
            parse_completion, {"model": MODEL, "prompt": "x", "stop": ["a", "b", "c"]}, Limits(stop_strings=2)
        ).message
        == "stop array must have no more than 2 strings"
    )


# ---------------------------------------------------------------- accepted forms, nulls, unknown fields


# Optional fields that refuse a JSON null. None does: OVMS reads null as "not set" in every optional field (a
# completions `prompt: null` is not set too, and so "prompt is missing" unless `tokens` is given: base_body). A field
# that must refuse null goes here as {(endpoint, name): why}.
NULL_REFUSED: dict[tuple[str, str], str] = {}


@pytest.mark.parametrize("endpoint,f", table_params(lambda f: f.required is None))
def test_every_optional_field_accepts_null_as_not_set(endpoint, f):
    table, parse = ENDPOINTS[endpoint]
    body = base_body(endpoint, without=f.name)
    if (endpoint, f.name) in NULL_REFUSED:
        assert error_of(parse, {**body, f.name: None}).param == f.name
    else:
        assert parse({**body, f.name: None}) == parse(body)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_all_optional_fields_null_together_are_not_set(endpoint):
    table, parse = ENDPOINTS[endpoint]
    body = base_body(endpoint)
    optional = [f.name for f in table if f.required is None and f.name not in body]
    nulls = {name: None for name in optional if (endpoint, name) not in NULL_REFUSED}
    assert len(nulls) > 20
    assert parse({**nulls, **body}) == parse(body)


def test_stream_options_null_include_usage_and_false_stream():
    assert completion(stream=True, stream_options={"include_usage": None}).edge.include_usage is False
    assert completion(stream=True, stream_options={"include_usage": True}).edge.include_usage is True
    assert completion(stream=True, stream_options={}).edge.include_usage is False


@pytest.mark.parametrize(
    "prompt,expected",
    [
        ("hello", ("hello",)),
        (["a", "b"], ("a", "b")),
        ([1, 2, 3], ((1, 2, 3),)),
        ([[1, 2], [3]], ((1, 2), (3,))),
    ],
)
def test_prompt_forms(prompt, expected):
    assert completion(prompt=prompt).prompts == expected


def test_unknown_fields_are_accepted_and_reported():
    req = completion(suffix=None, frobnicate=3, metadata={"a": 1})
    assert req.edge.unknown == ("frobnicate", "metadata", "suffix")
    assert chat(extra_body=1).edge.unknown == ("extra_body",)
    assert completion().edge.unknown == ()


def test_echo_allows_max_tokens_zero():
    req = completion(echo=True, max_tokens=0)
    assert req.echo is True and params(req).max_tokens == 0


def test_stop_string_forms():
    assert params(completion(stop="###")).stop == ["###"]
    assert params(completion(stop=[])).stop == []
    assert params(completion(stop=["a", "", "b"])).stop == ["a", "b"]


def test_best_of_one_and_n_default():
    req = completion(best_of=1, n=1)
    assert req.edge.n == 1
    assert completion(n=3).edge.n == 3


def test_chat_content_parts_are_joined_and_null_content_is_empty():
    req = parse_chat(
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None, "name": "bot"},
            ],
        }
    )
    assert req.messages == ({"role": "system", "content": "a\nb"}, {"role": "assistant", "content": "", "name": "bot"})


def test_chat_max_completion_tokens_wins_and_logprobs_forms():
    assert params(chat(max_tokens=5, max_completion_tokens=7)).max_tokens == 7
    assert params(chat(max_tokens=5)).max_tokens == 5
    assert params(chat(logprobs=True)).logprobs == 0
    assert params(chat(logprobs=True, top_logprobs=3)).logprobs == 3
    assert params(chat(logprobs=False)).logprobs is None
    assert chat(tools=[]).edge.unknown == ()


def test_tokenize_forms():
    assert parse_tokenize({"model": MODEL, "prompt": "x"}).batched is False
    req = parse_tokenize({"model": MODEL, "prompt": ["x", "y"]})
    assert (req.prompts, req.batched) == (("x", "y"), True)
    assert error_of(parse_tokenize, {"model": MODEL}).message == "prompt is missing"
    assert (
        error_of(parse_tokenize, {"model": MODEL, "prompt": 3}).message == "prompt is not a string or array of strings"
    )


def test_non_finite_numbers_are_rejected():
    assert error_of(completion, temperature=float("nan")).message == "temperature is not a valid number"


# ---------------------------------------------------------------- defaults


def test_builtin_defaults_are_greedy_and_unbounded():
    sp = to_sampling_params(completion().sampling, {})
    assert (sp.temperature, sp.top_k, sp.top_p, sp.repetition_penalty) == (0.0, -1, 1.0, 1.0)
    assert sp.max_tokens is None  # until EOS or the context is full
    assert sp.include_stop_str_in_output is False
    assert sp.skip_special_tokens is True and sp.seed is None and sp.logprobs is None


def test_sampling_without_top_k_gets_ovms_40():
    assert to_sampling_params(completion(temperature=0.7).sampling, {}).top_k == 40
    assert to_sampling_params(completion(temperature=0.7, top_k=5).sampling, {}).top_k == 5
    assert to_sampling_params(completion(temperature=0.7, top_k=-1).sampling, {}).top_k == -1
    assert to_sampling_params(completion(temperature=0.0).sampling, {}).top_k == -1


def test_generation_config_defaults_apply_before_builtins():
    model_defaults = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
    sp = to_sampling_params(completion().sampling, model_defaults)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty) == (0.6, 0.9, 20, 1.1)
    sp = to_sampling_params(completion(temperature=0.0, top_p=0.5, repetition_penalty=1.0).sampling, model_defaults)
    assert (sp.temperature, sp.top_p, sp.repetition_penalty) == (0.0, 0.5, 1.0)


def test_generation_config_temperature_needs_do_sample():
    sp = to_sampling_params(completion().sampling, {"temperature": 0.6, "top_k": 0})
    assert (sp.temperature, sp.top_k) == (0.0, -1)
    assert to_sampling_params(completion(temperature=1.0).sampling, {"top_k": 0}).top_k == -1  # HF 0 = disabled


def test_include_stop_str_defaults_follow_streaming():
    assert to_sampling_params(completion(stream=True).sampling, {}).include_stop_str_in_output is True
    assert to_sampling_params(completion().sampling, {}).include_stop_str_in_output is False
    assert (
        to_sampling_params(completion(include_stop_str_in_output=True).sampling, {}).include_stop_str_in_output is True
    )
    # false with a stream is served (the engine holds back what may begin a stop string), no longer a 400
    streamed = completion(stream=True, include_stop_str_in_output=False)
    assert to_sampling_params(streamed.sampling, {}).include_stop_str_in_output is False


def test_request_values_reach_sampling_params():
    req = completion(
        max_tokens=7,
        seed=3,
        stop=["x"],
        stop_token_ids=[9],
        ignore_eos=True,
        min_tokens=2,
        logit_bias={"5": -100},
        logprobs=2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        skip_special_tokens=False,
        n=2,
    )
    sp = params(req)
    assert (sp.max_tokens, sp.seed, sp.stop, sp.stop_token_ids, sp.ignore_eos, sp.min_tokens) == (
        7,
        3,
        ["x"],
        [9],
        True,
        2,
    )
    assert (sp.logit_bias, sp.logprobs, sp.presence_penalty, sp.frequency_penalty) == ({5: -100.0}, 2, 0.5, -0.5)
    assert sp.skip_special_tokens is False
    assert sp.n == 1 and req.edge.n == 2  # n choices are n independent submissions


# A value (with the fields it needs beside it) for every field that sets a SamplingParams attribute (`Field.param`):
# a hand list, since a valid non-default value is the field's own, so each new such field must be given one here.
REACHES: dict[str, dict] = {
    "ignore_eos": {"ignore_eos": True},
    "max_tokens": {"max_tokens": 7},
    "max_completion_tokens": {"max_completion_tokens": 7},
    "frequency_penalty": {"frequency_penalty": -0.5},
    "presence_penalty": {"presence_penalty": 0.5},
    "repetition_penalty": {"repetition_penalty": 1.2},
    "length_penalty": {"length_penalty": 2.0},
    "temperature": {"temperature": 0.7},
    "top_p": {"top_p": 0.5},
    "min_p": {"min_p": 0.1},
    "typical_p": {"typical_p": 0.5},
    "top_k": {"top_k": 5},
    "seed": {"seed": 3},
    "stop": {"stop": ["x"]},
    "include_stop_str_in_output": {"include_stop_str_in_output": True},
    "skip_special_tokens": {"skip_special_tokens": False},
    "stop_token_ids": {"stop_token_ids": [9]},
    "min_tokens": {"min_tokens": 2},
    "logit_bias": {"logit_bias": {"5": -100}},
    "best_of": {"best_of": 3},
    "n": {"n": 2, "best_of": 3},  # alone, n choices are n submissions of n = 1; beam search answers n of best_of
    "num_assistant_tokens": {"num_assistant_tokens": 3},
    "assistant_confidence_threshold": {"assistant_confidence_threshold": 0.5},
    "max_ngram_size": {"max_ngram_size": 2},
    "prediction": {"prediction": {"type": "content", "content": "xyz"}},
    "logprobs": {"logprobs": 2},
    "response_format": {"response_format": {"type": "json_object"}},
    "grammar_root": {"grammar_root": "object"},
    "num_beams": {"num_beams": 3},
    "early_stopping": {"early_stopping": True, "best_of": 2},
    "stop_tokens": {"stop_tokens": [{"tokens": [1, 2]}]},
    "bad_words": {"bad_words": ["no"]},
    "bad_word_tokens": {"bad_word_tokens": [{"tokens": [1]}]},
    "no_repeat_ngram": {"no_repeat_ngram": 3},
    "max_total_tokens": {"max_total_tokens": 50},
    "min_total_tokens": {"min_total_tokens": 5},
}


def test_reaches_names_exactly_the_fields_that_set_sampling_params():
    setting = {f.name for table, _ in ENDPOINTS.values() for f in table if f.param is not None}
    assert set(REACHES) == setting


@pytest.mark.parametrize("endpoint,f", table_params(lambda f: f.param is not None))
def test_every_field_value_reaches_its_sampling_params_attribute(endpoint, f):
    """Each field that sets a SamplingParams attribute changes that attribute from what a request without it gets."""
    assert f.name in REACHES, f"{f.name}: give it a valid non-default value in REACHES"
    table, parse = ENDPOINTS[endpoint]
    body = base_body(endpoint)
    assert f.param is not None
    got, unset = params(parse({**body, **REACHES[f.name]})), params(parse(body))
    assert getattr(got, f.param) != getattr(unset, f.param), (f.name, getattr(got, f.param))


# ---------------------------------------------------------------- the HTTP edge around validation (app.py)
# A stub engine client stands in for the engine process: these check what the app itself decides.


class StubEngine:
    def __init__(self, state: str = "ready", fail_with: Exception | None = None):
        from appliance.protocol import EngineStatus

        self._status = EngineStatus(state, max_context=64, vocab_size=100)
        self.fail_with = fail_with
        self.records = []

    def status(self, model: str = ""):
        from appliance.protocol import EngineStatus

        return self._status if model == MODEL else EngineStatus("unknown", f"The model `{model}` does not exist")

    serving_status = status

    def models(self):
        from appliance.protocol import ModelInfo

        return [ModelInfo(MODEL, 1, self._status.state)]

    def open_job(self, job):
        raise self.fail_with

    def record_http(self, record):
        self.records.append(record)


def edge(engine: StubEngine, **settings):
    from appliance.settings import ServeSettings
    from appliance.wsgi.app import create_app

    app = create_app(ServeSettings(model_dir="unused", served_model_name=MODEL, model_created=1, **settings), engine)
    return app.test_client()


def test_unexpected_errors_are_500_without_internals():
    engine = StubEngine(fail_with=RuntimeError("secret internal detail"))
    r = edge(engine).post("/v3/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 500
    assert r.get_json() == {
        "error": {"message": "Internal server error", "type": "server_error", "param": None, "code": "internal_error"}
    }
    assert b"secret" not in r.data and b"Traceback" not in r.data
    assert engine.records[-1].status == 500 and engine.records[-1].error_type == "server_error"


def test_not_ready_is_503_but_validation_and_liveness_still_answer():
    client = edge(StubEngine(state="loading"))
    r = client.post("/v3/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 503 and r.get_json()["error"]["code"] == "model_not_ready"
    assert client.get("/v2/health/ready").status_code == 503
    assert client.get("/v2/health/live").status_code == 200
    assert client.post("/v3/completions", json={"model": MODEL, "prompt": "x", "top_k": 0}).status_code == 400
    state = client.get("/v1/config").get_json()[MODEL]["model_version_status"][0]["state"]
    assert state == "LOADING"


def test_body_checks_before_validation():
    client = edge(StubEngine(), max_body_bytes=100)
    assert client.post("/v3/completions", data="{}", content_type="text/plain").status_code == 415
    r = client.post("/v3/completions", data='{"model": "m", "prompt": NaN}', content_type="application/json")
    assert (r.status_code, r.get_json()["error"]["message"]) == (400, "Request body is not valid JSON")
    r = client.post("/v3/completions", json={"model": MODEL, "prompt": "x" * 200})
    assert r.status_code == 413 and r.get_json()["error"]["code"] == "request_too_large"
    r = client.post("/v3/completions", data="[1]", content_type="application/json; charset=utf-8")
    assert r.get_json()["error"]["message"] == "Received json is not an object"


def test_each_prefix_builds_its_requests_with_its_dialect():
    """The route table's prefix reaches the engine's job: a stream's stop string is OVMS's default on /v3 and its
    deprecated /v3/v1, OpenAI's on /v1 (tests/openai_api/test_stop_stream_e2e.py: the same on the wire)."""

    class Sent(Exception):
        pass

    jobs = []

    class Recording(StubEngine):
        def open_job(self, job):
            jobs.append(job)
            raise Sent()

    client = edge(Recording())
    for prefix, included in (("/v3", True), ("/v3/v1", True), ("/v1", False)):
        for path, body in (
            ("completions", {"prompt": "x"}),
            ("chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ):
            r = client.post(f"{prefix}/{path}", json={"model": MODEL, "stop": "y", "stream": True, **body})
            assert r.status_code == 500
            assert jobs[-1].params.include_stop_str_in_output is included, (prefix, path)


def test_api_key_guards_everything_but_health_probes(tmp_path):
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    client = edge(StubEngine(), api_key_file=str(key))
    assert client.get("/v3/models").status_code == 401
    assert client.get("/v3/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.get("/v3/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/v2/health/ready").status_code == 200


# ---------------------------------------------------------------- the limits table (appliance/limits.py)


def test_limits_table_in_docs_is_the_declared_one():
    """docs/serving.md's Limits table is exactly `limits_table()`: every field, its default and its flag."""
    from pathlib import Path

    from appliance.limits import limits_table

    doc = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    assert limits_table() in doc, "regenerate the table: python -m appliance.limits"
    rows = {line.split("|")[1].strip(" `"): line.split("|")[2].strip() for line in limits_table().splitlines()[2:]}
    assert rows["prompts"] == "256" and rows["max_tokens"] == "none" and rows["length_penalty"] == "10"
    assert set(rows) == {f.name for f in fields(Limits)}


def test_the_docs_prose_names_limits_and_restates_no_value():
    """The Limits table is the one place docs/serving.md states a bound's value: prose that names a bounded field
    (from its row's `bounds`) together with that limit's default (on the line or the one before: a bullet wraps)
    restates it, and would go stale when the default moves. Prose says "the `name` limit" instead."""
    import re
    from pathlib import Path

    from appliance.limits import field_default, limits_table, show

    doc = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    lines = [line for line in doc.replace(limits_table(), "").splitlines() if not line.startswith("| `--")]
    stale = []
    for f in fields(Limits):
        value = show(field_default(f))
        if not value.isdigit():
            continue
        names = {f.name, *re.findall(r"`([a-z_]+)`", f.metadata["help"])}
        number = re.compile(rf"(?<![\d])(?<!\d\.){value}(?![\d])(?!\.\d)")
        for before, line in zip(["", *lines], lines):
            if number.search(line) and any(f"`{name}`" in before + line for name in names):
                stale.append(f"{f.name} = {value}: {line.strip()}")
    assert not stale, "\n".join(stale)


def test_limit_flags_derive_from_the_fields(monkeypatch):
    from appliance import cli, limits, options
    from appliance.settings import ConfigError

    for f in limits.flag_fields():
        kind, default, help_text = options.SERVE_OPTIONS[f.metadata["flag"]]
        assert (default, help_text) == (f.default, f.metadata["help"])
    args = cli.build_parser().parse_args(["serve", "--max-prompts", "3", "--max-n", "4"])
    got = options.limits_from(args)
    assert (got.prompts, got.n, got.best_of, got.max_tokens) == (3, 4, 20, None)
    with pytest.raises(ConfigError, match="--max-prompts must be at least 1"):
        options.limits_from(cli.build_parser().parse_args(["serve", "--max-prompts", "0"]))
    monkeypatch.setenv("APPLIANCE_MAX_BEST_OF", "2")
    assert options.limits_from(cli.build_parser().parse_args(["serve"])).best_of == 2


def test_settings_round_trip_rebuilds_limits(tmp_path):
    from appliance.settings import ServeSettings

    s = ServeSettings(
        model_dir="x",
        served_model_name=MODEL,
        model_created=1,
        runtime_dir=str(tmp_path),
        limits=Limits(prompts=7, length_penalty=3.0),
        max_queued=9,
    )
    s.save()
    loaded = ServeSettings.load(str(tmp_path))
    assert loaded == s and isinstance(loaded.limits, Limits) and loaded.limits.prompts == 7


def test_config_shows_effective_limits_beside_model_version_status():
    client = edge(StubEngine(), limits=Limits(prompts=5), max_queued=11)
    entry = client.get("/v1/config").get_json()[MODEL]
    assert entry["model_version_status"][0]["state"] == "AVAILABLE"
    assert entry["limits"]["prompts"] == 5 and entry["limits"]["max_queued"] == 11
    assert set(entry["limits"]) == {f.name for f in fields(Limits)}


# ---------------------------------------------------------------- every bound is a 400

BOUND_ERRORS = [
    ({"length_penalty": 2000}, "length_penalty out of range(-10.0, 10.0)", "length_penalty"),
    ({"length_penalty": -10.5}, "length_penalty out of range(-10.0, 10.0)", "length_penalty"),
    ({"repetition_penalty": 10.01}, "repetition_penalty out of range(0.0, 10.0]", "repetition_penalty"),
    ({"timeout": 86401}, "timeout must be at most 86400 seconds", "timeout"),
    ({"stop": ["x" * 257]}, "stop strings must be at most 256 characters long", "stop"),
    ({"stop": "x" * 257}, "stop strings must be at most 256 characters long", "stop"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids must have no more than 64 token ids", "stop_token_ids"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias must have no more than 300 entries", "logit_bias"),
    ({"logit_bias": {"01": 1}}, "logit_bias keys must be token ids", "logit_bias"),
    ({"logit_bias": {"+1": 1}}, "logit_bias keys must be token ids", "logit_bias"),
    ({"logit_bias": {" 1": 1}}, "logit_bias keys must be token ids", "logit_bias"),
    ({"logit_bias": {"1 ": 1}}, "logit_bias keys must be token ids", "logit_bias"),
    ({"logit_bias": {"1_0": 1}}, "logit_bias keys must be token ids", "logit_bias"),
    ({"logit_bias": {"\u0661": 1}}, "logit_bias keys must be token ids", "logit_bias"),  # Arabic-Indic one
    ({"logit_bias": {"4294967296": 1}}, "logit_bias keys must be token ids", "logit_bias"),
    ({"logit_bias": {"1": 10**400}}, "logit_bias values must be numbers in [-100, 100]", "logit_bias"),
    ({"logit_bias": {"1": True}}, "logit_bias values must be numbers in [-100, 100]", "logit_bias"),
    ({"top_k": 4294967296}, "top_k must be -1 (all tokens) or a positive integer", "top_k"),
    ({"min_tokens": 10**400}, "min_tokens is not an unsigned integer", "min_tokens"),
]


@pytest.mark.parametrize("parse", [completion, chat], ids=["completions", "chat"])
@pytest.mark.parametrize("fields_,message,param", BOUND_ERRORS, ids=[m for _, m, _ in BOUND_ERRORS])
def test_bounds(parse, fields_, message, param):
    err = error_of(parse, **fields_)
    assert (err.message, err.param) == (message, param)


def test_bounds_accept_their_edges():
    req = completion(
        length_penalty=-10,
        repetition_penalty=10,
        timeout=86400,
        stop=["x" * 256],
        stop_token_ids=list(range(64)),
        logit_bias={str(i): -100 for i in range(300)},
    )
    p = params(req)
    assert p.length_penalty == -10.0 and len(p.stop_token_ids) == 64 and len(p.logit_bias) == 300
    assert params(completion(logit_bias={"0": 1, "10": 2})).logit_bias == {0: 1.0, 10: 2.0}
    assert params(completion(stop_token_ids=[5, 5, 6])).stop_token_ids == [5, 6]
    assert params(completion(top_k=4294967295)).top_k == 4294967295


def test_speculation_bounds_follow_the_limits():
    limits = Limits(assistant_tokens=4, ngram_size=2, prediction_chars=5)
    for field_, value, message in [
        ("num_assistant_tokens", 5, "num_assistant_tokens out of range [0, 4]"),
        ("max_ngram_size", 3, "max_ngram_size out of range [1, 2]"),
        ("prediction", {"type": "content", "content": "x" * 6}, "prediction content must be at most 5 characters"),
        ("prediction", {"type": "content", "content": [{"type": "text", "text": "xxx"}] * 2}, "at most 5 characters"),
    ]:
        body = {"model": MODEL, "prompt": "x", field_: value}
        assert message in error_of(parse_completion, body, limits).message
    edges = {"num_assistant_tokens": 4, "max_ngram_size": 2, "prediction": {"type": "content", "content": "x" * 5}}
    p = params(parse_completion({"model": MODEL, "prompt": "x", **edges}, limits))
    assert (p.num_assistant_tokens, p.max_ngram_size, p.prediction) == (4, 2, "xxxxx")


def test_float_ranges_follow_the_limits():
    limits = Limits(length_penalty=1.0, temperature=1.0, penalty=0.5, repetition_penalty=2.0, timeout=5.0)
    for field_, value, message in [
        ("length_penalty", 1.5, "length_penalty out of range(-1.0, 1.0)"),
        ("temperature", 1.5, "temperature out of range(0.0, 1.0)"),
        ("presence_penalty", -0.6, "presence_penalty out of range(-0.5, 0.5)"),
        ("repetition_penalty", 2.5, "repetition_penalty out of range(0.0, 2.0]"),
        ("timeout", 6, "timeout must be at most 5 seconds"),
    ]:
        body = {"model": MODEL, "prompt": "x", field_: value}
        assert error_of(parse_completion, body, limits).message == message


@pytest.mark.parametrize("endpoint,f", table_params(lambda f: f.kind == "number"))
def test_huge_integers_in_number_fields_are_400(endpoint, f):
    """A 400-digit integer is no float: the field's 400, not an OverflowError."""
    table, parse = ENDPOINTS[endpoint]
    for huge in (10**400, -(10**400)):
        assert error_of(parse, {**base_body(endpoint), f.name: huge}).param == f.name


@pytest.mark.parametrize("endpoint,f", table_params(lambda f: f.kind != "number" and "integer" in json_types(f)))
def test_huge_integers_in_integer_fields_are_400(endpoint, f):
    """Integer fields (and structured ones that take an integer: completions' seed) refuse 400-digit integers."""
    table, parse = ENDPOINTS[endpoint]
    for huge in (10**400, -(10**400)):
        assert error_of(parse, {**base_body(endpoint), f.name: huge}).param == f.name


def _outside(f: F.Field, bound: F.Bound, limits: Limits) -> int | float | None:
    """The nearest value of the field's type past `bound` (None: no bound under these limits)."""
    edge = bound.resolve(limits)
    if edge is None or bound.exclusive:
        return edge
    step = 1 if f.kind == "integer" else max(abs(edge), 1.0) * 1e-9
    return edge - step if bound.side == "min" else edge + step


def _first_failed(f: F.Field, value: float, limits: Limits) -> F.Bound | None:
    for bound in f.bounds:
        edge = bound.resolve(limits)
        if edge is not None and (value < edge if bound.side == "min" else value > edge):
            return bound
        if edge is not None and bound.exclusive and value == edge:
            return bound
    return None


@pytest.mark.parametrize("endpoint,f", table_params(lambda f: f.kind in TYPE_SAMPLES))
def test_every_typed_field_refuses_other_types_and_values_past_its_bounds(endpoint, f):
    """Each boolean, integer, number and string field of the tables, as declared there: a value of another JSON
    type is its type message, a value just past each bound the message of the first bound it breaks (the exact OVMS
    texts are pinned by the rows above), both naming the field."""
    table, parse = ENDPOINTS[endpoint]
    limits = Limits()
    err = error_of(parse, {**base_body(endpoint), f.name: TYPE_SAMPLES[f.kind]})
    assert (err.message, err.param) == (f.text(f.message, limits), f.name)
    for bound in f.bounds:
        value = _outside(f, bound, limits)
        if value is None or value in f.also:
            continue
        failed = _first_failed(f, value, limits)
        assert failed is not None, (f.name, value)
        err = error_of(parse, {**base_body(endpoint), f.name: value}, limits)
        assert (err.message, err.param) == (f.text(failed.message or f.message, limits), f.name), value


def test_prompt_count_is_bounded():
    assert len(completion(prompt=["a"] * 256).prompts) == 256
    assert error_of(completion, prompt=["a"] * 257).message == "prompt array must have no more than 256 prompts"
    assert error_of(completion, prompt=[[1]] * 257).param == "prompt"
    assert len(completion(prompt=list(range(1000))).prompts) == 1  # token ids of one prompt are not prompts
    limits = Limits(prompts=2)
    assert (
        error_of(parse_completion, {"model": MODEL, "prompt": ["a", "b", "c"]}, limits).message
        == "prompt array must have no more than 2 prompts"
    )
    assert len(parse_tokenize({"model": MODEL, "prompt": ["a"] * 256}).prompts) == 256
    assert (
        error_of(parse_tokenize, {"model": MODEL, "prompt": ["a"] * 257}).message
        == "prompt array must have no more than 256 prompts"
    )
    assert error_of(parse_tokenize, {"model": MODEL, "prompt": ["a"] * 3}, limits).param == "prompt"


def test_n_times_prompts_past_max_queued_is_400_before_anything_is_built():
    limits = Limits(max_queued=8)
    assert len(parse_completion({"model": MODEL, "prompt": ["a"] * 4, "n": 2}, limits).prompts) == 4
    with pytest.raises(ApiError) as info:
        parse_completion({"model": MODEL, "prompt": ["a"] * 3, "n": 3}, limits)
    assert (info.value.status, info.value.param, info.value.type) == (400, "n", "invalid_request_error")
    assert "9 queue places" in info.value.message and "8" in info.value.message
    with pytest.raises(ApiError) as info:
        parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 9}, limits)
    assert info.value.status == 400
    # beam search queues one sequence per prompt, whatever n is
    assert parse_completion({"model": MODEL, "prompt": ["a"] * 8, "n": 3, "best_of": 3}, limits).edge.n == 3
    assert parse_completion({"model": MODEL, "prompt": ["a"] * 100, "n": 20}).edge.n == 20  # no max_queued known


def test_queue_check_on_the_http_edge_never_reaches_the_engine():
    """The worker refuses it without building the choices or contacting the engine with the job."""
    engine = StubEngine(fail_with=AssertionError("open_job must not be called"))
    client = edge(engine, max_queued=4)
    r = client.post("/v3/completions", json={"model": MODEL, "prompt": ["a", "b", "c"], "n": 2})
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "n"
    r = client.post("/v3/tokenize", json={"model": MODEL, "prompt": ["a"] * 257})
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "prompt"


SURROGATE = "\ud800"


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": SURROGATE},
        {"prompt": ["ok", "a" + SURROGATE]},
        {"prompt": "x", "stop": [SURROGATE]},
        {"prompt": "x", "user": SURROGATE},
        {"prompt": "x", "metadata": {"k": [SURROGATE]}},
        {"prompt": "x", "metadata": {SURROGATE: 1}},
        {"prompt": "x", "logit_bias": {SURROGATE: 1}},
    ],
)
def test_lone_surrogates_are_400_in_completions(body):
    err = error_of(parse_completion, {"model": MODEL, **body})
    assert "lone surrogate" in err.message and err.param in body


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": SURROGATE}],
        [{"role": SURROGATE, "content": "x"}],
        [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}],
        [{"role": "user", "content": "x", "name": SURROGATE}],
    ],
)
def test_lone_surrogates_are_400_in_chat_and_tokenize(messages):
    err = error_of(parse_chat, {"model": MODEL, "messages": messages})
    assert "lone surrogate" in err.message and err.param == "messages"
    assert error_of(parse_chat, {"model": SURROGATE, "messages": [{"role": "user", "content": "x"}]}).param == "model"
    assert error_of(parse_tokenize, {"model": MODEL, "prompt": ["x", SURROGATE]}).param == "prompt"


def test_surrogate_pairs_are_fine():
    import json

    body = json.loads('{"model": "m", "prompt": "\\ud83d\\ude00"}')  # an escaped pair: one emoji
    assert parse_completion(body).prompts == ("\U0001f600",)


def test_deep_nesting_is_400():
    nested: object = "x"
    for _ in range(40):
        nested = [nested]
    err = error_of(completion, metadata=nested)
    assert err.param == "metadata" and "deeper than 32" in err.message
    shallow: object = "x"
    for _ in range(30):  # body (1) + 31 levels: fine
        shallow = {"a": shallow}
    assert completion(metadata=shallow).edge.unknown == ("metadata",)
    assert (
        error_of(parse_completion, {"model": MODEL, "prompt": "x", "metadata": [[[1]]]}, Limits(depth=3)).param
        == "metadata"
    )


def test_wrong_types_everywhere_are_400():
    """Every field, given every JSON type: a 400 (or accepted), never another exception."""
    samples = [None, True, 0, -1, 1.5, 10**400, "s", "", [], [1], ["a"], [[1]], {}, {"a": 1}, [None], [{}]]
    names = list(dict.fromkeys(f.name for table in (F.COMPLETION, F.CHAT, F.TOKENIZE) for f in table))
    names.append("an_unknown_field")
    for name in names:
        for value in samples:
            for parse, base in (
                (parse_completion, {"model": MODEL, "prompt": "hi"}),
                (parse_chat, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
                (parse_tokenize, {"model": MODEL, "prompt": "hi"}),
            ):
                try:
                    parse({**base, name: value})
                except ApiError as exc:
                    assert exc.status == 400, (name, value, exc)


def test_chat_messages_keep_only_template_fields():
    req = parse_chat(
        {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": "hi", "name": "ann", "extra": {"deep": [1, 2]}, "audio": None},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                },
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
            ],
        }
    )
    assert req.messages == (
        {"role": "user", "content": "hi", "name": "ann"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    )
    for message, text in [
        ({"name": 5}, "message name is not a string"),
        ({"tool_call_id": ["x"]}, "message tool_call_id is not a string"),
        ({"tool_calls": {"id": 1}}, "message tool_calls is not an array of objects"),
        ({"tool_calls": ["x"]}, "message tool_calls is not an array of objects"),
    ]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x", **message}]}
        assert error_of(parse_chat, body).message == text


def test_message_count_is_bounded():
    one = {"role": "user", "content": "x"}
    assert len(chat(messages=[one] * 1024).messages) == 1024
    assert error_of(chat, messages=[one] * 1025).message == "messages array must have no more than 1024 messages"


# ---------------------------------------------------------------- engine-side checks (jobs.JobRunner.submit)
# A stub engine (tokenizer, vocabulary, submit) stands in for the runtime: these check what the service decides
# after tokenization, before anything is queued.


class StubTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True, token_budget: int | None = None) -> list[int]:
        text.encode("utf-8")  # as tokenizers: a lone surrogate is refused (there a TypeError)
        if "\x00" in text:
            raise TypeError("TextInputSequence must be str")
        return [1] * len(text)

    def decode(self, ids) -> str:
        return "x" * len(ids)


class StubRuntime:
    def __init__(self):
        from types import SimpleNamespace

        self.tokenizer = StubTokenizer()
        self.manifest = SimpleNamespace(vocab_size=100)
        self.max_context = 8192
        self.backend = SimpleNamespace(max_prompt=None)  # dynamic shapes: no prompt cap below the context
        self.config = SimpleNamespace(max_ngram_size=3, prefix_cache_sharing="keys")
        self.submitted = []

    def prepare(self, params):
        return params

    def submit_prompts(self, requests):
        self.submitted.append(requests)
        return [[SimpleHandle() for _ in params] for _, params, _ in requests]


class SimpleHandle:
    def cancel(self):
        pass


def submit(job_fields: dict, params_fields: dict, limits: Limits = Limits()):
    from appliance.params import SamplingParams
    from appliance.protocol import Job, PromptSpec
    from appliance.server import engine_service as es
    from appliance.server.metrics import ServerMetrics
    from appliance.server.slots import Rejected
    from appliance.settings import ServeSettings

    service = es.EngineService(
        ServeSettings(model_dir="x", served_model_name=MODEL, model_created=1, limits=limits), ServerMetrics()
    )
    runtime = StubRuntime()
    service.attach(runtime, "CPU")  # type: ignore[arg-type]
    job = Job(
        **{
            "request_id": "r",
            "prompts": [PromptSpec(text="hello")],
            "params": SamplingParams(max_tokens=2, **params_fields),
            **job_fields,
        }
    )
    try:
        return service.jobs.submit(job), runtime
    except Rejected as exc:
        return exc.failed, runtime


def test_stop_token_ids_outside_the_vocabulary_are_400():
    failed, runtime = submit({}, {"stop_token_ids": [5, 100]})
    assert (failed.status, failed.param) == (400, "stop_token_ids") and "100" in failed.message
    assert not runtime.submitted
    (handles, accepted), runtime = submit({}, {"stop_token_ids": [99]})
    assert len(handles) == 1 and runtime.submitted


def test_tokenizer_errors_are_400_not_a_dropped_connection():
    from appliance.protocol import PromptSpec

    for text in ("bad\x00text", "\ud800"):
        failed, runtime = submit({"prompts": [PromptSpec(text=text)]}, {})
        assert (failed.status, failed.param) == (400, "prompt") and "cannot be tokenized" in failed.message
        assert not runtime.submitted


def test_echo_logprobs_volume_is_bounded_after_tokenization():
    from appliance.protocol import PromptSpec

    limits = Limits(prompt_logprobs=1000)
    # 100 prompt tokens x (1 + 4) x n 2 = 1000: fits; one token more does not
    (handles, _), _ = submit(
        {"prompts": [PromptSpec(text="x" * 100)], "n": 2, "echo": True}, {"prompt_logprobs": 4, "logprobs": 4}, limits
    )
    assert len(handles) == 2
    failed, runtime = submit(
        {"prompts": [PromptSpec(text="x" * 101)], "n": 2, "echo": True}, {"prompt_logprobs": 4, "logprobs": 4}, limits
    )
    assert (failed.status, failed.param) == (400, "logprobs") and "1010" in failed.message
    assert not runtime.submitted
    (handles, _), _ = submit({"prompts": [PromptSpec(text="x" * 5000)]}, {}, limits)  # no echo logprobs: no bound
    assert len(handles) == 1


def test_generated_logprobs_volume_is_bounded_engine_side():
    """n x tokens (max_tokens, else what the context leaves) x (1 + logprobs) past the limits table's
    generated_logprobs is a 400 before anything is queued."""
    failed, runtime = submit({"n": 20}, {"logprobs": 20}, Limits(generated_logprobs=100))
    assert (failed.status, failed.param) == (400, "logprobs") and "x (1 + 20) logprobs x n 20" in failed.message
    assert not runtime.submitted
    (handles, _), runtime = submit({"n": 2}, {"logprobs": 5}, Limits(generated_logprobs=24))  # 2 x 2 x 6
    assert len(handles) == 2


def test_setup_work_is_bounded_engine_side():
    """bad word tokens + prompt tokens x (no_repeat_ngram - 1), per sequence, past setup_work is a 400."""
    failed, runtime = submit({"n": 4}, {"no_repeat_ngram": 11}, Limits(setup_work=199))  # 5 tokens x 10 x 4
    assert failed.status == 400 and failed.param == "no_repeat_ngram" and "set-up work is 200" in failed.message
    assert not runtime.submitted
    (handles, _), _ = submit({"n": 4}, {"no_repeat_ngram": 11}, Limits(setup_work=200))
    assert len(handles) == 4
    failed, _ = submit({}, {"bad_word_tokens": [[1, 2, 3]] * 10}, Limits(setup_work=29))
    assert failed.status == 400 and failed.param == "bad_words"


def test_a_prepare_failure_names_the_field_the_engine_names(monkeypatch):
    """The 400's `param` for what `prepare` refuses is the field its ParamInvalid names, and `bad_words` for any
    other error (the bad words are all it tokenizes besides the prediction), whatever the message's words."""
    from appliance.runtime.engine.admission import ParamInvalid

    for error, param in (
        (ParamInvalid("the hint is 9000 tokens, more than the model max length", "prediction"), "prediction"),
        (ValueError("prediction: a bad word the tokenizer refused"), "bad_words"),
    ):

        def refuse(self, params, error=error):
            raise error

        monkeypatch.setattr(StubRuntime, "prepare", refuse)
        failed, runtime = submit({}, {"bad_words": ["prediction"]})
        assert (failed.status, failed.param, failed.message) == (400, param, str(error))
        assert not runtime.submitted


def test_a_prompt_past_the_context_gets_ovms_message_before_the_engine_sees_it():
    """A prompt that alone fills the context is refused as it is tokenized, in OVMS's words (the engine's own
    check, for a prompt + max_tokens past it, says the same)."""
    from appliance.protocol import PromptSpec

    failed, runtime = submit({"prompts": [PromptSpec(text="x" * 8192)]}, {})  # the stub: a token per character
    assert (failed.status, failed.message) == (
        400,
        "Number of prompt tokens: 8192 + max tokens value: 2 exceeds model max length: 8192",
    )
    assert not runtime.submitted
