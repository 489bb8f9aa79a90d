"""The benchmarks' streaming HTTP client: one SSE reader (`sse_events`), one streaming completion (`stream_one`)
and c clients started together (`http_run`), shared by bench.http (our server), bench.llamacpp (llama.cpp's
server, the same clock for both) and bench.memory. Its own module so neither server's bench imports the other's.

Raw `requests` + json, one thread and one connection per client: light, since the clients share the 2 CPUs with
the server they measure."""

from __future__ import annotations

import json
import threading
import time

from bench.common import cpu_seconds, median, percentile


def sse_events(url: str, body: dict, session=None, timeout: float = 600):
    """POST `body` as a streaming request; yields (arrival time (perf_counter), parsed event) for each `data:`
    event before "[DONE]". A non-200 answer comes out as one {"error": "HTTP <code>: ..."} event."""
    import requests

    with (session or requests).post(url, json=body, stream=True, timeout=timeout) as r:
        if r.status_code != 200:
            yield time.perf_counter(), {"error": f"HTTP {r.status_code}: {r.text[:200]}"}
            return
        for line in r.iter_lines():
            if not line.startswith(b"data: "):
                continue
            now = time.perf_counter()
            payload = line[6:]
            if payload == b"[DONE]":
                break
            yield now, json.loads(payload)


def stream_one(base: str, model: str, prompt_ids: list[int], new_tokens: int, session=None) -> dict:
    """One streaming completion; returns event timestamps (perf_counter) and the usage's completion tokens."""
    body = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": new_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    times, tokens, text_events, error = [], None, 0, None
    for now, event in sse_events(base + "/v3/completions", body, session):
        if "error" in event:
            error = str(event["error"])
            continue
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        if event.get("choices"):
            times.append(now)
            if event["choices"][0].get("text"):
                text_events += 1
    return {"times": times, "tokens": tokens or 0, "text_events": text_events, "error": error}


def http_run(base: str, model: str, batch: list, new_tokens: int, server_pid: int | None = None, stream=None) -> dict:
    """c = len(batch) clients start together (a barrier); one thread and one connection each, streaming from our
    server (stream_one), or calling `stream(prompt, session)` if given. With server_pid, also the CPU seconds per
    generated token of the server's processes and of this (client) process."""
    import requests

    stream = stream or (lambda prompt, session: stream_one(base, model, prompt, new_tokens, session))
    results: list[dict] = [{} for _ in batch]  # each client thread fills its own
    sessions = [requests.Session() for _ in batch]
    barrier = threading.Barrier(len(batch) + 1)

    def client(i: int) -> None:
        barrier.wait()
        try:
            results[i] = stream(batch[i], sessions[i])
        except Exception as exc:  # reported below with the others
            results[i] = {"times": [], "tokens": 0, "text_events": 0, "error": repr(exc)}

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(batch))]
    for t in threads:
        t.start()
    cpu0 = cpu_seconds(server_pid) if server_pid else {}
    client0 = time.process_time()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    client_cpu = time.process_time() - client0
    cpu1 = cpu_seconds(server_pid) if server_pid else {}
    for s in sessions:
        s.close()
    errors = [r["error"] for r in results if r["error"]]
    if errors or any(r["tokens"] != new_tokens for r in results):
        raise RuntimeError(f"HTTP run failed: tokens {[r['tokens'] for r in results]}, errors {errors[:3]}")
    silent = [i for i, r in enumerate(results) if not r["times"]]
    if silent:  # usage counted the tokens, yet no event carried a choice: nothing to time
        raise RuntimeError(
            f"HTTP run failed: request(s) {silent} of {len(results)} streamed no choice event "
            f"(usage: {[results[i]['tokens'] for i in silent]} tokens)"
        )
    end = max(r["times"][-1] for r in results)
    gaps = [b - a for r in results for a, b in zip(r["times"][1:], r["times"][2:])]  # after the opening event
    return {
        "tok_s": sum(r["tokens"] for r in results) / (end - t0),
        "ttft_s": median(r["times"][0] - t0 for r in results),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
        "events_per_token": sum(len(r["times"]) - 1 for r in results) / sum(r["tokens"] for r in results),
        "wall_s": end - t0,
        "itl_gaps": len(gaps),
        **_cpu_per_token(cpu0, cpu1, client_cpu, results),
    }


def _cpu_per_token(cpu0: dict, cpu1: dict, client_cpu: float, results: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in results)
    out = {"client_cpu_ms_per_token": client_cpu * 1e3 / tokens}
    for role in cpu1:
        out[f"{role}_cpu_ms_per_token"] = (cpu1[role] - cpu0.get(role, 0.0)) * 1e3 / tokens
    return out
