"""Load on demand, unload when idle, against a real `appliance serve` (appliance/server/residency.py decides, the
supervisor acts): three models from a config file (the tiny llama export under two names, and a copy of it) with a
memory budget that holds one of them.

What must hold: alternating requests on every API load and unload the models and all succeed (readiness stays
ready, /api/ps and /v1/config say which one is loaded, the metrics count the loads); concurrent requests for an
unloaded model share one load; a model with streams in flight is never unloaded (the other model's request waits
for them); keep_alive 0 unloads after the request, a duration expires, -1 keeps; a load that fails fails its own
requests only; Ollama's num_ctx drops a chat's oldest messages, caps the output, and refuses a raw prompt over it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import pytest
import requests

from appliance.config import EngineConfig
from appliance.server.residency import estimate
from appliance.testing.loopback import ROOT, LoopbackServer
from tests.helpers import START_TIMEOUT, Server, wait_until

KV_TOKENS = 1024
NAMES = ("alpha", "beta")


class BudgetServer(Server):
    """`appliance serve --config FILE --models-memory-budget N`."""

    def __init__(self, config: Path, log_path: Path, budget: int):
        def command(port: int) -> list[str]:
            return [
                *(sys.executable, "-m", "appliance.cli", "serve", "--config", str(config)),
                *("--port", str(port), "--models-memory-budget", str(budget)),
            ]

        env = {**os.environ, "PYTHONPATH": str(ROOT), "APPLIANCE_WORKERS": "1", "APPLIANCE_THREADS": "16"}
        LoopbackServer.__init__(self, command, log_path, env=env, start_timeout=START_TIMEOUT)


@pytest.fixture(scope="module")
def srv(exported, tmp_path_factory):
    export = exported("llama", "openvino", "fp32")[0]
    folder = tmp_path_factory.mktemp("ondemand")
    gamma = folder / "gamma-export"
    shutil.copytree(export, gamma)
    models = {"alpha": export, "beta": export, "gamma": gamma}
    entries = [{"config": {"name": n, "base_path": str(p), "kv_cache_tokens": KV_TOKENS}} for n, p in models.items()]
    (folder / "config.json").write_text(json.dumps({"model_config_list": entries}))
    one = estimate(export, EngineConfig(kv_cache_tokens=KV_TOKENS))
    with BudgetServer(folder / "config.json", folder / "serve.log", budget=int(one * 1.5)) as server:
        server.gamma = gamma  # type: ignore[attr-defined]
        yield server


def loaded(srv: Server) -> list[str]:
    return [m["name"].removesuffix(":latest") for m in requests.get(srv.base + "/api/ps", timeout=30).json()["models"]]


def demand_loads(srv: Server) -> float:
    return srv.metrics().get('appliance_model_loads_total{reason="demand",result="ok"}', 0.0)


def ollama(srv: Server, path: str, body: dict, timeout: float = 120) -> requests.Response:
    return requests.post(srv.base + path, json={"stream": False, **body}, timeout=timeout)


def chat(srv: Server, model: str, max_tokens: int = 3) -> requests.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens}
    return requests.post(srv.base + "/v3/chat/completions", json=body, timeout=120)


def test_alternating_requests_load_and_unload_each_other_and_all_succeed(srv):
    before = demand_loads(srv)
    for i in range(6):
        model = NAMES[i % 2]
        api = i % 3
        if api == 0:
            r = chat(srv, model)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        elif api == 1:
            r = ollama(srv, "/api/chat", {"model": model, "messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 200 and r.json()["done"] is True, r.text
            if i > 0:  # the other model was loaded: this one waited for its load, and says so
                assert r.json()["load_duration"] > 0 and r.json()["total_duration"] >= r.json()["load_duration"]
        else:
            body = {"model": model, "prompt": "The", "max_tokens": 3}
            r = requests.post(srv.base + "/v3/completions", json=body, timeout=120)
            assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
        assert loaded(srv) == [model]  # the budget holds one: the other was unloaded
        assert requests.get(srv.base + "/v2/health/ready", timeout=30).status_code == 200  # unloaded is ready
        config = requests.get(srv.base + "/v1/config", timeout=30).json()
        assert {n: e["loaded"] for n, e in config.items()} == {n: n == model for n in ("alpha", "beta", "gamma")}
        assert {e["model_version_status"][0]["state"] for e in config.values()} == {"AVAILABLE"}
    assert demand_loads(srv) - before >= 5
    assert srv.metrics()['appliance_model_unloads_total{reason="budget"}'] >= 5
    tokens = requests.post(srv.base + "/v3/tokenize", json={"model": "alpha", "prompt": "Hello"}, timeout=30)
    assert tokens.status_code == 200 and tokens.json()["tokens"] and loaded(srv) == ["beta"]  # no load for that


def test_concurrent_requests_for_an_unloaded_model_share_one_load(srv):
    assert chat(srv, "alpha").status_code == 200
    assert loaded(srv) == ["alpha"]
    before = demand_loads(srv)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: chat(srv, "beta"), range(4)))
    assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
    assert demand_loads(srv) - before == 1
    assert loaded(srv) == ["beta"]


def test_a_model_with_streams_in_flight_is_not_unloaded(srv):
    assert chat(srv, "alpha").status_code == 200
    ended: list[float] = []
    outs: list[dict] = []
    started = threading.Barrier(3)

    def stream() -> None:
        body = {"model": "alpha", "prompt": "The", "max_tokens": 300, "ignore_eos": True, "stream": True}
        out: dict = {"events": []}
        outs.append(out)
        with requests.post(srv.base + "/v3/completions", json=body, stream=True, timeout=300) as r:
            out["status"] = r.status_code
            for line in r.iter_lines(decode_unicode=True):
                if line.startswith("data: "):
                    if not out["events"]:
                        started.wait(60)
                    out["events"].append(line[6:])
        ended.append(time.monotonic())

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait(60)  # both streams under way
    r = chat(srv, "beta")  # needs alpha's room: waits for the streams (or a 503 after --models-load-wait)
    answered = time.monotonic()
    for t in threads:
        t.join(300)
    for out in outs:  # every token of both streams: alpha was not unloaded under them
        assert out["status"] == 200 and out["events"][-1] == "[DONE]", out["events"][-3:]
        assert json.loads(out["events"][-2])["choices"][0]["finish_reason"] == "length"
        tokens = sum(len(json.loads(e)["choices"][0]["text"]) > 0 for e in out["events"][:-1])
        assert tokens >= 250, tokens
    if r.status_code == 503:
        assert r.json()["error"]["code"] == "models_memory_busy", r.text
    else:
        assert r.status_code == 200, r.text
        assert answered >= max(ended) - 0.5  # beta loaded only once alpha's streams had ended
        assert loaded(srv) == ["beta"]


def expires(srv: Server, model: str) -> str:
    models = requests.get(srv.base + "/api/ps", timeout=30).json()["models"]
    return next(m["expires_at"] for m in models if m["model"] == model)


def test_keep_alive_zero_unloads_a_duration_expires_and_negative_keeps(srv):
    gen = {"model": "alpha", "prompt": "Hi", "options": {"num_predict": 2}}
    r = ollama(srv, "/api/generate", {**gen, "keep_alive": 0})
    assert r.status_code == 200 and r.json()["done"], r.text
    wait_until(lambda: "alpha" not in loaded(srv), "alpha to unload after its keep_alive 0 request", timeout=60)

    r = ollama(srv, "/api/generate", {**gen, "keep_alive": "3s"})
    assert r.status_code == 200, r.text
    assert "alpha" in loaded(srv)
    at = datetime.fromisoformat(expires(srv, "alpha:latest").replace("Z", "+00:00")).timestamp()
    assert time.time() < at < time.time() + 4
    wait_until(lambda: "alpha" not in loaded(srv), "alpha to unload 3 s after its request", timeout=60)

    r = ollama(srv, "/api/generate", {**gen, "keep_alive": -1})
    assert r.status_code == 200, r.text
    time.sleep(4)
    assert "alpha" in loaded(srv) and expires(srv, "alpha:latest").startswith("9999")

    # a request with nothing to say: keep_alive 0 unloads without generating, anything else loads
    r = ollama(srv, "/api/generate", {"model": "alpha", "keep_alive": 0})
    assert r.json()["done_reason"] == "unload" and "alpha" not in loaded(srv), r.text
    r = ollama(srv, "/api/chat", {"model": "beta", "messages": [], "keep_alive": "5m"})
    assert r.json()["done_reason"] == "load" and loaded(srv) == ["beta"], r.text
    r = ollama(srv, "/api/chat", {"model": "beta", "keep_alive": "5 minutes"})
    assert r.status_code == 400 and "keep_alive" in r.json()["error"], r.text


def test_a_failed_load_fails_its_requests_alone(srv):
    gamma: Path = srv.gamma
    saved = {p: p.read_bytes() for p in gamma.rglob("*.xml")}
    try:
        for xml in saved:
            xml.write_text("<net>")  # OpenVINO cannot read it: gamma's next load fails
        assert chat(srv, "alpha").status_code == 200
        r = chat(srv, "gamma")
        assert r.status_code == 500 and "failed to load" in r.json()["error"]["message"], r.text
        assert chat(srv, "alpha").status_code == 200 and chat(srv, "beta").status_code == 200
        config = requests.get(srv.base + "/v1/config", timeout=30).json()["gamma"]
        assert config["loaded"] is False
        assert "load on demand failed" in config["model_version_status"][0]["status"]["error_message"]
        assert requests.get(srv.base + "/v2/health/ready", timeout=30).status_code == 200
    finally:
        for xml, data in saved.items():
            xml.write_bytes(data)
    assert chat(srv, "gamma").status_code == 200  # the next request tries again


def test_num_ctx_drops_old_messages_caps_the_output_and_refuses_a_raw_prompt_over_it(srv):
    history = []
    for i in range(3):
        history += [
            {"role": "user", "content": f"Question {i}: tell me about the appliance and its many models."},
            {"role": "assistant", "content": f"Answer {i}: it serves them one at a time on this box."},
        ]
    messages = [{"role": "system", "content": "Be brief."}, *history, {"role": "user", "content": "Hi"}]
    full = ollama(srv, "/api/chat", {"model": "alpha", "messages": messages, "options": {"num_predict": 1}})
    assert full.status_code == 200, full.text
    whole = full.json()["prompt_eval_count"]
    window = whole // 2
    r = ollama(
        srv,
        "/api/chat",
        {"model": "alpha", "messages": messages, "options": {"num_ctx": window, "num_predict": 10000}},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prompt_eval_count"] < window < whole  # old messages dropped to fit
    assert 0 < body["eval_count"] <= window - body["prompt_eval_count"]  # the output capped to the window
    assert body["done_reason"] == "length"

    raw = {"model": "alpha", "prompt": "word " * (window + 20), "raw": True, "options": {"num_ctx": window}}
    r = ollama(srv, "/api/generate", raw)
    assert r.status_code == 400 and "num_ctx" in r.json()["error"], r.text
