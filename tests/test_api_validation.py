"""Unit tests of the request validation layer (appliance/openai_api/validation.py): OVMS's rules and messages,
JSON null = not set, and how defaults are filled from generation_config.json and OVMS's built-ins."""
from __future__ import annotations

import pytest

from appliance.openai_api.errors import ApiError
from appliance.openai_api.validation import (Limits, parse_chat, parse_completion, parse_tokenize,
                                             sampling_params)

MODEL = "m"


def completion(**fields):
    return parse_completion({"model": MODEL, "prompt": "hi", **fields})


def chat(**fields):
    return parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields})


def error_of(fn, *args, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args, **kwargs)
    assert info.value.status == 400
    return info.value


# ---------------------------------------------------------------- OVMS messages, one row per rule

COMMON_ERRORS = [
    ({"stream": "yes"}, "Stream is not bool", "stream"),
    ({"stream": 1}, "Stream is not bool", "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options provided, but stream not set to true",
     "stream_options"),
    ({"stream": False, "stream_options": {}}, "stream_options provided, but stream not set to true", "stream_options"),
    ({"stream": True, "stream_options": [1]}, "stream_options is not an object", "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": True, "other": 1}},
     "Found unexpected stream options. Properties accepted in stream_options: include_usage", "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage is not a boolean",
     "stream_options"),
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
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output accepts values true or false",
     "include_stop_str_in_output"),
    ({"stream": True, "include_stop_str_in_output": False},
     "include_stop_str_in_output cannot be set to false if streaming is used", "include_stop_str_in_output"),
    ({"best_of": 0}, "best_of value should be greater than 0", "best_of"),
    ({"best_of": 21}, "best_of exceeds limit provided in graph config: 20", "best_of"),
    ({"best_of": 2, "stream": True}, "best_of cannot be used in streaming mode", "best_of"),
    ({"best_of": 1, "n": 2}, "n value cannot be greater than best_of", "n"),
    ({"n": 0}, "n value should be greater than 0", "n"),
    ({"n": 21}, "n exceeds limit provided in graph config: 20", "n"),
    ({"n": "2"}, "n is not an integer", "n"),
    ({"skip_special_tokens": 0}, "skip_special_tokens is not a bool", "skip_special_tokens"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids is not an array of token ids", "stop_token_ids"),
    ({"min_tokens": -1}, "min_tokens is not an unsigned integer", "min_tokens"),
    ({"logit_bias": [1]}, "logit_bias is not an object", "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias keys must be token ids", "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias values must be numbers in [-100, 100]", "logit_bias"),
    ({"timeout": 0}, "timeout must be a positive number of seconds", "timeout"),
    ({"timeout": "1"}, "timeout must be a positive number of seconds", "timeout"),
]


@pytest.mark.parametrize("parse", [completion, chat], ids=["completions", "chat"])
@pytest.mark.parametrize("fields,message,param", COMMON_ERRORS, ids=[m for _, m, _ in COMMON_ERRORS])
def test_common_rules(parse, fields, message, param):
    err = error_of(parse, **fields)
    assert (err.message, err.param) == (message, param)
    assert err.body() == {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                    "code": None}}


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
    ({"prompt": 5}, "prompt is not a string, an array of strings, an array of token ids or an array of arrays of "
                    "token ids"),
    ({"prompt": ["a", 1]}, "prompt is not a string, an array of strings, an array of token ids or an array of "
                           "arrays of token ids"),
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
    ({"messages": [{"role": "user", "content": 5}]}, "message content is not a string or an array of text parts"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "only text content parts are supported"),
]


@pytest.mark.parametrize("fields,message", CHAT_ERRORS, ids=[m for _, m in CHAT_ERRORS])
def test_chat_message_rules(fields, message):
    assert error_of(parse_chat, {"model": MODEL, **fields}).message == message


@pytest.mark.parametrize("fields,message", [
    ({"max_tokens": 0}, "max_tokens value should be greater than 0"),
    ({"max_completion_tokens": 0}, "max_completion_tokens value should be greater than 0"),
    ({"max_completion_tokens": -3}, "max_completion_tokens is not an unsigned integer"),
    ({"logprobs": 1}, "logprobs accepts values true or false"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs out of range [0, 20]"),
    ({"top_logprobs": 2}, "top_logprobs requires logprobs to be true"),
    ({"response_format": {"type": "json_object"}}, 'response_format other than {"type": "text"} is not supported yet'),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools are not supported yet"),
])
def test_chat_rules(fields, message):
    assert error_of(chat, **fields).message == message


@pytest.mark.parametrize("body,message", [
    ([1, 2], "Received json is not an object"),
    ("text", "Received json is not an object"),
    ({"prompt": "hi"}, "model missing in request"),
    ({"model": None, "prompt": "hi"}, "model missing in request"),
    ({"model": 5, "prompt": "hi"}, "model is not a string"),
])
def test_body_and_model(body, message):
    assert error_of(parse_completion, body).message == message
    assert error_of(parse_chat, body).message == message


def test_configured_max_tokens_limit():
    limits = Limits(max_tokens=100)
    assert parse_completion({"model": MODEL, "prompt": "x", "max_tokens": 100}, limits).gen.max_tokens == 100
    err = error_of(parse_completion, {"model": MODEL, "prompt": "x", "max_tokens": 101}, limits)
    assert err.message == "max_tokens exceeds limit provided in graph config: 100"


def test_stop_limit_is_configurable_and_16_is_fine():
    assert len(completion(stop=[f"s{i}" for i in range(16)]).gen.stop) == 16
    assert error_of(parse_completion, {"model": MODEL, "prompt": "x", "stop": ["a", "b", "c"]},
                    Limits(stop_strings=2)).message == "stop array must have no more than 2 strings"


# ---------------------------------------------------------------- accepted forms, nulls, unknown fields

def test_every_optional_field_accepts_null_as_not_set():
    optional = ["stream", "stream_options", "ignore_eos", "max_tokens", "frequency_penalty", "presence_penalty",
                "repetition_penalty", "length_penalty", "temperature", "top_p", "min_p", "top_k", "seed", "stop",
                "include_stop_str_in_output", "best_of", "n", "skip_special_tokens", "stop_token_ids", "min_tokens",
                "logit_bias", "timeout", "user"]
    nulls = {name: None for name in optional}
    assert completion(**nulls, echo=None, logprobs=None) == completion()
    assert chat(**nulls, logprobs=None, top_logprobs=None, max_completion_tokens=None, response_format=None,
                tools=None, tool_choice=None) == chat()


def test_stream_options_null_include_usage_and_false_stream():
    assert completion(stream=True, stream_options={"include_usage": None}).gen.include_usage is False
    assert completion(stream=True, stream_options={"include_usage": True}).gen.include_usage is True
    assert completion(stream=True, stream_options={}).gen.include_usage is False


@pytest.mark.parametrize("prompt,expected", [
    ("hello", ("hello",)),
    (["a", "b"], ("a", "b")),
    ([1, 2, 3], ((1, 2, 3),)),
    ([[1, 2], [3]], ((1, 2), (3,))),
])
def test_prompt_forms(prompt, expected):
    assert completion(prompt=prompt).prompts == expected


def test_unknown_fields_are_accepted_and_reported():
    req = completion(suffix=None, frobnicate=3, metadata={"a": 1})
    assert req.gen.unknown == ("frobnicate", "metadata", "suffix")
    assert chat(extra_body=1).gen.unknown == ("extra_body",)
    assert completion().gen.unknown == ()


def test_echo_allows_max_tokens_zero():
    req = completion(echo=True, max_tokens=0)
    assert req.echo is True and req.gen.max_tokens == 0


def test_stop_string_forms():
    assert completion(stop="###").gen.stop == ("###",)
    assert completion(stop=[]).gen.stop == ()
    assert completion(stop=["a", "", "b"]).gen.stop == ("a", "b")


def test_best_of_one_and_n_default():
    req = completion(best_of=1, n=1)
    assert req.gen.n == 1
    assert completion(n=3).gen.n == 3


def test_chat_content_parts_are_joined_and_null_content_is_empty():
    req = parse_chat({"model": MODEL, "messages": [
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "name": "bot"}]})
    assert req.messages == ({"role": "system", "content": "a\nb"}, {"role": "assistant", "content": "", "name": "bot"})


def test_chat_max_completion_tokens_wins_and_logprobs_forms():
    assert chat(max_tokens=5, max_completion_tokens=7).gen.max_tokens == 7
    assert chat(max_tokens=5).gen.max_tokens == 5
    assert chat(logprobs=True).gen.logprobs == 0
    assert chat(logprobs=True, top_logprobs=3).gen.logprobs == 3
    assert chat(logprobs=False).gen.logprobs is None
    assert chat(tools=[]).gen.unknown == ()


def test_tokenize_forms():
    assert parse_tokenize({"model": MODEL, "prompt": "x"}).batched is False
    req = parse_tokenize({"model": MODEL, "prompt": ["x", "y"]})
    assert (req.prompts, req.batched) == (("x", "y"), True)
    assert error_of(parse_tokenize, {"model": MODEL}).message == "prompt is missing"
    assert error_of(parse_tokenize, {"model": MODEL, "prompt": 3}).message == \
        "prompt is not a string or array of strings"


def test_non_finite_numbers_are_rejected():
    assert error_of(completion, temperature=float("nan")).message == "temperature is not a valid number"


# ---------------------------------------------------------------- defaults

def test_builtin_defaults_are_greedy_and_unbounded():
    sp = sampling_params(completion().gen, {})
    assert (sp.temperature, sp.top_k, sp.top_p, sp.repetition_penalty) == (0.0, -1, 1.0, 1.0)
    assert sp.max_tokens is None            # until EOS or the context is full
    assert sp.include_stop_str_in_output is False
    assert sp.skip_special_tokens is True and sp.seed is None and sp.logprobs is None


def test_sampling_without_top_k_gets_ovms_40():
    assert sampling_params(completion(temperature=0.7).gen, {}).top_k == 40
    assert sampling_params(completion(temperature=0.7, top_k=5).gen, {}).top_k == 5
    assert sampling_params(completion(temperature=0.7, top_k=-1).gen, {}).top_k == -1
    assert sampling_params(completion(temperature=0.0).gen, {}).top_k == -1


def test_generation_config_defaults_apply_before_builtins():
    model_defaults = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
    sp = sampling_params(completion().gen, model_defaults)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty) == (0.6, 0.9, 20, 1.1)
    sp = sampling_params(completion(temperature=0.0, top_p=0.5, repetition_penalty=1.0).gen, model_defaults)
    assert (sp.temperature, sp.top_p, sp.repetition_penalty) == (0.0, 0.5, 1.0)


def test_generation_config_temperature_needs_do_sample():
    sp = sampling_params(completion().gen, {"temperature": 0.6, "top_k": 0})
    assert (sp.temperature, sp.top_k) == (0.0, -1)
    assert sampling_params(completion(temperature=1.0).gen, {"top_k": 0}).top_k == -1   # HF 0 = disabled


def test_include_stop_str_defaults_follow_streaming():
    assert sampling_params(completion(stream=True).gen, {}).include_stop_str_in_output is True
    assert sampling_params(completion().gen, {}).include_stop_str_in_output is False
    assert sampling_params(completion(include_stop_str_in_output=True).gen, {}).include_stop_str_in_output is True


def test_request_values_reach_sampling_params():
    gen = completion(max_tokens=7, seed=3, stop=["x"], stop_token_ids=[9], ignore_eos=True, min_tokens=2,
                     logit_bias={"5": -100}, logprobs=2, presence_penalty=0.5, frequency_penalty=-0.5,
                     skip_special_tokens=False, n=2).gen
    sp = sampling_params(gen, {})
    assert (sp.max_tokens, sp.seed, sp.stop, sp.stop_token_ids, sp.ignore_eos, sp.min_tokens) == \
        (7, 3, ["x"], [9], True, 2)
    assert (sp.logit_bias, sp.logprobs, sp.presence_penalty, sp.frequency_penalty) == ({5: -100.0}, 2, 0.5, -0.5)
    assert sp.skip_special_tokens is False
    assert sp.n == 1 and gen.n == 2    # n choices are n independent submissions


# ---------------------------------------------------------------- the HTTP edge around validation (app.py)
# A stub engine client stands in for the engine process: these check what the app itself decides.

class StubEngine:
    def __init__(self, state: str = "ready", fail_with: Exception | None = None):
        from appliance.server.protocol import EngineStatus
        self._status = EngineStatus(state, max_context=64, vocab_size=100)
        self.fail_with = fail_with
        self.records = []

    def status(self):
        return self._status

    def open_job(self, job):
        raise self.fail_with

    def record_http(self, record):
        self.records.append(record)


def edge(engine: StubEngine, **settings):
    from appliance.openai_api.app import create_app
    from appliance.server.settings import ServeSettings
    app = create_app(ServeSettings(model_dir="unused", served_model_name=MODEL, model_created=1, **settings), engine)
    return app.test_client()


def test_unexpected_errors_are_500_without_internals():
    engine = StubEngine(fail_with=RuntimeError("secret internal detail"))
    r = edge(engine).post("/v3/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 500
    assert r.get_json() == {"error": {"message": "Internal server error", "type": "server_error", "param": None,
                                      "code": "internal_error"}}
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


def test_api_key_guards_everything_but_health_probes(tmp_path):
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    client = edge(StubEngine(), api_key_file=str(key))
    assert client.get("/v3/models").status_code == 401
    assert client.get("/v3/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.get("/v3/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/v2/health/ready").status_code == 200
