"""Tool calls through the real app and engine service (helpers.py `in_process_api`, the default model's int4
export): model output nested past Python's recursion limit is an ordinary answer, and tools whose schemas are over
the grammar size limit are a 400 naming `tools`.

The deep output is forced with a regex response_format beside tool_choice "auto", as a client (or injected text)
could steer it: `<tool_call>` then 1,100 `[` and 1,100 `]` (550 tokens each; the same text as the request's
prediction, so speculative decoding makes it in a few dozen steps). The hermes parser (the default model's) reads it
as a call's JSON, which the stdlib decoder cannot nest that deep.
"""

from __future__ import annotations

import json
import os

import pytest

from appliance.config import EngineConfig
from appliance.limits import Limits
from appliance.runtime.engine import Engine
from tests.helpers import in_process_api

os.environ.setdefault("HF_HUB_OFFLINE", "1")
DEPTH = 1100  # past the recursion limit (1000)
DEEP = "<tool_call>" + "[" * DEPTH + "]" * DEPTH + "</tool_call>"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from export.default_model import ensure_export

    engine = Engine(ensure_export("openvino", "int4"), EngineConfig())
    try:
        with in_process_api(engine, tmp_path_factory.mktemp("rt")) as client:
            yield client
    finally:
        engine.shutdown()


def _deep_request(stream: bool) -> dict:
    regex = f"<tool_call>\\[{{{DEPTH}}}\\]{{{DEPTH}}}</tool_call>"
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "Brackets, please."}],
        "tools": [TOOL],
        "response_format": {"type": "regex", "schema": regex},
        "max_tokens": 2 * DEPTH,
        "prediction": {"type": "content", "content": DEEP},  # drafts: many tokens per step, a fast test
        "num_assistant_tokens": 32,
        "temperature": 0,
        "stream": stream,
    }


def test_deep_output_is_content_unary(client):
    r = client.post("/v3/chat/completions", json=_deep_request(False))
    assert r.status_code == 200, r.get_data(as_text=True)[:500]
    choice = r.get_json()["choices"][0]
    assert choice["message"]["content"] == DEEP and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


def test_deep_output_is_content_streamed(client):
    r = client.post("/v3/chat/completions", json=_deep_request(True))
    assert r.status_code == 200
    events = [line[6:] for line in r.get_data(as_text=True).splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c]
    deltas = [c["choices"][0] for c in chunks if c.get("choices")]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == DEEP
    assert deltas[-1]["finish_reason"] == "stop"


def test_tools_over_the_grammar_limit_are_a_400_naming_tools(client):
    """tool_choice required compiles the tools' schemas: over grammar_chars together, as a response_format's
    schema over it is refused; the same tools with tool_choice auto (no grammar) pass validation."""
    limit = Limits().grammar_chars
    props = {f"p{i}": {"type": "string", "description": "d" * 100} for i in range(limit // 200)}
    tools = [
        {"type": "function", "function": {"name": f"t{k}", "parameters": {"type": "object", "properties": props}}}
        for k in range(3)
    ]
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools, "max_tokens": 1}
    r = client.post("/v3/chat/completions", json={**body, "tool_choice": "required"})
    assert r.status_code == 400, r.get_data(as_text=True)[:500]
    error = r.get_json()["error"]
    assert error["param"] == "tools" and f"longer than {limit}" in error["message"]
    assert error["type"] == "invalid_request_error"
