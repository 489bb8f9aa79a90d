"""docs/api-examples.md is executed: its fenced ```bash and ```python blocks run against the session's real server
(conftest.py's `server`), with only `http://localhost:8000` replaced by that server's address, and what they print
is checked. The examples are: a unary completion (curl), the same completion streamed with include_usage (curl),
a chat with the official `openai` client (Python), structured output through the SDK's `parse` with a pydantic
model (Python), a named tool call (Python) and predicted outputs (Python); the README shows the first three.
Outputs are compared between requests made one at a time on an otherwise idle server (greedy in the default
precision depends on the batch, see helpers.greedy_divergence)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import requests

from tests.helpers import wait_idle

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "api-examples.md"
DOC_BASE = "http://localhost:8000"
NAMES = ("unary", "stream", "chat", "parse", "tool", "prediction")
KINDS = ["bash", "bash", "python", "python", "python", "python"]
FENCE = re.compile(r"^```(bash|python)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32}  # as "chat"


def blocks() -> list[tuple[str, str]]:
    return FENCE.findall(EXAMPLES.read_text())


@pytest.fixture(scope="module")
def examples(server, model_name, tmp_path_factory) -> dict[str, str]:
    """Each example's output, by name, run with the server's address in place of the documented one. curl reads
    a .curlrc (from $CURL_HOME) that appends the HTTP status as a last line, so its command runs as written."""
    found = blocks()
    assert [kind for kind, _ in found] == [*KINDS, "python"], found  # the last one, retrieval: `rag` below
    curl_home = tmp_path_factory.mktemp("curl")
    (curl_home / ".curlrc").write_text('write-out = "\\nHTTP %{http_code}\\n"\n')
    env = {**os.environ, "CURL_HOME": str(curl_home)}
    out = {}
    wait_idle(server)  # each example then runs alone (they run one after the other)
    # The chat example's prompt (the default system prompt and its question) is longer than a KV block: run once
    # here, it is in the prefix cache for the example and for test_python_openai_chat's request alike, whatever
    # ran before (a cold and a warm prefill may part at a near-tie, so both must start from the same cache).
    warm = requests.post(
        server.base + "/v3/chat/completions", timeout=120, json={"model": model_name, **CHAT, "max_tokens": 1}
    )
    assert warm.status_code == 200, warm.text
    for name, (kind, code) in zip(NAMES, found):
        assert DOC_BASE in code and f'"{model_name}"' in code, code  # the documented address and served model
        code = code.replace(DOC_BASE, server.base)
        cmd = ["bash", "-e", "-c", code] if kind == "bash" else [sys.executable, "-c", code]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path_factory.mktemp(name)
        )
        assert proc.returncode == 0, (name, proc.stdout, proc.stderr)
        out[name] = proc.stdout
    return out


def status_and_body(output: str) -> tuple[str, str]:
    body, _, status = output.rstrip("\n").rpartition("\n")
    return status, body


def test_the_examples_are_the_documented_ones():
    kinds = [kind for kind, _ in blocks()]
    assert kinds == [*KINDS, "python"]
    unary, stream, chat, parse, tool, prediction, rag = (code for _, code in blocks())
    assert "embeddings.create" in rag and "/v3/rerank" in rag and "chat.completions.create" in rag
    assert "/v3/completions" in unary and '"stream"' not in unary
    assert '"stream": true' in stream and '"include_usage": true' in stream
    assert "chat.completions.create" in chat
    assert "chat.completions.parse" in parse and "response_format=City" in parse
    assert "tool_choice=" in tool and "tool_calls[0]" in tool
    assert "prediction=" in prediction and "completion_tokens_details" in prediction


def test_readme_shows_exactly_the_first_three_tested_examples():
    readme = FENCE.findall((ROOT / "README.md").read_text())
    assert [b for b in readme if "localhost:8000" in b[1]] == blocks()[:3]


def test_curl_unary_completion(examples, model_name):
    status, body = status_and_body(examples["unary"])
    assert status == "HTTP 200"
    answer = json.loads(body)
    assert answer["object"] == "text_completion" and answer["model"] == model_name
    choice = answer["choices"][0]
    assert choice["text"].strip() and choice["finish_reason"] in ("stop", "length")
    usage = answer["usage"]
    assert 1 <= usage["completion_tokens"] <= 16
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_curl_streaming_with_usage(examples):
    status, body = status_and_body(examples["stream"])
    assert status == "HTTP 200"
    lines = [line for line in body.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    *chunks, usage = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 for c in chunks)
    assert all("usage" in c and c["usage"] is None for c in chunks)
    assert chunks[0]["choices"][0]["text"] == ""  # sent once the prompt is processed
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[-1] in ("stop", "length") and not any(reasons[:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 1
    # the stream spells out the unary example's answer (same request, greedy)
    unary = json.loads(status_and_body(examples["unary"])[1])
    assert "".join(c["choices"][0]["text"] for c in chunks) == unary["choices"][0]["text"]
    assert usage["usage"] == unary["usage"]


def test_python_openai_chat(examples, server, model_name):
    printed = examples["chat"]
    assert printed.strip()
    # what it printed is the server's answer to that request (greedy, alone in the engine, from the same prefix
    # cache state as the example's run, see `examples`: the same every time)
    wait_idle(server)
    same = requests.post(server.base + "/v3/chat/completions", timeout=120, json={"model": model_name, **CHAT}).json()
    assert printed == same["choices"][0]["message"]["content"] + "\n"


def test_python_structured_output(examples):
    """The pydantic model came back parsed: the printed JSON has exactly its two string fields."""
    city = json.loads(examples["parse"])
    assert set(city) == {"name", "country"} and all(isinstance(v, str) for v in city.values())


def test_python_named_tool_call(examples):
    """A call of the named tool whose arguments are JSON that follows its parameters schema."""
    name, _, arguments = examples["tool"].strip().partition(" ")
    assert name == "get_weather"
    args = json.loads(arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 40


def test_python_predicted_outputs(examples, server, model_name):
    """The prediction drafted tokens the model kept, and the answer is the one without a prediction (greedy, alone
    in the engine; the default precision may part at a near-tie, which text_divergence allows)."""
    from tests.helpers import NEAR_TIE_DEFAULT
    from tests.openai_api.test_speculation_api import text_divergence

    counts, _, text = examples["prediction"].partition("\n")
    accepted, rejected = map(int, counts.split())
    assert accepted > 0 and rejected >= 0
    wait_idle(server)
    code = "def area(width, height):\n    return width * height\n"
    client = openai.OpenAI(base_url=server.base + "/v3", api_key="unused", max_retries=0, timeout=120)
    reference = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Rename the function area to rectangle_area:\n\n" + code}],
        max_tokens=64,
        logprobs=True,
        top_logprobs=5,
    )
    text_divergence(reference.choices[0].logprobs.content, text.removesuffix("\n"), NEAR_TIE_DEFAULT)


@pytest.fixture(scope="module")
def rag(model_dir, model_name, embedding_export, tmp_path_factory) -> str:
    """The retrieval example's output, run against a server of the chat model, the default embedding model and a
    tiny random cross-encoder named `reranker` (the shared server serves the chat model alone)."""
    from tests.openai_api.test_embeddings import EMBED, config_server, tiny_rerank_export

    root = tmp_path_factory.mktemp("rag")
    models = {
        model_name: model_dir,
        EMBED: embedding_export("int8"),
        "reranker": tiny_rerank_export(root, "reranker"),
    }
    code = blocks()[len(KINDS)][1]
    assert DOC_BASE in code and f'"{model_name}"' in code and f'"{EMBED}"' in code, code
    with config_server(root, models, workers=1) as srv:
        proc = subprocess.run(
            [sys.executable, "-c", code.replace(DOC_BASE, srv.base)], capture_output=True, text=True, timeout=300
        )
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    return proc.stdout


def test_python_retrieval_embed_rerank_answer(rag):
    """The embedding model found the passage that answers (all-MiniLM-L6-v2 is a real model), the reranker's top
    two of the three candidates made the context (a random one: any two), and the chat model answered."""
    nearest, context, answer = rag.split("\n", 2)
    assert nearest == "nearest: The server listens on port 8000 and answers the OpenAI API under /v3."
    passages = context.removeprefix("context: ").split(" | ")
    assert len(passages) == 2 and len(set(passages)) == 2
    assert answer.startswith("answer: ") and answer.removeprefix("answer: ").strip()
