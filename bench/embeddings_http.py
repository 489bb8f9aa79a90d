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
    the gunicorn ones; dead threads included) and of each engine and worker thread by its name (`encoder`,
    `encoder-bg` name themselves; the rest are `python/<tid>`: the engine's step loop and connection threads, a
    worker's event loop (its main thread: tid = the worker's pid) and request threads)."""
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
            if proc == pid or role.startswith("worker-"):
                for task in Path(f"/proc/{proc}/task").iterdir():
                    name = (task / "comm").read_text().strip()
                    key = f"{role}/{name}" if name.startswith("encoder") else f"{role}/{name}/{task.name}"
                    out[key] = out.get(key, 0.0) + cpu(task / "stat")
        except (OSError, ValueError, IndexError):
            pass
    return out


def thread_switches(pid: int) -> dict[str, tuple[int, int]]:
    """Context switches (voluntary, involuntary: /proc status) of the server's processes, as `thread_cpu` names
    them: a voluntary one is a thread going to sleep (to be woken later: on a loaded 2-core box each wake-up may
    wait for a core), an involuntary one a thread put off its core."""
    out: dict[str, tuple[int, int]] = {}
    for n, proc in enumerate(_tree(pid)):
        try:
            role = "engine" if proc == pid else f"other-{n}"
            if proc != pid and b"gunicorn" in Path(f"/proc/{proc}/cmdline").read_bytes():
                role = f"worker-{n}"
            for task in Path(f"/proc/{proc}/task").iterdir():
                status = (task / "status").read_text()
                fields = dict(line.split(":", 1) for line in status.splitlines() if "ctxt_switches:" in line)
                k = (int(fields["voluntary_ctxt_switches"]), int(fields["nonvoluntary_ctxt_switches"]))
                keys = [role]
                if proc == pid or role.startswith("worker-"):
                    name = (task / "comm").read_text().strip()
                    keys.append(f"{role}/{name}" if name.startswith("encoder") else f"{role}/{name}/{task.name}")
                for key in keys:
                    was = out.get(key, (0, 0))
                    out[key] = (was[0] + k[0], was[1] + k[1])
        except (OSError, ValueError, IndexError):
            pass
    return out


def runtime_dir(pid: int) -> str:
    """The server's private runtime directory (its engine socket and key), from a worker's environment."""
    from appliance.settings import RUNTIME_DIR_ENV

    for proc in _tree(pid):
        try:
            for var in Path(f"/proc/{proc}/environ").read_bytes().split(b"\0"):
                name, _, value = var.partition(b"=")
                if name.decode() == RUNTIME_DIR_ENV:
                    return value.decode()
        except OSError:
            pass
    raise RuntimeError("the server's runtime directory was not found")


# The HTTP worker's stages of one /v3/embeddings request (`worker_stages`): (label, module, attribute); a stage
# whose function is not there (another version of the code) is left out.
STAGES = (
    ("body read + JSON parse", "appliance.api.context", "AppApi.json_body"),
    ("validation (job built)", "appliance.openai_api.embeddings", "parse_embeddings"),
    ("engine round trip", "appliance.http.client", "EngineClient.encode"),
    ("response body + JSON encode", "appliance.openai_api.embeddings", "embeddings_response"),
    ("response body", "appliance.openai_api.embeddings", "embeddings_body"),
    ("JSON encode (Flask)", "flask.json.provider", "DefaultJSONProvider.response"),
    ("HTTP record round trip", "appliance.http.client", "EngineClient.record_http"),
)


def worker_stages(srv, requests_n: int = 200) -> dict:
    """Where an HTTP worker's time goes per request: the worker's own code (the Flask app of appliance serve,
    with an engine client on the running server's engine socket) run in this process through Flask's test client,
    each stage timed (wall and this thread's CPU, means per request). `flask dispatch (rest)` is the request's
    total minus the stages; gunicorn's HTTP parsing and socket writes are not in it (the server's worker CPU from
    /proc minus this total, in `paired_latency`)."""
    import importlib
    import threading as _threading

    from appliance.http.client import EngineClient
    from appliance.settings import ServeSettings
    from appliance.wsgi.app import create_app

    settings = ServeSettings.load(runtime_dir(srv.pid))
    client = EngineClient(settings.socket_path, settings.authkey())
    spans: dict[str, list[float]] = {}
    patched: list[tuple[object, str, object]] = []
    depth = _threading.local()

    def timed(label: str, fn):
        def wrapper(*args, **kwargs):
            outer = getattr(depth, "n", 0) == 0  # a stage inside another is counted once, in the outer
            depth.n = getattr(depth, "n", 0) + 1
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                depth.n -= 1
                if outer:
                    acc = spans.setdefault(label, [0.0, 0.0])
                    acc[0] += time.perf_counter() - w0
                    acc[1] += time.thread_time() - c0

        return wrapper

    for label, module, attr in STAGES:
        owner: object = importlib.import_module(module)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        if owner is None or not hasattr(owner, name):
            continue
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        fn = original.__func__ if isinstance(original, staticmethod) else original
        wrapped = timed(label, fn)
        setattr(owner, name, staticmethod(wrapped) if isinstance(original, staticmethod) else wrapped)
        patched.append((owner, name, original))
    try:
        app = create_app(settings, client).test_client()
        raw = json.dumps({"model": "embed", "input": SENTENCES[0]})
        app.post("/v3/embeddings", data=raw, content_type="application/json")
        spans.clear()
        total = [0.0, 0.0]
        for i in range(requests_n):
            raw = json.dumps({"model": "embed", "input": SENTENCES[i % len(SENTENCES)]})
            w0, c0 = time.perf_counter(), time.thread_time()
            r = app.post("/v3/embeddings", data=raw, content_type="application/json")
            total[0] += time.perf_counter() - w0
            total[1] += time.thread_time() - c0
            assert r.status_code == 200, r.data
    finally:
        for owner, name, original in patched:
            setattr(owner, name, original)
    inner = [sum(v[0] for v in spans.values()), sum(v[1] for v in spans.values())]
    rows = {k: v for k, v in spans.items()}
    rows["flask dispatch (rest)"] = [total[0] - inner[0], total[1] - inner[1]]
    rows["total (Flask test client)"] = total
    return {
        k: {"wall_ms": round(v[0] / requests_n * 1e3, 3), "cpu_ms": round(v[1] / requests_n * 1e3, 3)}
        for k, v in rows.items()
    }


def _mean_delta(after: dict, before: dict, name: str) -> float:
    n = after.get(name + "_count", 0) - before.get(name + "_count", 0)
    return (after.get(name + "_sum", 0) - before.get(name + "_sum", 0)) / n if n else float("nan")


class LeanClient:
    """One kept-alive `http.client` connection: a client whose own cost per request is small (`requests` builds a
    prepared request, adapters and urllib3's pool per call), to tell the server's latency from the client's."""

    def __init__(self, base: str):
        import http.client
        from urllib.parse import urlsplit

        url = urlsplit(base)
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)

    def post(self, body: dict) -> bytes:
        self.conn.request("POST", "/v3/embeddings", json.dumps(body), {"Content-Type": "application/json"})
        r = self.conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {data[:200]!r}")
        json.loads(data)  # as a client would
        return data

    def close(self) -> None:
        self.conn.close()


class RequestsClient:
    """A `requests` session, as the earlier measurements (and most Python clients) send."""

    def __init__(self, base: str):
        self.session, self.url = requests.Session(), base + "/v3/embeddings"

    def post(self, body: dict) -> bytes:
        r = self.session.post(self.url, json=body, timeout=120)
        r.raise_for_status()
        r.json()
        return r.content

    def close(self) -> None:
        self.session.close()


CLIENTS = {"requests": RequestsClient, "http.client": LeanClient}


def paired_latency(srv, embed: Path, threads: int, requests_n: int = 200, client: str = "requests") -> dict:
    """One sentence at a time, an in-process forward and an HTTP request alternating (same sentence, same moment
    of the box's load): the medians and their ratio; and where an HTTP request's time went: the engine's
    queue-to-answer and forward means (its /metrics), the server's CPU and context switches per thread per
    request (/proc) and the client's own CPU per request (this thread's)."""
    from appliance.runtime.encoder import Encoder

    enc = Encoder(embed, threads=threads)
    ids = enc.tokenize(SENTENCES)
    enc.embed(ids[:1])
    s = CLIENTS[client](srv.base)
    s.post({"model": "embed", "input": SENTENCES[0]})  # a pooled engine connection, warm
    local, http, client_cpu, local_cpu = [], [], 0.0, 0.0
    metrics_before, cpu_before, switches_before = srv.metrics(), thread_cpu(srv.pid), thread_switches(srv.pid)
    for i in range(requests_n):
        t0, c0 = time.perf_counter(), time.thread_time()
        enc.embed([ids[i % len(ids)]])
        local.append(time.perf_counter() - t0)
        local_cpu += time.thread_time() - c0
        body = {"model": "embed", "input": SENTENCES[i % len(SENTENCES)]}
        t0, c0 = time.perf_counter(), time.thread_time()
        s.post(body)
        http.append(time.perf_counter() - t0)
        client_cpu += time.thread_time() - c0
    switches_after, cpu_after, metrics_after = thread_switches(srv.pid), thread_cpu(srv.pid), srv.metrics()
    s.close()
    a, b = statistics.median(local), statistics.median(http)
    cpu = {k: round((v - cpu_before.get(k, 0.0)) / requests_n * 1e3, 2) for k, v in cpu_after.items()}
    switches = {
        k: [round((v[i] - switches_before.get(k, (0, 0))[i]) / requests_n, 2) for i in (0, 1)]
        for k, v in switches_after.items()
    }
    return {
        "client": client,
        "client_cpu_ms_per_request": round(client_cpu / requests_n * 1e3, 3),
        "in_process_cpu_ms_per_forward": round(local_cpu / requests_n * 1e3, 3),
        "requests": requests_n,
        "pairs_in_process_ms": [round(x * 1e3, 2) for x in local],
        "pairs_http_ms": [round(x * 1e3, 2) for x in http],
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
        "server_context_switches_per_request": {
            k: v for k, v in sorted(switches.items(), key=lambda kv: -sum(kv[1])) if sum(v) >= 0.05
        },
    }


def latency_runs(chat: Path, embed: Path, threads: int, runs: int, requests_n: int, clients: list[str]) -> dict:
    """`runs` paired runs per client kind on one server (the kinds alternating), then the worker's stages
    (`worker_stages`); the table of both."""
    srv = start(chat, embed, threads, "latency")
    try:
        paired = [paired_latency(srv, embed, threads, requests_n, c) for _ in range(runs) for c in clients]
        stages = worker_stages(srv, requests_n)
    finally:
        srv.stop()
    worker_cpu = statistics.median(
        sum(v for k, v in r["server_cpu_ms_per_request"].items() if k.startswith("worker-") and "/" not in k)
        for r in paired
    )
    flask_cpu = stages["total (Flask test client)"]["cpu_ms"]
    stages["gunicorn: HTTP parse + socket I/O (server worker CPU - Flask total)"] = {
        "wall_ms": None,
        "cpu_ms": round(worker_cpu - flask_cpu, 3),
    }
    rows = [
        {
            "what": f"run {i + 1} ({r['client']}): paired in-process / HTTP median",
            "ms": f"{r['in_process_ms']} / {r['http_ms']}",
            "cpu_ms": f"{r['client_cpu_ms_per_request']}",
            "note": f"ratio {r['ratio']} (CPU: the client's)",
        }
        for i, r in enumerate(paired)
    ]
    for r in paired[:1]:
        rows.append(
            {
                "what": "engine: queue-to-answer / forward (mean)",
                "ms": f"{r['engine_queue_to_answer_mean_ms']} / {r['engine_forward_mean_ms']}",
                "cpu_ms": f"{r['in_process_cpu_ms_per_forward']}",
                "note": "(CPU: the in-process forward's)",
            }
        )
        for k, v in r["server_cpu_ms_per_request"].items():
            vol, invol = r["server_context_switches_per_request"].get(k, (0, 0))
            note = f"switches: {vol} voluntary, {invol} involuntary"
            rows.append({"what": f"server CPU: {k}", "ms": "", "cpu_ms": f"{v}", "note": note})
    for k, v in stages.items():
        wall = "" if v["wall_ms"] is None else f"{v['wall_ms']:.3f}"
        rows.append({"what": f"worker stage: {k}", "ms": wall, "cpu_ms": f"{v['cpu_ms']:.3f}", "note": ""})
    return {"paired": paired, "worker_stages": stages, "rows": rows}


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
    ap.add_argument("--latency-runs", type=int, default=2, help="--only latency: paired runs on one server")
    ap.add_argument("--requests", type=int, default=200, help="--only latency: requests per paired run")
    ap.add_argument(
        "--client", nargs="+", choices=sorted(CLIENTS), default=["requests"], help="--only latency: the HTTP client(s)"
    )
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
    if args.only == "latency":  # paired 1-client latency only, and where its time goes
        out["latency"] = latency_runs(
            chat, embed, args.encoder_threads[0], args.latency_runs, args.requests, args.client
        )
        out["machine_after"] = machine()
        write_json(RESULTS_DIR / "embeddings_http.json", out)
        cols = [("what", "", "s"), ("ms", "wall ms", "s"), ("cpu_ms", "CPU ms", "s"), ("note", "", "s")]
        print_table(out["latency"]["rows"], cols, "Embeddings, 1 client: HTTP against the in-process forward")
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
