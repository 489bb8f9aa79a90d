"""The HTTP worker's CPU per request (gunicorn gthread + Flask): on `GET /v2/health/live` (the HTTP stack alone),
one-sentence embeddings and a short non-streamed chat completion, for one or more checkouts side by side
(`--trees A B`: each round starts a real `appliance serve --config` (one worker) from each tree in turn, the
order alternating, one server at a time; medians over the rounds). The worker's CPU comes from /proc (user +
system of its process, its event-loop thread, the main one, apart), divided by the requests sent; one kept-alive
`http.client` connection sends them (a lean client: less of the box's CPU goes to it).

    git archive BASE | tar -x -C /tmp/before     # a checkout to compare with
    python -m bench.http_cost --trees /tmp/before . [--rounds 3] [--requests 1000] [--chat-requests 150]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from appliance.testing import loopback
from appliance.testing.loopback import LoopbackServer
from bench.common import LOGS, machine, print_table, write_json
from bench.common import RESULTS as RESULTS_DIR
from bench.embeddings_http import SENTENCES, _tree

CHAT = Path(os.environ.get("APPLIANCE_DATA_DIR", "/tmp/basedata")) / "models/smollm2-135m-instruct/openvino-int4"
EMBED = Path(os.environ.get("APPLIANCE_DATA_DIR", "/tmp/basedata")) / "models/all-minilm-l6-v2/openvino-int8"


class Server(LoopbackServer):
    ready_path = "/v2/health/ready"  # every model loaded


def serve(tree: Path, tag: str, extra: list[str]) -> LoopbackServer:
    LOGS.mkdir(parents=True, exist_ok=True)
    config = LOGS / f"http-cost-{tag}-{time.time_ns()}.json"
    models = [
        {"config": {"name": "chat", "base_path": str(CHAT)}},
        {"config": {"name": "embed", "base_path": str(EMBED), "num_threads": 1}},
    ]
    config.write_text(json.dumps({"workers": 1, "threads": 64, "model_config_list": models}))

    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "appliance.cli", "serve", "--config", str(config), "--port", str(port), *extra]

    env = {**os.environ, "PYTHONPATH": str(tree)}
    root, loopback.ROOT = loopback.ROOT, tree  # the server runs in (and imports from) that tree
    try:
        srv = Server(command, LOGS / f"serve-http-cost-{tag}.log", env=env, start_timeout=600)
    finally:
        loopback.ROOT = root
    return srv.wait_ready()


def worker_cpu(pid: int) -> dict[str, float]:
    """The gunicorn worker's CPU seconds: the whole process and its event-loop (main) thread."""
    tick = os.sysconf("SC_CLK_TCK")

    def cpu(stat: str, which: tuple[int, ...] = (11, 12)) -> float:
        fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        return sum(int(fields[i]) for i in which) / tick

    def gunicorn(proc: int) -> bool:
        try:
            return b"gunicorn" in Path(f"/proc/{proc}/cmdline").read_bytes()
        except OSError:
            return False

    for proc in _tree(pid):  # the worker: a gunicorn process whose parent (the arbiter) is one too
        parent = int(Path(f"/proc/{proc}/stat").read_text().rsplit(")", 1)[1].split()[1])
        if proc != pid and gunicorn(proc) and gunicorn(parent):
            return {
                "total": cpu(f"/proc/{proc}/stat"),
                "system": cpu(f"/proc/{proc}/stat", (12,)),
                "loop": cpu(f"/proc/{proc}/task/{proc}/stat"),
            }
    raise RuntimeError("no gunicorn worker found")


def run(base: str, pid: int, route: str, n: int) -> dict[str, float]:
    url = urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)

    def one(i: int) -> None:
        if route == "live":  # the HTTP stack alone: gunicorn, the edge, Flask and the hooks (a probe thread)
            conn.request("GET", "/v2/health/live")
            r = conn.getresponse()
            r.read()
            return
        if route == "embeddings":
            body = {"model": "embed", "input": SENTENCES[i % len(SENTENCES)]}
            path = "/v3/embeddings"
        else:
            body = {"model": "chat", "messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": 1}
            path = "/v3/chat/completions"
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {data[:200]!r}")

    for i in range(10):  # warm-up
        one(i)
    before = worker_cpu(pid)
    for i in range(n):
        one(i)
    after = worker_cpu(pid)
    conn.close()
    total = (after["total"] - before["total"]) / n * 1e3
    loop = (after["loop"] - before["loop"]) / n * 1e3
    system = (after["system"] - before["system"]) / n * 1e3
    return {"worker_ms": total, "loop_ms": loop, "threads_ms": total - loop, "system_ms": system}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", type=Path, default=[Path.cwd()])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--chat-requests", type=int, default=100)
    ap.add_argument("--serve-args", default="", help="extra `appliance serve` flags, e.g. --access-log")
    args = ap.parse_args(argv)
    load = [os.getloadavg()]
    samples: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        order = args.trees if r % 2 == 0 else list(reversed(args.trees))
        for tree in order:
            srv = serve(tree.resolve(), tree.resolve().name, args.serve_args.split())
            try:
                for route, n in (("live", args.requests), ("embeddings", args.requests), ("chat", args.chat_requests)):
                    s = run(srv.base, srv.pid, route, n)
                    samples.setdefault((str(tree), route), []).append(s)
                    print(f"round {r} {tree} {route}: {s}", flush=True)
            finally:
                srv.stop()
        load.append(os.getloadavg())
    rows = []
    for (tree, route), ss in samples.items():
        row = {"tree": tree, "route": route}
        for k in ("worker_ms", "loop_ms", "threads_ms", "system_ms"):
            row[k] = round(statistics.median(s[k] for s in ss), 3)
        rows.append(row)
    print_table(
        rows,
        [
            ("tree", "tree", ""),
            ("route", "route", ""),
            ("worker_ms", "worker ms/req", ".3f"),
            ("loop_ms", "loop ms/req", ".3f"),
            ("threads_ms", "threads ms/req", ".3f"),
            ("system_ms", "of it system", ".3f"),
        ],
    )
    write_json(
        RESULTS_DIR / "http_cost.json",
        {
            "machine": machine(),
            "loadavg": load,
            "args": {**vars(args), "trees": [str(t) for t in args.trees]},
            "rows": rows,
            "samples": {f"{t}|{r}": v for (t, r), v in samples.items()},
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
