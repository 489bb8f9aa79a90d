"""appliance/ollama_api/requests.py and wire.py alone (no server): an Ollama body becomes the OpenAI request it
means (options mapped, runtime options ignored, output-changing unknown ones refused, chat's bounds kept), and the
Ollama routes answer 401 in Ollama's error shape before any engine is asked."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from appliance.limits import Limits
from appliance.ollama_api.requests import parse_ollama_chat, parse_ollama_generate
from appliance.ollama_api.wire import Render
from appliance.openai_api.errors import ApiError

MSG = [{"role": "user", "content": "hi"}]


def chat(**body):
    return parse_ollama_chat({"model": "m", "messages": MSG, **body}, Limits())


def refused(fn, body: dict, fragment: str) -> None:
    with pytest.raises(ApiError) as err:
        fn(body, Limits())
    assert err.value.status == 400 and fragment in err.value.message


def test_options_map_onto_sampling():
    req = chat(
        options={
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 7,
            "min_p": 0.1,
            "seed": 3,
            "stop": ["x"],
            "repeat_penalty": 1.2,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.25,
            "num_predict": 5,
            "num_ctx": 4096,
            "num_thread": 4,
            "use_mmap": False,
            "typical_p": 0.9,
            "mirostat": 0,
        }
    )
    assert req.stream and req.chat is not None
    s = req.chat.sampling
    assert s["temperature"] == 0.5 and s["top_p"] == 0.9 and s["top_k"] == 7 and s["min_p"] == 0.1
    assert s["seed"] == 3 and s["stop"] == ("x",) and s["repetition_penalty"] == 1.2
    assert s["presence_penalty"] == 0.5 and s["frequency_penalty"] == 0.25 and s["max_tokens"] == 5
    assert s["typical_p"] == 0.9
    assert s["include_stop_str_in_output"] is False  # Ollama leaves the stop string out, streamed or not


@pytest.mark.parametrize("value", [-1, -2, 0])
def test_num_predict_unbounded_values_leave_max_tokens_unset(value):
    assert "max_tokens" not in chat(options={"num_predict": value}).chat.sampling


def test_off_spellings():
    s = chat(options={"top_k": 0, "seed": -1}).chat.sampling
    assert s["top_k"] == -1 and "seed" not in s


@pytest.mark.parametrize(
    "options, fragment",
    [
        ({"mirostat": 2}, "mirostat"),
        ({"tfs_z": 0.5}, "tfs_z"),
        ({"repeat_last_n": 64}, "repeat_last_n"),
        ({"no_such": 1}, "no_such"),
        ({"num_ctx": 0}, "num_ctx"),
        ({"num_predict": -3}, "num_predict"),
        ({"temperature": -1}, "temperature"),  # chat's own bound, through the translated body
        ({"num_predict": 10**12}, "max_tokens"),
        ({"stop": ["s"] * 10_000}, "stop"),
    ],
)
def test_refused_options(options, fragment):
    refused(parse_ollama_chat, {"model": "m", "messages": MSG, "options": options}, fragment)


def test_typical_p_is_typical_sampling():
    assert chat(options={"typical_p": 0.5}).chat.sampling["typical_p"] == 0.5
    refused(parse_ollama_chat, {"model": "m", "messages": MSG, "options": {"typical_p": 0}}, "typical_p")


def test_refused_fields():
    refused(
        parse_ollama_chat, {"model": "m", "messages": [{"role": "user", "content": "x", "images": ["AA=="]}]}, "images"
    )
    refused(parse_ollama_generate, {"model": "m", "prompt": "x", "images": ["AA=="]}, "images")
    refused(parse_ollama_generate, {"model": "m", "prompt": "x", "suffix": "y"}, "suffix")
    refused(parse_ollama_generate, {"model": "m", "prompt": "x", "context": [1, 2]}, "context")
    refused(parse_ollama_generate, {"model": "m", "prompt": "x", "template": "{{ .System }} {{ .Prompt }}"}, "template")
    refused(parse_ollama_chat, {"model": "m", "messages": MSG, "format": "yaml"}, "format")
    refused(parse_ollama_generate, {"model": "m", "prompt": "x", "raw": True, "logprobs": True}, "logprobs")
    refused(parse_ollama_chat, {"messages": MSG}, "model is required")
    refused(parse_ollama_generate, {"model": "", "prompt": "x"}, "model is required")
    refused(parse_ollama_chat, {"model": "m", "messages": MSG, "think": "max"}, "think")
    refused(parse_ollama_chat, {"model": "m", "messages": MSG * 100_000}, "messages")  # chat's bound


def test_format_and_generate_paths():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert chat(format=schema).chat.sampling["grammar"].kind == "json_schema"
    assert chat(format="json").chat.sampling["grammar"] is not None
    g = parse_ollama_generate({"model": "m", "prompt": "p", "system": "s", "stream": False}, Limits())
    assert not g.stream and g.chat is not None and [m["role"] for m in g.chat.messages] == ["system", "user"]
    raw = parse_ollama_generate({"model": "m", "prompt": "p", "raw": True}, Limits())
    assert raw.completion is not None and raw.completion.prompts == ("p",)
    assert parse_ollama_generate({"model": "m"}, Limits()).load_only
    assert parse_ollama_chat({"model": "m", "messages": []}, Limits()).load_only


def test_tool_history_is_translated():
    history = [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "1", "tool_name": "f"},
    ]
    req = chat(messages=history)
    assert req.chat.messages[0]["tool_calls"] == [
        {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    ]
    assert req.chat.messages[1]["name"] == "f"


def test_streamed_tool_call_is_one_object_call():
    r = Render("m:latest", chat=True)
    named = {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": ""}}]}}
    assert r.fragment(named) is None  # held until its arguments come
    args = {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}}
    line = r.fragment(args)
    assert line["message"]["tool_calls"] == [{"function": {"name": "f", "arguments": {"a": 1}}}]
    assert line["done"] is False and line["model"] == "m:latest"
    thought = {"index": 0, "delta": {"reasoning_content": "hm"}}
    assert r.fragment(thought)["message"]["thinking"] == "hm"
    assert Render("m", chat=True, keep_thinking=False).fragment(thought) is None


@pytest.mark.parametrize(
    "finish, done_reason", [("stop", "stop"), ("length", "length"), ("tool_calls", "stop"), (None, "stop")]
)
def test_the_last_line_spells_each_finish_as_ollama_does(finish, done_reason):
    """The `done: true` line: Ollama's clients read `done_reason` ("length" tells them the answer was cut; a tool
    call ends with "stop" as Ollama's own server says) and its counts and durations in nanoseconds."""
    gen = SimpleNamespace(
        choices=[SimpleNamespace(finish_reason=finish)],
        accepted=SimpleNamespace(load_seconds=0.5),
        usage=lambda: {"prompt_tokens": 3, "completion_tokens": 5},
        time_info=lambda: {"total_time": 1.5, "prompt_time": 0.25, "completion_time": 1.0},
    )
    last = Render("m", chat=True).final(gen)
    assert last["done"] is True and last["done_reason"] == done_reason
    assert (last["prompt_eval_count"], last["eval_count"]) == (3, 5)
    assert (last["total_duration"], last["load_duration"]) == (1_500_000_000, 500_000_000)
    assert (last["prompt_eval_duration"], last["eval_duration"]) == (250_000_000, 1_000_000_000)
    assert last["message"] == {"role": "assistant", "content": ""}


def test_routes_need_the_key(tmp_path):
    from appliance.openai_api.app import create_app
    from appliance.settings import ServeSettings

    keys = tmp_path / "keys"
    keys.write_text("secret-key-0123456789\n")
    settings = ServeSettings(model_dir="m", served_model_name="m", model_created=0, api_key_file=str(keys))

    class NoEngine:  # a 401 is answered before any engine call; only the HTTP record is sent
        def record_http(self, record) -> None:
            pass

    app = create_app(settings, client=NoEngine())  # type: ignore[arg-type]
    with app.test_client() as c:
        r = c.post("/api/chat", json={"model": "m", "messages": MSG})
        assert r.status_code == 401 and set(r.get_json()) == {"error"} and isinstance(r.get_json()["error"], str)
        assert c.get("/api/tags").status_code == 401


def test_bodies_are_json_whatever_the_content_type():
    """Ollama reads the body as JSON whatever its Content-Type (litellm's Ollama providers send none, `curl -d` a
    form type): such a body reaches the adapter (here its 404 for an unknown model); a body that is not JSON is a
    400 in Ollama's shape; a web page's form post is refused. The OpenAI routes keep their 415."""
    from tests.api.test_api_validation import MODEL, StubEngine, edge

    client = edge(StubEngine())
    body = json.dumps({"model": "nope", "messages": MSG, "prompt": "Hi", "input": "Hi"})
    for content_type in (None, "application/x-www-form-urlencoded", "text/plain"):
        for path in ("/api/chat", "/api/generate", "/api/show", "/api/embed"):
            r = client.post(path, data=body, content_type=content_type)
            assert (r.status_code, r.get_json()) == (404, {"error": "model 'nope' not found"}), (path, content_type)
        r = client.post("/api/chat", data="model=m", content_type=content_type)
        assert (r.status_code, r.get_json()) == (400, {"error": "Request body is not valid JSON"})
        r = client.post("/api/chat", data=body, content_type=content_type, headers={"Origin": "https://example.com"})
        assert r.status_code == 403 and set(r.get_json()) == {"error"}
    r = client.post("/api/chat", data=body, content_type="application/json", headers={"Origin": "http://localhost"})
    assert r.status_code == 404  # a page's JSON request (it needed a CORS preflight) is an API client's
    chat = json.dumps({"model": MODEL, "messages": MSG})
    assert client.post("/v1/chat/completions", data=chat).status_code == 415
    assert client.post("/v1/messages", data=chat, content_type="text/plain").status_code == 415


def test_an_error_mid_stream_is_the_last_line(monkeypatch):
    """Once the stream started, a failure (here the engine's, after one fragment) is one last `{"error"}` line, which
    Ollama's clients raise; no `done: true` line claims success."""
    import json

    from appliance.ollama_api.wire import OllamaGeneration

    def deltas(self):
        yield {"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}
        raise ApiError(500, "generation failed: boom")

    monkeypatch.setattr(OllamaGeneration, "deltas", deltas)
    gen = OllamaGeneration.__new__(OllamaGeneration)  # no engine: only ndjson()'s framing is under test
    gen._stream = None
    lines = [json.loads(x) for x in gen.ndjson(Render("m", chat=True))]
    assert lines[0]["message"]["content"] == "Hel" and lines[0]["done"] is False
    assert lines[-1] == {"error": "generation failed: boom"} and len(lines) == 2


def test_keep_alive_and_num_ctx_reach_the_request():
    from appliance.keep_alive import FOREVER

    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    req = parse_ollama_chat({**base, "keep_alive": "5m", "options": {"num_ctx": 256}}, Limits())
    assert (req.keep_alive, req.num_ctx) == (300.0, 256)
    assert parse_ollama_chat({**base, "keep_alive": -1}, Limits()).keep_alive == FOREVER
    assert parse_ollama_chat(base, Limits()).keep_alive is None
    load = parse_ollama_generate({"model": "m", "keep_alive": 0}, Limits())
    assert load.load_only and load.keep_alive == 0
    for bad in ({"keep_alive": "soon"}, {"keep_alive": True}, {"options": {"num_ctx": -3}}):
        with pytest.raises(ApiError):
            parse_ollama_chat({**base, **bad}, Limits())
