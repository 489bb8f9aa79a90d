"""End to end: `appliance serve` as a subprocess (real gunicorn on loopback, the engine process, the default
model), driven with the official `openai` client and raw `requests`. Expected outputs are never written down:
each test derives them from another request (unary vs streaming, tokenize vs usage, text vs stop strings),
made with the engine otherwise idle. The server runs in the default precision, whose numerics differ by CPU
and by batch: runs that share the engine (concurrent streams) are compared up to a near-tie only.

Two servers: `server` (2 workers, open) for the API, and `guarded` (4 workers, API key, one sequence slot,
queue of one) for auth, 429s, the shared-model memory check and a graceful SIGTERM with a stream in flight.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import openai
import pytest
import requests

from appliance.manifest import Manifest
from appliance.settings import ServeSettings
from appliance.testing.procinfo import children, is_zombie
from tests.helpers import NEAR_TIE_DEFAULT, Server, greedy_divergence, rss_mb, wait_idle, wait_until

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


# ---------------------------------------------------------------- fixtures (`server`, `model_dir`, `model_name`
# and the `Server` harness are in conftest.py and helpers.py, shared with test_fuzz.py and test_docs_examples.py)


@pytest.fixture(scope="session")
def api_key() -> str:
    return "e2e-" + os.urandom(8).hex()


@pytest.fixture(scope="session")
def guarded_servers(model_dir, api_key, tmp_path_factory):
    """The guarded server, started on first use and again after a test stopped it (the graceful SIGTERM test
    does), so that no test depends on running before that one."""
    key_file = tmp_path_factory.mktemp("auth") / "key"
    key_file.write_text(api_key + "\n")
    started: list[Server] = []

    def running() -> Server:
        if not started or started[-1].proc.poll() is not None:
            srv = Server(
                model_dir,
                tmp_path_factory.mktemp("guarded") / "serve.log",
                "--workers",
                "4",
                "--api-key-file",
                str(key_file),
                "--max-num-seqs",
                "1",
                "--max-queued",
                "1",
                "--graceful-timeout",
                "120",
            )
            started.append(srv.__enter__())
        return started[-1]

    yield running
    for srv in started:
        srv.close()  # a clean stop if still running (the SIGTERM test stopped and checked its own)


@pytest.fixture
def guarded(guarded_servers) -> Server:
    return guarded_servers()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v3", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(autouse=True)
def alone_on_the_shared_server(request) -> None:
    """Tests here compare greedy runs made one after the other (unary vs streaming, echo vs plain, by text vs by
    ids): each must have the engine to itself, or numerics may differ with the batch (helpers.greedy_divergence).
    Another file's test may have left work running on the session's server."""
    if "server" in request.fixturenames:
        wait_idle(request.getfixturevalue("server"))


def complete(client, model_name, **kw):
    return client.completions.create(model=model_name, **{"prompt": PROMPT, "max_tokens": 8, **kw})


# ---------------------------------------------------------------- completions


def test_startup_answers_503_until_ready(server):
    """Whatever the readiness probe saw before 200 was the OpenAI-style 503 (how many depends on load time)."""
    assert server.startup_answers, "the readiness probe recorded no answer"
    if len(server.startup_answers) == 1:  # the model was ready before a worker first answered: nothing to check
        pytest.skip("the probe's first answer was already 200 (a stub engine's 503 is test_api_validation's)")
    for r in server.startup_answers[:-1]:
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "model_not_ready"
    assert server.startup_answers[-1].status_code == 200


def test_unary_completion(client, model_name, server):
    r = complete(client, model_name)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == model_name
    assert r.system_fingerprint
    choice = r.choices[0]
    assert choice.index == 0 and choice.finish_reason in ("stop", "length") and choice.logprobs is None
    assert choice.text
    tokens = requests.post(server.base + "/v3/tokenize", json={"model": model_name, "prompt": PROMPT}).json()
    assert r.usage.prompt_tokens == len(tokens["tokens"])
    assert r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    info = r.model_extra["time_info"]
    assert set(info) == {"queue_time", "prompt_time", "completion_time", "total_time", "created"}
    assert info["total_time"] >= info["completion_time"] >= 0 and info["created"] > 0


def test_streaming_equals_unary_greedy(client, model_name):
    unary = complete(client, model_name, max_tokens=12)
    chunks = list(complete(client, model_name, max_tokens=12, stream=True))
    assert {c.id for c in chunks} == {chunks[0].id} and {c.created for c in chunks} == {chunks[0].created}
    assert all(c.object == "text_completion" for c in chunks)
    assert chunks[0].choices[0].text == "" and chunks[0].choices[0].finish_reason is None  # after prefill
    reasons = [c.choices[0].finish_reason for c in chunks]
    assert reasons[-1] == unary.choices[0].finish_reason and not any(reasons[:-1])
    assert "".join(c.choices[0].text for c in chunks) == unary.choices[0].text


def test_raw_sse_framing(server, model_name):
    r = requests.post(
        server.base + "/v3/completions",
        stream=True,
        json={
            "model": model_name,
            "prompt": PROMPT,
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("text/event-stream")
    assert r.headers["Cache-Control"] == "no-cache"
    body = r.content.decode()
    assert body.endswith("data: [DONE]\n\n")
    parts = [part for part in body.split("\n\n") if part]
    assert all(part.startswith("data: ") for part in parts)
    *chunks, usage = [json.loads(part[len("data: ") :]) for part in parts[:-1]]
    assert all("usage" in c and c["usage"] is None for c in chunks)  # present and null, as OVMS
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 1


def test_include_usage_chunk(client, model_name):
    chunks = list(complete(client, model_name, max_tokens=6, stream=True, stream_options={"include_usage": True}))
    *content, last = chunks
    assert all(c.usage is None and len(c.choices) == 1 for c in content)
    assert last.choices == [] and last.usage is not None
    unary = complete(client, model_name, max_tokens=6)
    assert last.usage.prompt_tokens == unary.usage.prompt_tokens
    assert last.usage.completion_tokens == unary.usage.completion_tokens
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


def test_stop_string_never_leaks(client, model_name):
    full = complete(client, model_name, max_tokens=24).choices[0].text
    words = [w for w in full.split() if len(w) >= 3 and full.find(w) > 0]
    assert words, f"no usable stop word in {full!r}"
    stop = words[len(words) // 2]
    cut = full[: full.find(stop)]

    unary = complete(client, model_name, max_tokens=24, stop=[stop])
    assert unary.choices[0].text == cut and unary.choices[0].finish_reason == "stop"
    assert stop not in unary.choices[0].text

    pieces = [c.choices[0].text for c in complete(client, model_name, max_tokens=24, stop=stop, stream=True)]
    assert not any(stop in "".join(pieces[:i]) for i in range(len(pieces)))  # nothing before the last chunk
    assert "".join(pieces) == cut + stop  # streaming includes the stop string by default (OVMS)


def test_echo(client, model_name):
    plain = complete(client, model_name, max_tokens=5)
    echoed = complete(client, model_name, max_tokens=5, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens
    only_prompt = complete(client, model_name, max_tokens=0, echo=True)
    assert only_prompt.choices[0].text == PROMPT and only_prompt.choices[0].finish_reason == "length"
    assert only_prompt.usage.completion_tokens == 0
    streamed = "".join(c.choices[0].text for c in complete(client, model_name, max_tokens=5, echo=True, stream=True))
    assert streamed == echoed.choices[0].text


def test_logprobs_unary_and_streaming(client, model_name):
    r = complete(client, model_name, max_tokens=6, logprobs=3)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the most likely token
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    if r.choices[0].finish_reason == "length":
        assert "".join(lp.tokens) == r.choices[0].text

    chunks = list(complete(client, model_name, max_tokens=6, logprobs=3, stream=True))
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_prompt_forms_and_n(client, model_name, server):
    ids = requests.post(server.base + "/v3/tokenize", json={"model": model_name, "prompt": PROMPT}).json()["tokens"]
    by_text = complete(client, model_name)
    by_ids = complete(client, model_name, prompt=ids)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = complete(client, model_name, prompt=[PROMPT, ids], max_tokens=4)
    assert [c.index for c in batch.choices] == [0, 1]
    two = complete(client, model_name, n=2, temperature=0.8, seed=7, max_tokens=6)
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in two.choices)
    assert two.usage.prompt_tokens == by_text.usage.prompt_tokens
    assert 2 <= two.usage.completion_tokens <= 12


# ---------------------------------------------------------------- chat


def test_chat_unary_and_streaming(client, model_name):
    # The chat prompt (the default system prompt and CHAT) is longer than a KV block, so a run after a first one
    # starts from the prefix cache, and a cold and a warm prefill may part at a near-tie. A first run fills the
    # cache whatever ran before: the two runs compared then start alike (their cached_tokens say so).
    client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=1)
    r = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=10)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    *chunks, last = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=10, stream=True, stream_options={"include_usage": True}
    )
    assert last.choices == [] and last.usage.prompt_tokens == r.usage.prompt_tokens
    assert last.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens_details.cached_tokens
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content is None and first.finish_reason is None
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert not any(c.choices[0].finish_reason for c in chunks[:-1])


def test_chat_logprobs(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=4, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.bytes == list(entry.token.encode()) and len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)


# ---------------------------------------------------------------- models, health, config, metrics, tokenize


def test_models_health_config(server, client, model_name):
    assert [m.id for m in client.models.list().data] == [model_name]
    assert client.models.retrieve(model_name).owned_by == "OVMS"
    v1 = requests.get(server.base + "/v1/models").json()
    assert v1["object"] == "list" and v1["data"][0]["id"] == model_name
    assert requests.get(server.base + "/v2/health/live").status_code == 200
    assert requests.get(server.base + "/v2/health/ready").status_code == 200
    assert requests.get(f"{server.base}/v2/models/{model_name}/ready").status_code == 200
    config = requests.get(server.base + "/v1/config").json()
    assert set(config) == {model_name} and config[model_name]["model_version_status"] == [
        {"version": "1", "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": "OK"}}
    ]


def test_tokenize(server, model_name):
    one = requests.post(server.base + "/v3/tokenize", json={"model": model_name, "prompt": "Hello world"}).json()
    many = requests.post(server.base + "/v3/tokenize", json={"model": model_name, "prompt": ["Hello world", "Hi"]})
    assert one["tokens"] and all(isinstance(t, int) for t in one["tokens"])
    assert many.json()["tokens"][0] == one["tokens"] and len(many.json()["tokens"]) == 2


def test_metrics_count_requests_and_tokens(server, client, model_name):
    before = server.metrics()
    r = complete(client, model_name, max_tokens=5)
    after = server.metrics()
    key = 'appliance_http_requests_total{method="POST",route="/v3/completions",status="200"}'
    assert after[key] == before.get(key, 0) + 1
    assert (
        after["appliance_generation_tokens_total"] - before["appliance_generation_tokens_total"]
        == r.usage.completion_tokens
    )
    assert after["appliance_prompt_tokens_total"] - before["appliance_prompt_tokens_total"] == r.usage.prompt_tokens
    ttft = "appliance_time_to_first_token_seconds_count"
    assert after[ttft] == before[ttft] + 1
    assert after["appliance_ready"] == 1 and after["appliance_running_sequences"] == 0
    assert after["appliance_kv_cache_blocks_total"] > 0 and after["appliance_queue_depth"] == 0


# ---------------------------------------------------------------- errors


def error(r: requests.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text
    return body["error"]


def test_validation_errors_are_400_json_even_for_streams(server, model_name):
    url = server.base + "/v3/completions"
    e = error(requests.post(url, json={"model": model_name, "prompt": "x", "temperature": 3, "stream": True}), 400)
    assert e["message"] == "temperature out of range(0.0, 2.0)" and e["param"] == "temperature"
    e = error(requests.post(url, json={"model": model_name, "prompt": "x", "best_of": 2, "stream": True}), 400)
    assert e["message"] == "best_of cannot be used in streaming mode" and e["param"] == "best_of"
    e = error(requests.post(url, json={"model": model_name, "prompt": "x", "max_tokens": 0}), 400)
    assert e["message"] == "max_tokens value should be greater than 0 unless echo is set"
    # chat: max_completion_tokens wins over max_tokens, but both are checked (found by tests/e2e/test_fuzz.py)
    e = error(
        requests.post(
            server.base + "/v3/chat/completions",
            json={"model": model_name, "messages": CHAT, "max_tokens": 0, "max_completion_tokens": 4},
        ),
        400,
    )
    assert (e["message"], e["param"]) == ("max_tokens value should be greater than 0", "max_tokens")


def test_prompt_over_context_is_400_with_counts(server, model_name, model_dir):
    prompt_tokens = len(
        requests.post(server.base + "/v3/tokenize", json={"model": model_name, "prompt": PROMPT}).json()["tokens"]
    )
    too_many = Manifest.load(model_dir).max_context
    e = error(
        requests.post(
            server.base + "/v3/completions", json={"model": model_name, "prompt": PROMPT, "max_tokens": too_many}
        ),
        400,
    )
    assert e["message"].startswith(
        f"Number of prompt tokens: {prompt_tokens} + max tokens value: {too_many} exceeds model max length: "
    )
    limit = int(e["message"].rsplit(" ", 1)[1])
    assert limit < prompt_tokens + too_many


def test_http_error_statuses(server, model_name):
    base = server.base
    e = error(requests.post(base + "/v3/completions", json={"model": "no-such-model", "prompt": "x"}), 404)
    assert e["code"] == "model_not_found" and e["param"] == "model"
    error(requests.get(base + "/v3/models/no-such-model"), 404)
    error(requests.get(base + "/v3/nowhere"), 404)
    assert (
        error(requests.get(base + "/v3/completions"), 405)
        and requests.get(base + "/v3/completions").headers["Allow"] == "OPTIONS, POST"
    )  # RFC 9110
    error(
        requests.post(
            base + "/v3/completions",
            data=json.dumps({"model": model_name, "prompt": "x"}),
            headers={"Content-Type": "text/plain"},
        ),
        415,
    )
    error(requests.post(base + "/v3/completions", data=b"{not json", headers={"Content-Type": "application/json"}), 400)
    huge = json.dumps({"model": model_name, "prompt": "x" * ServeSettings.max_body_bytes})  # past --max-body-bytes
    error(requests.post(base + "/v3/completions", data=huge, headers={"Content-Type": "application/json"}), 413)
    e = error(requests.post(base + "/v3/chat/completions", json={"model": model_name, "messages": []}), 400)
    assert e["message"] == "messages array is empty"


def test_huge_token_ids_are_400_and_the_engine_survives(server, client, model_name):
    """Found by tests/e2e/test_fuzz.py: a logit_bias key past int64 used to reach the engine thread, whose numpy
    conversion raised and killed it: every later request then hung. Token ids are now bounded at the edge."""
    before = complete(client, model_name, max_tokens=4).choices[0].text
    url = server.base + "/v3/completions"
    for field, value, message in (
        ("logit_bias", {str(2**64): 1}, "logit_bias keys must be token ids"),
        ("logit_bias", {"4294967296": 1}, "logit_bias keys must be token ids"),
        ("logit_bias", {"\u0661": 1}, "logit_bias keys must be token ids"),  # an Arabic-Indic digit one
        ("stop_token_ids", [2**63], "stop_token_ids is not an array of token ids"),
    ):
        e = error(
            requests.post(url, json={"model": model_name, "prompt": PROMPT, "max_tokens": 2, field: value}, timeout=60),
            400,
        )  # (the engine's death made it hang)
        assert (e["message"], e["param"]) == (message, field)
    ok = complete(client, model_name, max_tokens=4, logit_bias={"4294967295": 5})
    assert ok.choices[0].text == before  # ids past the vocabulary change nothing
    assert complete(client, model_name, max_tokens=4).choices[0].text == before


def test_openai_client_sees_typed_errors(client, model_name):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="x", max_tokens=1, top_p=3)
    assert info.value.body["message"] == "top_p out of range(0.0, 1.0)"


# ---------------------------------------------------------------- cancellation and concurrency


def test_disconnect_mid_stream_frees_the_sequence(server, model_name):
    before = server.metrics()
    r = requests.post(
        server.base + "/v3/completions",
        stream=True,
        timeout=120,
        json={"model": model_name, "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "stream": True},
    )
    lines = r.iter_lines()
    received = [line for line in (next(lines) for _ in range(6)) if line]
    assert len(received) == 3
    assert server.metrics()["appliance_running_sequences"] == 1
    r.close()  # the client goes away
    cancelled = before.get("appliance_sequences_cancelled_total", 0)
    # the slot is freed on the engine thread, the cancel counted as its last chunk passes the pump thread: wait for both
    after = wait_until(
        lambda: (m := server.metrics())["appliance_running_sequences"] == 0
        and m.get("appliance_sequences_cancelled_total", 0) > cancelled
        and m,
        "the sequence to be freed",
    )
    assert after["appliance_sequences_cancelled_total"] == cancelled + 1
    assert after["appliance_kv_cache_blocks_used"] == 0
    generated = after["appliance_generation_tokens_total"] - before["appliance_generation_tokens_total"]
    assert generated < 4000


CONCURRENT_PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "The best way to learn to code is",
    "Water boils at",
    "My favourite animal is the",
    "The three primary colours are",
    "In 1969, astronauts",
    "A good breakfast includes",
]


def test_concurrent_streaming_clients(server, model_name, client):
    """32 streams at once (8 distinct prompts, 4 clients each), each a client of its own: every stream is complete
    and well formed, and its tokens are the greedy answer to its own prompt computed alone first, up to a near-tie.

    Batched greedy is not solo greedy token for token in the default precision (bf16 on AVX-512-bf16 CPUs, f32
    with u8 KV on AVX2-only ones): a stream may part from the solo answer only where the solo run's top two
    candidates are within NEAR_TIE_DEFAULT nats (helpers.greedy_divergence); its text is compared up to there.
    A stream given another prompt's tokens, a lost or repeated chunk, a mixed-up usage still fails."""
    max_tokens, top = 16, 5
    body = dict(max_tokens=max_tokens, logprobs=top, extra_body={"ignore_eos": True})  # always max_tokens tokens
    expected = {p: complete(client, model_name, prompt=p, **body) for p in CONCURRENT_PROMPTS}
    assert len({r.choices[0].text for r in expected.values()}) == len(CONCURRENT_PROMPTS)  # tells mix-ups apart
    prompts = [CONCURRENT_PROMPTS[i % len(CONCURRENT_PROMPTS)] for i in range(32)]
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        try:
            c = openai.OpenAI(base_url=server.base + "/v3", api_key="unused", max_retries=0, timeout=300)
            start.wait(timeout=60)
            results[i] = list(
                c.completions.create(
                    model=model_name, prompt=prompts[i], stream=True, stream_options={"include_usage": True}, **body
                )
            )
        except BaseException as exc:  # reported below, with the thread's index
            errors.append((i, exc))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors and not any(t.is_alive() for t in threads), errors
    assert len({chunks[0].id for chunks in results.values()}) == len(prompts)
    parted = []
    for i, chunks in results.items():
        *content, usage = chunks
        assert content[0].choices[0].text == ""
        assert not any(c.choices[0].finish_reason for c in content[:-1])
        assert content[-1].choices[0].finish_reason == "length"
        unary = expected[prompts[i]]
        assert usage.choices == [] and usage.usage.model_dump() == unary.usage.model_dump()
        assert usage.usage.completion_tokens == max_tokens
        tokens = [t for c in content if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        text = "".join(c.choices[0].text for c in content)
        want = unary.choices[0].logprobs
        at = greedy_divergence(want.tokens, want.top_logprobs, tokens, NEAR_TIE_DEFAULT, f"stream {i} {prompts[i]!r}")
        if at == max_tokens:
            assert text == unary.choices[0].text, (i, prompts[i])
        else:  # the same text up to the token where it parted
            assert text.startswith(unary.choices[0].text[: want.text_offset[at]]), (i, prompts[i])
            parted.append((prompts[i], at))
    print(f"\nstreams that parted from the solo answer at a near-tie (prompt, token): {parted}")
    m = wait_until(lambda: (m := server.metrics())["appliance_running_sequences"] == 0 and m, "all streams to end")
    assert m["appliance_kv_cache_blocks_used"] == 0 and m["appliance_queue_depth"] == 0


# ---------------------------------------------------------------- the guarded server (4 workers, key, 1 slot)


def auth(api_key: str) -> dict:
    return {"Authorization": f"Bearer {api_key}"}


def test_api_key(guarded, api_key, model_name):
    url = guarded.base + "/v3/completions"
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 2}
    assert error(requests.post(url, json=body), 401)["code"] == "invalid_api_key"
    error(requests.post(url, json=body, headers=auth("wrong")), 401)
    error(requests.get(guarded.base + "/metrics"), 401)
    raw = requests.post(url, json={**body, "temperature": 0}, headers=auth(api_key))
    assert raw.status_code == 200, raw.text
    assert requests.get(guarded.base + "/v2/health/ready").status_code == 200  # probes need no key
    keyed = openai.OpenAI(base_url=guarded.base + "/v3", api_key=api_key, max_retries=0, timeout=120)
    sdk = keyed.completions.create(model=model_name, prompt=PROMPT, max_tokens=2, temperature=0)
    # the SDK's keyed call is the same greedy request (one slot: each runs alone, so the numerics are the same)
    assert (sdk.choices[0].text, sdk.usage.completion_tokens) == (
        raw.json()["choices"][0]["text"],
        raw.json()["usage"]["completion_tokens"],
    )
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.base + "/v3", api_key="unused", max_retries=0).models.list()


def _blocker(guarded, api_key, model_name) -> requests.Response:
    """Takes the only sequence slot: streaming, long, and running once its first chunk arrived."""
    r = requests.post(
        guarded.base + "/v3/completions",
        stream=True,
        headers=auth(api_key),
        timeout=120,
        json={"model": model_name, "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "stream": True},
    )
    assert r.status_code == 200
    r.lines = r.iter_lines()  # keep the iterator: dropping it lets urllib3 close the connection (= client gone)
    next(r.lines)
    return r


def test_429_queue_full_and_timeout(guarded, api_key, model_name):
    url = guarded.base + "/v3/completions"
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 2}
    full = 'appliance_requests_rejected_total{reason="queue_full"}'
    before = guarded.metrics(auth(api_key)).get(full, 0)  # other tests on this server may have filled the queue
    blocker = _blocker(guarded, api_key, model_name)
    queued = threading.Thread(
        target=requests.post, args=(url,), kwargs={"headers": auth(api_key), "json": body, "timeout": 120}
    )
    try:
        # the slot is taken: a request waits in the queue until its timeout ends it
        e = error(requests.post(url, headers=auth(api_key), json={**body, "timeout": 0.5, "stream": True}), 429)
        assert e["code"] == "timeout" and e["param"] == "timeout"
        wait_until(lambda: guarded.metrics(auth(api_key))["appliance_queue_depth"] == 0, "the timed-out one to go")
        # one request waits in the queue (max-queued 1): the next is refused whole by the engine
        queued.start()
        wait_until(lambda: guarded.metrics(auth(api_key))["appliance_queue_depth"] == 1, "one to wait in the queue")
        e = error(requests.post(url, headers=auth(api_key), json=body), 429)
        assert e["code"] == "queue_full"
        keyed = openai.OpenAI(base_url=guarded.base + "/v3", api_key=api_key, max_retries=0, timeout=120)
        with pytest.raises(openai.RateLimitError):
            keyed.completions.create(model=model_name, prompt=PROMPT, max_tokens=2)
        # n=2 can never fit a queue of 1: a 400 at the edge (a 429 would invite retries in vain)
        e = error(requests.post(url, headers=auth(api_key), json={**body, "n": 2}), 400)
        assert e["param"] == "n"
    finally:
        blocker.close()
        queued.join(timeout=120)
    wait_until(lambda: guarded.metrics(auth(api_key))["appliance_running_sequences"] == 0, "the slot to free up")
    m = guarded.metrics(auth(api_key))
    assert m["appliance_queue_depth"] == 0 and m[full] - before == 2


def test_four_workers_share_one_model(guarded, api_key, model_name):
    """One copy of the weights: the workers are thin translators, the engine process holds the model."""
    threads = [
        threading.Thread(
            target=requests.post,
            args=(guarded.base + "/v3/completions",),
            kwargs={
                "json": {"model": model_name, "prompt": PROMPT, "max_tokens": 2},
                "headers": auth(api_key),
                "timeout": 120,
            },
        )
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine = guarded.proc.pid
    arbiters = children(engine)
    assert len(arbiters) == 1
    workers = wait_until(lambda: len(w := children(arbiters[0])) == 4 and w, "4 gunicorn workers")
    engine_rss = rss_mb(engine)
    for pid in workers:
        assert "libopenvino" not in Path(f"/proc/{pid}/maps").read_text()
        assert rss_mb(pid) < engine_rss / 8, (rss_mb(pid), engine_rss)
    assert sum(rss_mb(pid) for pid in workers) < engine_rss / 2


def test_graceful_sigterm_finishes_inflight_stream(guarded, api_key, model_name):
    """SIGTERM on the guarded server while a stream is in flight: it ends normally, then a clean exit (a test
    that needs the guarded server after this one gets a new one)."""
    r = requests.post(
        guarded.base + "/v3/completions",
        stream=True,
        headers=auth(api_key),
        timeout=300,
        json={"model": model_name, "prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, "stream": True},
    )
    lines = r.iter_lines(decode_unicode=True)
    first = next(line for line in lines if line)
    assert first.startswith("data: ")
    tree = guarded.process_tree()
    guarded.proc.send_signal(signal.SIGTERM)
    rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: ") :])["choices"][0]["finish_reason"] == "length"
    assert guarded.stop(signalled=True) == 0
    assert not [p for p in tree if Path(f"/proc/{p}").exists() and not is_zombie(p)]
