"""What OpenTelemetry tracing costs a request (appliance/tracing.py): off, it must cost nothing; on, a little, and
never on the engine's step loop.

Two parts, each side interleaved with the others, medians of the repetitions:

* **micro** (in this process): the worker's per-request work (appliance/http/tracing.py: the WSGI span, the Flask
  hook, the job's trace context) around a minimal Flask route, off (the app as a worker runs it) and on; and the
  engine's per-job work (appliance/server/tracing.py: the events watched, the spans made at the end) for a job of
  one choice and `--new-tokens` chunks. The spans go to a loopback OTLP receiver through the batch processor, as in
  a server.
* **http** (real servers, `appliance serve` on loopback, one worker): sequential streaming completions (random
  token-id prompts of `--prompt-len`, `--new-tokens` with ignore_eos), tok/s of a stream and TTFT, on three
  sides: tracing off, tracing on (to the loopback receiver), and, with `--baseline DIR` (a checkout of the code
  before tracing, e.g. `git archive main | tar -x -C DIR`), that code. Off against the baseline is the check that
  off costs nothing.

    python -m bench.tracing [--model default-fp16] [--reps 5] [--requests 8] [--prompt-len 128] [--new-tokens 64]
                            [--baseline DIR] [--no-http] [--quick]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

from appliance.testing.loopback import LoopbackServer
from appliance.testing.otlp import OtlpReceiver
from bench.common import LOGS, arg_parser, machine, model_dir, print_table, prompts, rotate, save_results

MICRO_CALLS = 2000


# ---------------------------------------------------------------- micro: the hooks, in this process


def _worker_app(on_job):
    from flask import Flask

    from appliance.protocol import Job

    app = Flask("bench")

    @app.post("/v3/chat/completions")
    def chat():
        if on_job is not None:
            on_job(Job("r", [], None, model="m"))  # type: ignore[arg-type]
        return {"ok": 1}

    return app


def _wsgi_seconds(wsgi, calls: int) -> float:
    from werkzeug.test import EnvironBuilder

    environ = EnvironBuilder(
        path="/v3/chat/completions",
        method="POST",
        headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        json={},
    ).get_environ()
    body = environ["wsgi.input"].read()

    def start_response(status, headers, exc_info=None):
        return None

    import io

    started = time.perf_counter()
    for _ in range(calls):
        env = dict(environ)
        env["wsgi.input"] = io.BytesIO(body)
        result = wsgi(env, start_response)
        for _ in result:
            pass
        close = getattr(result, "close", None)
        if close is not None:
            close()
    return (time.perf_counter() - started) / calls


def _engine_seconds(tracer, chunks: int, calls: int) -> float:
    from appliance import protocol as p
    from appliance.outputs import Chunk, Timing
    from appliance.params import SamplingParams
    from appliance.server import tracing as server_tracing

    class Sink:
        def send(self, event) -> None:
            pass

    server_tracing._tracing = tracer
    carrier = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    events = [p.Accepted([128])]
    events += [p.ChoiceChunk(0, Chunk(text="x", token_ids=[1], completion_tokens=i + 1)) for i in range(chunks - 1)]
    last = Chunk(token_ids=[1], finish_reason="length", prompt_tokens=128, completion_tokens=chunks)
    now = time.time()
    events += [p.ChoiceChunk(0, last, Timing(now - 1.0, 0.001, 0.1, 0.8, 0.901)), p.End()]
    started = time.perf_counter()
    for _ in range(calls):
        job = p.Job("r", [p.PromptSpec(text="")], SamplingParams(), model="m", trace=carrier if tracer else None)
        trace = server_tracing.job_trace(job) if job.trace is not None else None
        conn = trace.watch(Sink()) if trace is not None else Sink()
        for event in events:
            conn.send(event)
        if trace is not None:
            trace.end()
    return (time.perf_counter() - started) / calls


def micro(reps: int, chunks: int) -> tuple[list[dict], int]:
    from appliance import tracing
    from appliance.http.tracing import HttpTracing
    from appliance.server.tracing import JobTracing

    with OtlpReceiver() as receiver:
        provider = tracing.provider("bench", tracing.traces_url(receiver.base))
        hooks = HttpTracing(provider)
        off_app, on_app = _worker_app(None), _worker_app(hooks.on_job)
        on_app.after_request(hooks.after_request)
        sides = {
            "worker off": lambda: _wsgi_seconds(off_app, MICRO_CALLS),
            "worker on": lambda: _wsgi_seconds(hooks.wrap(on_app), MICRO_CALLS),
            "engine off": lambda: _engine_seconds(None, chunks, MICRO_CALLS // 10),
            "engine on": lambda: _engine_seconds(JobTracing(provider), chunks, MICRO_CALLS // 10),
        }
        times: dict[str, list[float]] = {name: [] for name in sides}
        for rep in range(reps):
            for name in rotate(list(sides), rep):
                times[name].append(sides[name]())
            provider.force_flush()
        provider.shutdown()
        exported = len(receiver.spans())
    rows = []
    for part in ("worker", "engine"):
        off, on = statistics.median(times[f"{part} off"]), statistics.median(times[f"{part} on"])
        rows.append(
            {
                "part": part if part == "worker" else f"engine ({chunks} chunks)",
                "off_us": off * 1e6,
                "on_us": on * 1e6,
                "cost_us": (on - off) * 1e6,
            }
        )
    return rows, exported


# ---------------------------------------------------------------- http: real servers


def _server(model: Path, checkout: Path, log: Path, env: dict, *flags: str) -> LoopbackServer:
    def command(port: int) -> list[str]:
        serve = [sys.executable, "-m", "appliance.cli", "serve", "--model", str(model), "--host", "127.0.0.1"]
        serve += ["--port", str(port), "--workers", "1", "--kv-cache-size", "16384tokens", *flags]
        return ["/bin/sh", "-c", f'cd "{checkout}" && exec "$@"', "serve", *serve]  # the checkout's code

    server = LoopbackServer(command, log, env={**env, "PYTHONPATH": str(checkout)})
    server.ready_path = "/v2/health/ready"
    return server


def _stream(base: str, model: str, ids: list[int], new_tokens: int) -> tuple[float, float]:
    from bench.client import stream_one

    started = time.perf_counter()
    r = stream_one(base, model, ids, new_tokens)
    if r["error"] or not r["times"]:
        raise RuntimeError(r["error"] or "no events")
    first, last = r["times"][0], r["times"][-1]
    return first - started, r["tokens"] / (last - started)


def http(args, model: Path) -> tuple[list[dict], int]:
    import contextlib

    import requests

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    results: dict[str, dict[str, list[float]]] = {}
    with OtlpReceiver() as receiver, contextlib.ExitStack() as stack:
        servers = {
            "off": _server(model, root, LOGS / "tracing-off.log", env),
            "on": _server(model, root, LOGS / "tracing-on.log", env, "--otlp-endpoint", receiver.base),
        }
        if args.baseline:
            servers["baseline"] = _server(model, Path(args.baseline).resolve(), LOGS / "tracing-base.log", env)
        for server in servers.values():
            stack.enter_context(server)
        name = requests.get(servers["off"].base + "/v3/models", timeout=30).json()["data"][0]["id"]
        batch = prompts(49152, args.requests, args.prompt_len, seed=7)
        for server in servers.values():  # warm: first requests compile shapes
            _stream(server.base, name, batch[0], 8)
        results = {side: {"ttft": [], "tps": []} for side in servers}
        for rep in range(args.reps):
            for side in rotate(list(servers), rep):
                ttfts, tps = zip(*(_stream(servers[side].base, name, ids, args.new_tokens) for ids in batch))
                results[side]["ttft"].append(statistics.median(ttfts))
                results[side]["tps"].append(statistics.median(tps))
        spans = len(receiver.spans())
    rows = []
    for side, r in results.items():
        rows.append(
            {
                "side": side,
                "tok_s": statistics.median(r["tps"]),
                "tok_s_min": min(r["tps"]),
                "tok_s_max": max(r["tps"]),
                "ttft_ms": statistics.median(r["ttft"]) * 1e3,
            }
        )
    return rows, spans


def main() -> None:
    ap = arg_parser(
        __doc__,
        "tracing",
        model="default-fp16",
        reps=5,
        prompt_len=128,
        new_tokens=64,
        quick={"reps": 2, "requests": 3},
    )
    ap.add_argument("--requests", type=int, default=8, help="streams per side and repetition")
    ap.add_argument("--baseline", type=str, default=None, help="a checkout of the code before tracing")
    ap.add_argument("--no-http", action="store_true", help="the micro part only")
    args = ap.parse_args()
    before = machine()
    micro_rows, micro_spans = micro(args.reps, args.new_tokens)
    print_table(
        micro_rows,
        [("part", "part", "s"), ("off_us", "off us", ".1f"), ("on_us", "on us", ".1f"), ("cost_us", "cost us", ".1f")],
        f"per request, in this process (medians; {micro_spans} spans received)",
    )
    http_rows: list[dict] = []
    http_spans = 0
    if not args.no_http:
        http_rows, http_spans = http(args, model_dir(args.model))
        print_table(
            http_rows,
            [
                ("side", "side", "s"),
                ("tok_s", "tok/s (stream)", ".1f"),
                ("tok_s_min", "min", ".1f"),
                ("tok_s_max", "max", ".1f"),
                ("ttft_ms", "TTFT ms", ".1f"),
            ],
            f"sequential streams, {args.prompt_len} prompt + {args.new_tokens} new tokens (medians of {args.reps}; "
            f"{http_spans} spans received from the traced server)",
        )
    print(save_results(args, "tracing", before, micro=micro_rows, http=http_rows, spans=[micro_spans, http_spans]))


if __name__ == "__main__":
    main()
