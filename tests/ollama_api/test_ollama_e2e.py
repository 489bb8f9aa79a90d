"""End to end: Ollama's API (appliance/ollama_api/) through the real `ollama` Python client and `langchain-ollama`
against a real server on the default model. Validity is asserted (non-empty text, streamed chunks adding up to the
text, counts, schema-valid JSON, arguments as objects, Ollama's error statuses), never the exact text; the requests
are few and short (num_predict bounds every generation)."""

from __future__ import annotations

import json

import jsonschema
import ollama
import pytest
import requests

from tests.helpers import Server

pytestmark = pytest.mark.slow

PREDICT = {"num_predict": 24, "temperature": 0}
ASK = [{"role": "user", "content": "Say hello in one short sentence."}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather of a city", "parameters": WEATHER},
    }
]


@pytest.fixture(scope="module")
def srv(model_dir, tmp_path_factory):
    with Server(
        model_dir, tmp_path_factory.mktemp("ollama") / "serve.log", "--workers", "1", "--tool-parser", "llama3_json"
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv) -> ollama.Client:
    return ollama.Client(host=srv.base, timeout=120)


@pytest.fixture(scope="module")
def tag(client) -> str:
    return client.list().models[0].model


def test_chat_unary(client, tag):
    r = client.chat(model=tag, messages=ASK, options=PREDICT, stream=False)
    assert r.done and r.done_reason in ("stop", "length")
    assert r.message.role == "assistant" and r.message.content
    assert r.prompt_eval_count > 0 and r.eval_count > 0
    assert r.total_duration >= r.eval_duration > 0 and r.prompt_eval_duration > 0
    assert r.load_duration == 0 and r.created_at.endswith("Z")


def test_chat_streaming_adds_up(client, tag):
    chunks = list(client.chat(model=tag, messages=ASK, options=PREDICT, stream=True))
    text = "".join(c.message.content or "" for c in chunks)
    assert text and len(chunks) > 2
    assert all(not c.done for c in chunks[:-1])
    last = chunks[-1]
    assert last.done and last.done_reason in ("stop", "length")
    assert last.eval_count > 0 and last.prompt_eval_count > 0 and last.total_duration > 0
    unary = client.chat(model=tag, messages=ASK, options=PREDICT, stream=False)
    assert unary.message.content == text  # greedy: the stream is the unary answer in pieces


def test_generate(client, tag):
    r = client.generate(model=tag, prompt="The capital of France is", options=PREDICT)
    assert r.done and r.response and r.eval_count > 0
    raw = "".join(
        c.response for c in client.generate(model=tag, prompt="1, 2, 3,", raw=True, options=PREDICT, stream=True)
    )
    assert raw


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs(client, tag, stream):
    kwargs = dict(model=tag, messages=ASK, options={"num_predict": 4, "temperature": 0}, logprobs=True, top_logprobs=2)
    if stream:
        entries = [e for chunk in client.chat(**kwargs, stream=True) for e in chunk.logprobs or ()]
    else:
        entries = list(client.chat(**kwargs).logprobs or ())
    assert len(entries) == 4
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in entries)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_is_left_out(client, tag, stream):
    """Ollama leaves the stop string out of the text, streamed too (the OpenAI side's streams keep it, as OVMS)."""
    options = {"num_predict": 24, "temperature": 0, "stop": [" "]}
    if stream:
        chunks = list(client.chat(model=tag, messages=ASK, options=options, stream=True))
        text, reason = "".join(c.message.content or "" for c in chunks), chunks[-1].done_reason
    else:
        r = client.chat(model=tag, messages=ASK, options=options)
        text, reason = r.message.content, r.done_reason
    assert reason == "stop" and " " not in text


def test_num_predict_is_a_length_stop(client, tag):
    r = client.chat(
        model=tag, messages=[{"role": "user", "content": "Count from 1 to 100."}], options={"num_predict": 3}
    )
    assert r.done_reason == "length" and r.eval_count == 3


def test_format_json_schema(client, tag):
    r = client.chat(
        model=tag,
        messages=[{"role": "user", "content": "Give a person's name and age as JSON."}],
        format=SCHEMA,
        options={"num_predict": 64, "temperature": 0},
    )
    assert r.done_reason == "stop"
    jsonschema.validate(json.loads(r.message.content), SCHEMA)
    g = client.generate(
        model=tag, prompt="A person as JSON:", format=SCHEMA, options={"num_predict": 64, "temperature": 0}
    )
    jsonschema.validate(json.loads(g.response), SCHEMA)
    # "json": any object (num_predict may cut it, so only its start is certain)
    j = client.generate(model=tag, prompt="A JSON object:", format="json", options={"num_predict": 8, "temperature": 0})
    assert j.response.lstrip().startswith("{")


# Ollama has no tool_choice, and the default model does not call tools on its own: the module's server parses
# llama3_json calls (a bare {"name", "parameters"} object), and `format` forces the output into that shape, so the
# parsed call and its Ollama spelling (arguments an object, not a JSON string) are what is tested.
CALL_FORMAT = {
    "type": "object",
    "properties": {"name": {"const": "get_weather"}, "parameters": WEATHER},
    "required": ["name", "parameters"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_arguments_are_an_object(client, tag, stream):
    history = [
        {"role": "user", "content": "What is the weather in Rome?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Rome"}}}],
        },
        {"role": "tool", "content": "Sunny, 24 C", "tool_name": "get_weather"},
        {"role": "user", "content": "And in Paris?"},
    ]
    options = {"num_predict": 48, "temperature": 0}
    if stream:
        chunks = list(
            client.chat(model=tag, messages=history, tools=TOOLS, format=CALL_FORMAT, options=options, stream=True)
        )
        calls = [c for chunk in chunks for c in chunk.message.tool_calls or ()]
        assert chunks[-1].done_reason == "stop"
    else:
        r = client.chat(model=tag, messages=history, tools=TOOLS, format=CALL_FORMAT, options=options)
        calls = list(r.message.tool_calls or ())
        assert r.done_reason == "stop" and not r.message.content
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert isinstance(calls[0].function.arguments, dict)
    jsonschema.validate(dict(calls[0].function.arguments), WEATHER)


def test_models(client, tag):
    listed = client.list().models
    assert tag.endswith(":latest") and listed[0].size > 0 and len(listed[0].digest) == 64
    assert listed[0].details.quantization_level and listed[0].details.family
    shown = client.show(tag)
    assert shown.modelinfo and shown.details.format and "completion" in shown.capabilities
    assert client.show(tag.removesuffix(":latest")).details == shown.details
    running = client.ps().models
    assert running[0].model == tag and running[0].context_length > 0
    with pytest.raises(ollama.ResponseError) as err:
        client.show("no-such-model")
    assert err.value.status_code == 404


def test_refusals(client, tag, srv):
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model=tag, messages=[{"role": "user", "content": "hi", "images": [b"\x89PNG"]}])
    assert err.value.status_code == 400 and "not a JPEG, PNG or WebP image" in err.value.error
    for opts in ({"mirostat": 2}, {"tfs_z": 0.5}, {"no_such_option": 1}):
        with pytest.raises(ollama.ResponseError) as err:
            client.chat(model=tag, messages=ASK, options=opts)
        assert err.value.status_code == 400, opts
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="no-such-model", messages=ASK)
    assert err.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model=tag, messages=ASK, think=True)  # the default model has no reasoning parser
    assert err.value.status_code == 400
    # a prompt over the context: a 400 before the stream starts, streamed or not
    for stream in (False, True):
        with pytest.raises(ollama.ResponseError) as err:
            reply = client.chat(model=tag, messages=[{"role": "user", "content": "hi " * 9000}], stream=stream)
            list(reply) if stream else None
        assert err.value.status_code == 400 and "max length" in err.value.error
    # harmless runtime options are accepted (and typical_p reaches the sampler)
    r = client.chat(
        model=tag,
        messages=ASK,
        options={
            **PREDICT,
            "num_thread": 2,
            "use_mmap": True,
            "num_ctx": 99999,
            "typical_p": 0.9,
            "temperature": 0.7,
            "seed": 5,
        },
    )
    assert r.done
    # a bound of the OpenAI side holds here too: too many stop strings
    r2 = requests.post(
        srv.base + "/api/chat", json={"model": tag, "messages": ASK, "options": {"stop": ["x"] * 1000}}, timeout=30
    )
    assert r2.status_code == 400 and set(r2.json()) == {"error"}


def test_version_and_routes_not_served(srv, client, tag):
    assert requests.get(srv.base + "/api/version", timeout=30).json()["version"]
    for method, path in (("POST", "/api/create"), ("POST", "/api/push"), ("GET", "/api/chat")):
        r = requests.request(method, srv.base + path, json={"model": tag}, timeout=30)
        assert r.status_code == 404 and isinstance(r.json()["error"], str), (method, path)
    with pytest.raises(ollama.ResponseError) as err:
        client.delete(tag)  # served from a folder no pull made: refused, never deleted (tests/pull/test_pull.py)
    assert err.value.status_code == 400


def test_langchain(srv, tag):
    from langchain_ollama import ChatOllama
    from pydantic import BaseModel, Field

    llm = ChatOllama(base_url=srv.base, model=tag, num_predict=32, temperature=0)
    assert llm.invoke("Say hi.").content

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int

    person = (
        ChatOllama(base_url=srv.base, model=tag, num_predict=64, temperature=0)
        .with_structured_output(Person, method="json_schema")
        .invoke("Name a person and their age.")
    )
    assert isinstance(person, Person)


def test_bodies_without_a_json_content_type(srv, tag):
    """Ollama reads the body as JSON whatever its Content-Type: none (litellm's `ollama/` and `ollama_chat/`
    providers), a form type (Ollama's documented `curl ... -d '{...}'`), unary and streamed; a body that is not JSON
    is a 400 in Ollama's shape."""
    body = {"model": tag, "prompt": "The capital of France is", "options": PREDICT, "stream": False}
    for content_type in (None, "application/x-www-form-urlencoded"):
        headers = {"Content-Type": content_type} if content_type else {}
        r = requests.post(srv.base + "/api/generate", data=json.dumps(body), headers=headers, timeout=120)
        assert r.status_code == 200 and r.json()["done"] and r.json()["response"], (content_type, r.text)
        chat = {"model": tag, "messages": ASK, "options": PREDICT}  # streamed: Ollama's default
        r = requests.post(srv.base + "/api/chat", data=json.dumps(chat), headers=headers, timeout=120)
        lines = [json.loads(line) for line in r.text.splitlines()]
        assert r.status_code == 200 and lines[-1]["done"] and "".join(x["message"]["content"] for x in lines)
    r = requests.post(srv.base + "/api/chat", data="model=x", timeout=30)
    assert r.status_code == 400 and r.json() == {"error": "Request body is not valid JSON"}


@pytest.mark.usefixtures("loopback_only")
def test_litellm_ollama_providers(srv, tag):
    """litellm's `ollama/` (generate) and `ollama_chat/` (chat) providers post without a Content-Type."""
    import litellm

    for provider in ("ollama", "ollama_chat"):
        for stream in (False, True):
            r = litellm.completion(
                model=f"{provider}/{tag}",
                api_base=srv.base,
                messages=ASK,
                max_tokens=16,
                temperature=0,
                stream=stream,
            )
            text = "".join(c.choices[0].delta.content or "" for c in r) if stream else r.choices[0].message.content
            assert text, (provider, stream)
