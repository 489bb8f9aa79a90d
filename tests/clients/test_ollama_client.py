"""ollama (Ollama's own Python client) against the real server's Ollama API (/api) on its default settings: chat and
generate unary and streamed (the chunks add up to the unary answer, stop strings left out), `format=` a nested
model's schema, a tool round trip, `embed` and the legacy `embeddings`; and Ollama's documented curl call, a JSON
body sent without a JSON Content-Type (as litellm's Ollama providers send theirs too).

tests/ollama_api/test_ollama_e2e.py covers the rest in depth (model listing, logprobs, refusals, tool calls as objects)
on a
server of its own."""

from __future__ import annotations

import json

import pytest
import requests

from .matrix import (
    JSON_TOKENS,
    PERSON_PROMPT,
    TEXT_PROMPT,
    TEXT_TOKENS,
    TIMEOUT,
    WEATHER_PROMPT,
    Person,
    calling,
    cut_at_stop,
    get_weather,
    need,
    settled,
    stop_in,
)

ollama = need("ollama")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("loopback_only")]  # conftest.py

LIBRARY = "ollama"
OPTIONS = {"num_predict": TEXT_TOKENS, "temperature": 0}
ASK = [{"role": "user", "content": TEXT_PROMPT}]


@pytest.fixture(scope="module")
def client(base):
    return ollama.Client(host=base, timeout=TIMEOUT)


def test_chat_unary_streamed_and_stopped(client, ollama_tag):
    with calling(LIBRARY, "chat(model, messages), chat(..., stream=True)"):
        unary = settled(lambda: client.chat(model=ollama_tag, messages=ASK, options=OPTIONS))
        assert unary.done and unary.message.content and unary.prompt_eval_count > 0 and unary.eval_count > 0
        chunks = list(client.chat(model=ollama_tag, messages=ASK, options=OPTIONS, stream=True))
        assert "".join(c.message.content or "" for c in chunks) == unary.message.content
        assert chunks[-1].done and chunks[-1].eval_count == unary.eval_count
    with calling(LIBRARY, "chat(..., options={'stop': [...]}, stream=True)"):
        stop = stop_in(unary.message.content)
        stopped = {**OPTIONS, "stop": [stop]}
        chunks = list(client.chat(model=ollama_tag, messages=ASK, options=stopped, stream=True))
        text = "".join(c.message.content or "" for c in chunks)
        assert text == cut_at_stop(unary.message.content, stop) and chunks[-1].done_reason == "stop", (text, stop)


def test_generate_unary_and_streamed(client, ollama_tag):
    with calling(LIBRARY, "generate(model, prompt), generate(..., stream=True)"):
        unary = settled(lambda: client.generate(model=ollama_tag, prompt="The sea is", options=OPTIONS))
        assert unary.done and unary.response
        streamed = list(client.generate(model=ollama_tag, prompt="The sea is", options=OPTIONS, stream=True))
        assert "".join(c.response for c in streamed) == unary.response


def test_format_nested_model(client, ollama_tag):
    with calling(LIBRARY, "chat(..., format=Person.model_json_schema())"):
        r = client.chat(
            model=ollama_tag,
            messages=[{"role": "user", "content": PERSON_PROMPT}],
            format=Person.model_json_schema(),
            options={"num_predict": JSON_TOKENS, "temperature": 0},
        )
        Person.model_validate_json(r.message.content)


def test_tool_round_trip(client, ollama_tag):
    """A Python function the client turns into a tool. Ollama's API has no tool_choice: a prose answer is the
    model's choice; a call that comes must carry its arguments as an object, and its result goes back."""
    options = {"num_predict": JSON_TOKENS, "temperature": 0}
    question = {"role": "user", "content": WEATHER_PROMPT}
    with calling(LIBRARY, "chat(..., tools=[get_weather])"):
        r = client.chat(model=ollama_tag, messages=[question], tools=[get_weather], options=options)
        calls = r.message.tool_calls or []
        assert calls or r.message.content, r
        for call in calls:
            assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict), call
    if not calls:
        return
    with calling(LIBRARY, "chat(messages=[..., assistant tool_calls, {'role': 'tool', ...}])"):
        result = {"role": "tool", "content": get_weather(**calls[0].function.arguments), "tool_name": "get_weather"}
        follow = client.chat(model=ollama_tag, messages=[question, r.message, result], options=options)
        assert follow.done and follow.prompt_eval_count > r.prompt_eval_count, follow


def test_embed(client, embedding_model):
    with calling(LIBRARY, "embed(model, input=[...]), embeddings(model, prompt)"):
        r = client.embed(model=embedding_model, input=["The sea is wide.", "Paris is in France."])
        assert len(r.embeddings) == 2 and len(r.embeddings[0]) == len(r.embeddings[1]) > 0
        legacy = client.embeddings(model=embedding_model, prompt="The sea is wide.")
        assert len(legacy.embedding) == len(r.embeddings[0])


@pytest.mark.parametrize("path", ["/api/generate", "/api/chat"])
def test_json_body_without_its_content_type(base, ollama_tag, path):
    """Ollama's README: `curl http://localhost:11434/api/generate -d '{...}'`, which curl sends as a form; Ollama
    reads the body as JSON whatever the header says. A body that is not JSON is a 400 in Ollama's error shape."""
    body = {"model": ollama_tag, "stream": False, "options": {"num_predict": 4}}
    body.update({"prompt": "Hi"} if path.endswith("generate") else {"messages": [{"role": "user", "content": "Hi"}]})
    with calling("Ollama's curl example", f"POST {path} -d '{{...}}' (form Content-Type, then none)"):
        for headers in ({"Content-Type": "application/x-www-form-urlencoded"}, {}):
            r = requests.post(base + path, data=json.dumps(body).encode(), headers=headers, timeout=TIMEOUT)
            assert r.status_code == 200 and r.json()["done"], (headers, r.status_code, r.text)
        bad = requests.post(base + path, data=b"model=x", headers={}, timeout=TIMEOUT)
        assert bad.status_code == 400 and isinstance(bad.json()["error"], str), (bad.status_code, bad.text)
