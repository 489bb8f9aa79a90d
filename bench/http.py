"""The concurrency sweep through the real server: `appliance serve` on loopback, streaming clients reading SSE,
compared with our engine in this process at the same concurrency, in the same run (alternating which goes
first), on the same model and engine settings.

At each concurrency c, c clients POST /v3/completions at once (random token-id prompts, `ignore_eos`,
`stream: true`, `stream_options.include_usage` for the token count). Aggregate tok/s = completion tokens /
(last event - start); TTFT = start -> first SSE event (the server sends it when the first token exists);
inter-token latency = gaps between consecutive content events of a stream (p50 / p99 over all streams; an
event can carry more than one token when the detokenizer holds back part of a character, so the event/token
count is reported too). The clients are raw `requests` + json (light: they share the 2 CPUs with the server).

    python -m bench.http [--model default-fp16] [--workers 1] [--concurrency 1 4 8 16] [--reps 3]
                         [--prompt-len 128] [--new-tokens 128] [--quick]
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

from tqdm import tqdm

from bench.common import (CONCURRENCY, LOGS, RESULTS, ServerProcess, args_dict, cpu_seconds, machine, median,
                          model_dir, paired_ratio, percentile, print_table, prompts, ratio, write_json)


def stream_one(base: str, model: str, prompt_ids: list[int], new_tokens: int, session=None) -> dict:
    """One streaming completion; returns event timestamps (perf_counter) and the usage's completion tokens."""
    import requests

    body = {"model": model, "prompt": prompt_ids, "max_tokens": new_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}
    http = session or requests
    times, tokens, text_events, error = [], None, 0, None
    with http.post(base + "/v3/completions", json=body, stream=True, timeout=600) as r:
        if r.status_code != 200:
            return {"times": [], "tokens": 0, "text_events": 0, "error": f"HTTP {r.status_code}: {r.text[:200]}"}
        for line in r.iter_lines():
            if not line.startswith(b"data: "):
                continue
            now = time.perf_counter()
            payload = line[6:]
            if payload == b"[DONE]":
                break
            event = json.loads(payload)
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


def http_run(base: str, model: str, batch: list[list[int]], new_tokens: int, server_pid: int | None = None) -> dict:
    """c = len(batch) clients start together (a barrier); one thread and one connection each. With server_pid,
    also the CPU seconds per generated token of the server's processes and of this (client) process."""
    import requests

    results: list[dict | None] = [None] * len(batch)
    sessions = [requests.Session() for _ in batch]
    barrier = threading.Barrier(len(batch) + 1)

    def client(i: int) -> None:
        barrier.wait()
        try:
            results[i] = stream_one(base, model, batch[i], new_tokens, sessions[i])
        except Exception as exc:   # reported below with the others
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
    end = max(r["times"][-1] for r in results)
    gaps = [b - a for r in results for a, b in zip(r["times"][1:], r["times"][2:])]   # after the opening event
    return {"tok_s": sum(r["tokens"] for r in results) / (end - t0),
            "ttft_s": median(r["times"][0] - t0 for r in results),
            "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
            "events_per_token": sum(len(r["times"]) - 1 for r in results) / sum(r["tokens"] for r in results),
            "wall_s": end - t0, "itl_gaps": len(gaps), **_cpu_per_token(cpu0, cpu1, client_cpu, results)}


def _cpu_per_token(cpu0: dict, cpu1: dict, client_cpu: float, results: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in results)
    out = {"client_cpu_ms_per_token": client_cpu * 1e3 / tokens}
    for role in cpu1:
        out[f"{role}_cpu_ms_per_token"] = (cpu1[role] - cpu0.get(role, 0.0)) * 1e3 / tokens
    return out


def engine_cpu_run(engine, batch: list[list[int]], new_tokens: int) -> dict:
    """bench.concurrency.engine_run plus this process's CPU per token (the engine thread and the consumers)."""
    from bench.concurrency import engine_run

    cpu0 = time.process_time()
    r = engine_run(engine, batch, new_tokens)
    return {**r, "engine_cpu_ms_per_token": (time.process_time() - cpu0) * 1e3 / (len(batch) * new_tokens)}


COLUMNS = [("concurrency", "conc", "d"), ("engine_tok_s", "engine tok/s", ".1f"), ("http_tok_s", "HTTP tok/s", ".1f"),
           ("tok_s_ratio", "HTTP/engine", ".2f"), ("engine_ttft_ms", "engine TTFT ms", ".0f"),
           ("http_ttft_ms", "HTTP TTFT ms", ".0f"), ("http_itl_p50_ms", "HTTP ITL p50 ms", ".1f"),
           ("http_itl_p99_ms", "HTTP ITL p99 ms", ".1f"), ("engine_itl_p50_ms", "engine ITL p50", ".1f"),
           ("engine_itl_p99_ms", "engine ITL p99", ".1f"), ("events_per_token", "events/token", ".2f")]
CPU_COLUMNS = [("concurrency", "conc", "d"), ("engine_cpu_ms_tok", "in-process engine", ".2f"),
               ("http_engine_cpu_ms_tok", "server engine proc", ".2f"), ("http_worker_cpu_ms_tok", "workers", ".2f"),
               ("http_arbiter_cpu_ms_tok", "arbiter", ".2f"), ("http_client_cpu_ms_tok", "HTTP clients", ".2f")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default-fp16")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--concurrency", nargs="+", type=int, default=list(CONCURRENCY))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="1 repetition")
    ap.add_argument("--out", type=Path, default=RESULTS / "http.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps = 1

    import requests

    from appliance.manifest import Manifest
    from bench.concurrency import engine_settings, load_engine

    info = machine()
    path = model_dir(args.model)
    manifest = Manifest.load(path)
    runs, seed = [], 7000
    levels = list(args.concurrency)
    with tqdm(total=2 * args.reps * len(levels), desc="http", file=sys.stderr, leave=False) as bar:
        bar.set_postfix_str("starting the server")
        with ServerProcess(path, "--workers", str(args.workers), "--log-level", "warning",
                           log_path=LOGS / "http-serve.log") as srv:
            model = requests.get(srv.base + "/v3/models", timeout=30).json()["data"][0]["id"]
            http_run(srv.base, model, prompts(manifest.vocab_size, max(levels), 16, 1), 4)   # warm the workers
            bar.set_postfix_str("loading the in-process engine")
            engine = load_engine(path)
            try:
                for rep in range(args.reps):
                    for k, c in enumerate(levels):
                        sides = [("engine", lambda b: engine_cpu_run(engine, b, args.new_tokens)),
                                 ("http", lambda b: http_run(srv.base, model, b, args.new_tokens, srv.pid))]
                        if (rep + k) % 2:
                            sides.reverse()
                        for side, fn in sides:
                            bar.set_postfix_str(f"c={c} rep {rep + 1} {side}")
                            batch = prompts(manifest.vocab_size, c, args.prompt_len, seed)
                            seed += 1
                            runs.append({"impl": side, "concurrency": c, "rep": rep, "first": side == sides[0][0],
                                         **fn(batch)})
                            bar.update()
                settings = engine_settings(engine)
            finally:
                engine.shutdown()
            server_metrics = srv.metrics()

    rows = []
    for c in levels:
        row = {"model": args.model, "workers": args.workers, "concurrency": c}
        for side in ("engine", "http"):
            mine = [r for r in runs if r["impl"] == side and r["concurrency"] == c]
            row[f"{side}_tok_s"] = median(r["tok_s"] for r in mine)
            row[f"{side}_ttft_ms"] = median(r["ttft_s"] for r in mine) * 1e3
            row[f"{side}_itl_p50_ms"] = median(r["itl_p50_s"] for r in mine) * 1e3
            row[f"{side}_itl_p99_ms"] = median(r["itl_p99_s"] for r in mine) * 1e3
        http = [r for r in runs if r["impl"] == "http" and r["concurrency"] == c]
        row["events_per_token"] = median(r["events_per_token"] for r in http)
        for role in ("engine", "worker", "arbiter", "client"):
            row[f"http_{role}_cpu_ms_tok"] = median(r.get(f"{role}_cpu_ms_per_token", 0.0) for r in http)
        row["engine_cpu_ms_tok"] = median(r["engine_cpu_ms_per_token"] for r in runs
                                          if r["impl"] == "engine" and r["concurrency"] == c)
        row["tok_s_ratio"] = paired_ratio(runs, "tok_s", "http", "engine", concurrency=c)
        row["tok_s_ratio_of_medians"] = ratio(row["http_tok_s"], row["engine_tok_s"])
        rows.append(row)
    print_table(rows, COLUMNS, title=f"HTTP streaming ({args.workers} worker(s)) vs the engine in-process, "
                                     f"{args.model} (medians; ratio = median of per-repetition HTTP / engine)")
    print_table(rows, CPU_COLUMNS, title="CPU milliseconds per generated token (all threads of each process)")
    write_json(args.out, {"benchmark": "http", "args": args_dict(args), "model_dir": str(path),
                          "engine_settings": settings, "machine_before": info, "machine_after": machine(),
                          "server_metrics_after": {k: v for k, v in server_metrics.items()
                                                   if not k.split("{")[0].endswith("_bucket")},
                          "runs": runs, "summary": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
