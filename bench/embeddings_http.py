"""Embeddings over HTTP (the serving side; bench/embeddings.py measures the model in process):

- `throughput`: sentences/s with 1, 8 and 32 concurrent clients, each sending one sentence per request in a loop,
  against the in-process Encoder with the same inference threads, and the 1-client request latency against the
  in-process one-sentence forward (the target: within 10%).
- `latency` (`--only latency`): the 1-client latency paired request by request with the in-process forward, and
  where the HTTP request's time goes: the engine's queue-to-answer and forward means (/metrics) and the server's
  CPU per thread per request (/proc: the HTTP worker's, the engine connection's, the encoder's threads).
- `mixed`: chat inter-token latency p99 of 4 streaming clients alone, and while 8 clients embed in a loop (the
  target: at most +20%), per encoder setting (its inference threads: `num_threads` of its config entry).
  Alone and mixed alternate, medians over the repetitions.

The server is a real `appliance serve --config` with the chat model and all-MiniLM-L6-v2 side by side.

    python -m bench.embeddings_http [--reps 3] [--seconds 6] [--encoder-threads 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

import requests

from appliance.testing.loopback import ApplianceServer
from bench.client import http_run
from bench.common import LOGS, machine, model_dir, percentile, print_table, prompts, write_json
from bench.common import RESULTS as RESULTS_DIR

SENTENCES = [
    f"Sentence {i}: the appliance answers questions about manuals, logs and tickets on a small box, item {i}."
    for i in range(512)
]


NICE: int | None = None  # --encoder-nice: the served encoder thread's niceness (APPLIANCE_ENCODER_NICE)
SCHED: str | None = None  # --encoder-sched: its policy while chat runs (APPLIANCE_ENCODER_SCHED)


class ConfigServer(ApplianceServer):
    """`appliance serve --config FILE` (the file names the models)."""

    def __init__(self, config: Path, log_path: Path):
        import os
        import sys

        from appliance.testing.loopback import ROOT, LoopbackServer

        def command(port: int) -> list[str]:
            return [sys.executable, "-m", "appliance.cli", "serve", "--config", str(config), "--port", str(port)]

        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        if NICE is not None:
            env["APPLIANCE_ENCODER_NICE"] = str(NICE)
        if SCHED is not None:
            env["APPLIANCE_ENCODER_SCHED"] = SCHED
        LoopbackServer.__init__(self, command, log_path, env=env, start_timeout=600)


def start(chat: Path, embed: Path, threads: int | None, tag: str) -> ConfigServer:
    LOGS.mkdir(parents=True, exist_ok=True)
    config = LOGS / f"embeddings-{tag}-{time.time_ns()}.json"
    entry: dict = {"name": "embed", "base_path": str(embed)}
    if threads:
        entry["num_threads"] = threads
    config.write_text(
        json.dumps(
            {
                "workers": 1,
                "threads": 64,
                "model_config_list": [{"config": {"name": "chat", "base_path": str(chat)}}, {"config": entry}],
            }
        )
    )
    return ConfigServer(config, LOGS / f"serve-embeddings-{tag}.log").wait_ready()


def clients_loop(base: str, clients: int, seconds: float, batch: int = 1) -> dict:
    """`clients` threads, each POSTing `batch` sentences per request for `seconds`: sentences/s, latency p50."""
    stop = time.perf_counter() + seconds
    done: list[int] = [0] * clients
    lat: list[float] = []
    lock = threading.Lock()

    def run(k: int) -> None:
        s = requests.Session()
        i = k
        while time.perf_counter() < stop:
            body = {"model": "embed", "input": [SENTENCES[(i + j) % len(SENTENCES)] for j in range(batch)]}
            t0 = time.perf_counter()
            r = s.post(base + "/v3/embeddings", json=body, timeout=120)
            r.raise_for_status()
            with lock:
                lat.append(time.perf_counter() - t0)
            done[k] += batch
            i += clients
        s.close()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"sent_s": sum(done) / wall, "lat_p50_s": percentile(lat, 50), "requests": len(lat)}


def embed_loop(base: str, k: int, stop: threading.Event, done: list[int] | None = None) -> None:
    """One embedding client: 16 sentences per request until `stop` (`done[k]`: the sentences answered)."""
    s = requests.Session()
    i = k * 37
    while not stop.is_set():
        body = {"model": "embed", "input": SENTENCES[i % 480 : i % 480 + 16]}
        s.post(base + "/v3/embeddings", json=body, timeout=120).raise_for_status()
        i += 16
        if done is not None:
            done[k] += 16
    s.close()


def in_process(embed: Path, threads: int, seconds: float) -> dict:
    from appliance.runtime.encoder import Encoder

    enc = Encoder(embed, threads=threads)
    ids = enc.tokenize(SENTENCES)
    enc.embed(ids[:1])
    lat = []
    stop = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < stop:
        t0 = time.perf_counter()
        enc.embed([ids[i % len(ids)]])
        lat.append(time.perf_counter() - t0)
        i += 1
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds:
        enc.embed(ids[n % 480 : n % 480 + 32])
        n += 32
    return {
        "lat_p50_s": percentile(lat, 50),
        "batch1_sent_s": 1 / statistics.median(lat),
        "batch32_sent_s": n / (time.perf_counter() - t0),
    }


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (the serve process, its engine, the gunicorn arbiter and workers)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo += children.get(out[-1], [])
    return out


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system, /proc) of the server's processes (`engine` = the serve process, `worker-N` =
    the gunicorn ones; dead threads included) and of each engine thread by its name (`encoder`, `encoder-bg` name
    themselves; the rest are `python/<tid>`: the step loop and the connections' threads)."""
    tick = os.sysconf("SC_CLK_TCK")

    def cpu(stat: Path) -> float:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    out: dict[str, float] = {}
    for n, proc in enumerate(_tree(pid)):
        try:
            role = "engine" if proc == pid else f"other-{n}"
            if proc != pid and b"gunicorn" in Path(f"/proc/{proc}/cmdline").read_bytes():
                role = f"worker-{n}"
            out[role] = cpu(Path(f"/proc/{proc}/stat"))
            if proc == pid:
                for task in Path(f"/proc/{proc}/task").iterdir():
                    name = (task / "comm").read_text().strip()
                    key = f"engine/{name}" if name.startswith("encoder") else f"engine/{name}/{task.name}"
                    out[key] = out.get(key, 0.0) + cpu(task / "stat")
        except (OSError, ValueError, IndexError):
            pass
    return out


def _mean_delta(after: dict, before: dict, name: str) -> float:
    n = after.get(name + "_count", 0) - before.get(name + "_count", 0)
    return (after.get(name + "_sum", 0) - before.get(name + "_sum", 0)) / n if n else float("nan")


def paired_latency(srv, embed: Path, threads: int, requests_n: int = 200) -> dict:
    """One sentence at a time, an in-process forward and an HTTP request alternating (same sentence, same moment
    of the box's load): the medians and their ratio; and where an HTTP request's time went: the engine's
    queue-to-answer and forward means (its /metrics) and the server's CPU per thread per request (/proc)."""
    from appliance.runtime.encoder import Encoder

    enc = Encoder(embed, threads=threads)
    ids = enc.tokenize(SENTENCES)
    enc.embed(ids[:1])
    s = requests.Session()
    body = {"model": "embed", "input": SENTENCES[0]}
    s.post(srv.base + "/v3/embeddings", json=body).raise_for_status()  # a pooled engine connection, warm
    local, http = [], []
    metrics_before, cpu_before = srv.metrics(), thread_cpu(srv.pid)
    for i in range(requests_n):
        t0 = time.perf_counter()
        enc.embed([ids[i % len(ids)]])
        local.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        body = {"model": "embed", "input": SENTENCES[i % len(SENTENCES)]}
        s.post(srv.base + "/v3/embeddings", json=body).raise_for_status()
        http.append(time.perf_counter() - t0)
    cpu_after, metrics_after = thread_cpu(srv.pid), srv.metrics()
    a, b = statistics.median(local), statistics.median(http)
    cpu = {k: round((v - cpu_before.get(k, 0.0)) / requests_n * 1e3, 2) for k, v in cpu_after.items()}
    return {
        "in_process_ms": round(a * 1e3, 1),
        "http_ms": round(b * 1e3, 1),
        "ratio": round(b / a, 3),
        "in_process_mean_ms": round(statistics.mean(local) * 1e3, 1),
        "http_mean_ms": round(statistics.mean(http) * 1e3, 1),
        "engine_queue_to_answer_mean_ms": round(
            _mean_delta(metrics_after, metrics_before, "appliance_encoder_request_duration_seconds") * 1e3, 1
        ),
        "engine_forward_mean_ms": round(
            _mean_delta(metrics_after, metrics_before, "appliance_encoder_forward_seconds") * 1e3, 1
        ),
        "server_cpu_ms_per_request": {k: v for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]) if v > 0.05},
    }


def throughput(chat: Path, embed: Path, threads: int, reps: int, seconds: float) -> list[dict]:
    rows = []
    srv = start(chat, embed, threads, "throughput")
    try:
        results: dict[str, list[dict]] = {}
        for _ in range(reps):
            results.setdefault("in-process", []).append(in_process(embed, threads, seconds))
            for c in (1, 8, 32):
                results.setdefault(f"http-{c}", []).append(clients_loop(srv.base, c, seconds))
        ip = results["in-process"]
        ip_lat = statistics.median(r["lat_p50_s"] for r in ip)
        rows.append(
            {
                "side": f"in-process (1 sentence / 32 per forward, {threads} thr)",
                "sent_s": f"{statistics.median(r['batch1_sent_s'] for r in ip):.0f} / "
                f"{statistics.median(r['batch32_sent_s'] for r in ip):.0f}",
                "lat_ms": f"{ip_lat * 1e3:.1f}",
                "vs": "",
            }
        )
        for c in (1, 8, 32):
            rs = results[f"http-{c}"]
            lat = statistics.median(r["lat_p50_s"] for r in rs)
            rows.append(
                {
                    "side": f"HTTP, {c} clients x 1 sentence",
                    "sent_s": f"{statistics.median(r['sent_s'] for r in rs):.0f}",
                    "lat_ms": f"{lat * 1e3:.1f}",
                    "vs": f"{lat / ip_lat:.2f}x in-process latency" if c == 1 else "",
                }
            )
    finally:
        srv.stop()
    return rows


def mixed(chat: Path, embed: Path, threads_list: list[int], reps: int, new_tokens: int) -> list[dict]:
    rows = []
    vocab = 49152
    for threads in threads_list:
        srv = start(chat, embed, threads, f"mixed-{threads}")
        try:
            alone, loaded = [], []
            for rep in range(reps):
                batch = prompts(vocab, 4, 64, seed=rep)
                order = ("alone", "mixed") if rep % 2 == 0 else ("mixed", "alone")
                for side in order:
                    stop = threading.Event()
                    embedders = []
                    done = [0] * 8
                    if side == "mixed":
                        embedders = [
                            threading.Thread(target=embed_loop, args=(srv.base, k, stop, done)) for k in range(8)
                        ]
                        for t in embedders:
                            t.start()
                        time.sleep(1.0)  # the embedders are running
                    t0, before = time.perf_counter(), sum(done)
                    run = http_run(srv.base, "chat", batch, new_tokens)
                    run["embedded_sent_s"] = (sum(done) - before) / (time.perf_counter() - t0)
                    stop.set()
                    for t in embedders:
                        t.join()
                    (alone if side == "alone" else loaded).append(run)
            a = statistics.median(r["itl_p99_s"] for r in alone)
            m = statistics.median(r["itl_p99_s"] for r in loaded)
            rows.append(
                {
                    "encoder_threads": str(threads),
                    "itl_p99_alone_ms": f"{a * 1e3:.1f}",
                    "itl_p99_mixed_ms": f"{m * 1e3:.1f}",
                    "growth": f"{(m / a - 1) * 100:+.0f}%",
                    "itl_p50_alone_ms": f"{statistics.median(r['itl_p50_s'] for r in alone) * 1e3:.1f}",
                    "itl_p50_mixed_ms": f"{statistics.median(r['itl_p50_s'] for r in loaded) * 1e3:.1f}",
                    "embedded_sent_s_during_chat": f"{statistics.median(r['embedded_sent_s'] for r in loaded):.1f}",
                    "reps_p99_alone_ms": [round(r["itl_p99_s"] * 1e3, 1) for r in alone],
                    "reps_p99_mixed_ms": [round(r["itl_p99_s"] * 1e3, 1) for r in loaded],
                }
            )
        finally:
            srv.stop()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--chat-model", default="default-int8")
    ap.add_argument("--embedding-model", default=None, help="an embedding export (default: all-MiniLM-L6-v2 int8)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--encoder-threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--only", choices=("throughput", "mixed", "latency"), default=None)
    ap.add_argument("--encoder-nice", type=int, default=None, help="the encoder thread's niceness (default: 19)")
    ap.add_argument("--encoder-sched", choices=("normal", "idle"), default=None, help="APPLIANCE_ENCODER_SCHED")
    args = ap.parse_args(argv)
    global NICE, SCHED
    NICE, SCHED = args.encoder_nice, args.encoder_sched
    chat = model_dir(args.chat_model)
    if args.embedding_model:
        embed = Path(args.embedding_model)
    else:
        from export.default_model import ensure_embedding_export

        embed = ensure_embedding_export("openvino", "int8")
    before = machine()
    out: dict = {"machine": before, "encoder_nice": args.encoder_nice, "encoder_sched": args.encoder_sched}
    if args.only == "latency":  # paired 1-client latency only
        srv = start(chat, embed, args.encoder_threads[0], "latency")
        try:
            out["latency"] = paired_latency(srv, embed, args.encoder_threads[0])
        finally:
            srv.stop()
        print(out["latency"])
        write_json(RESULTS_DIR / "embeddings_http.json", out)
        return 0
    if args.only in (None, "throughput"):
        rows = throughput(chat, embed, args.encoder_threads[0], args.reps, args.seconds)
        cols = [("side", "side", "s"), ("sent_s", "sentences/s", "s"), ("lat_ms", "latency ms", "s"), ("vs", "", "s")]
        out["throughput"] = rows
        write_json(RESULTS_DIR / "embeddings_http.json", out)
        print_table(rows, cols, "Embeddings over HTTP")
    if args.only in (None, "mixed"):
        rows = mixed(chat, embed, args.encoder_threads, args.reps, args.new_tokens)
        out["mixed"] = rows
        write_json(RESULTS_DIR / "embeddings_http.json", out)
        cols = [(k, k, "s") for k in rows[0] if not k.startswith("reps_")]
        print_table(rows, cols, "Chat ITL, 4 streams, alone vs beside 8 embedding clients")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
