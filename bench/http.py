"""The concurrency sweep through the real server: `appliance serve` on loopback, streaming clients reading SSE,
beside our engine in this process and llama.cpp's server, in the same run (rotating which goes first), at the same
concurrency, prompt length and new tokens.

At each concurrency c, c clients POST /v3/completions at once (random token-id prompts, `ignore_eos`,
`stream: true`, `stream_options.include_usage` for the token count). Aggregate tok/s = completion tokens /
(last event - start); TTFT = start -> first SSE event (the server sends it when the first token exists);
inter-token latency = gaps between consecutive content events of a stream (p50 / p99 over all streams; an
event can carry more than one token when the detokenizer holds back part of a character, so the event/token
count is reported too). The clients are raw `requests` + json (light: they share the 2 CPUs with the server).

Several models (`--model default-int4 default-fp16 /path/to/export`): each gets its own server process, started
once and kept for the whole run (an idle server waits on its queue), and is one more side of the rotation, so every
cell of every model is measured interleaved with the others and with llama.cpp's. The question it answers: which of our
exports of the same weights (int4 included) beats llama.cpp on an AVX2 box: one run answers it for all of them.
The in-process engine side (HTTP overhead) runs for the first model only (`--no-engine`: not at all).

llama.cpp's server (bench.llamacpp) joins when `--llamacpp-python PATH` names a python with
`llama-cpp-python[server]`, or the current python has `llama_cpp` (`--no-llamacpp` skips it). It serves the GGUF our
default model is built from, so every --model must be an export of the default model's weights (bench.llamacpp says
how that is checked); with --llamacpp-python given, any other model is refused. Rows: one per (model,
concurrency), ours / llama.cpp as medians of per-repetition ratios.

ISA: every result records ours (machine(): cpu_isa under ONEDNN_MAX_CPU_ISA) and llama.cpp's build's system info,
printed under each table. `--isa-cap AVX2` approximates an AVX2 box on an AVX-512 one for our side (our servers
inherit the variable); llama.cpp ignores that variable, so with --isa-cap the llama.cpp side runs only with an
explicit --llamacpp-python, which must be an AVX2 build (e.g. /tmp/llama-avx2-venv, built with
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"); a build whose system
info disagrees with our ISA gets a warning under the tables.

    python -m bench.http [--model default-fp16 [MODEL ...]] [--workers 1] [--concurrency 1 4 8 16] [--reps 5]
                         [--prompt-len 128] [--new-tokens 128] [--quick] [--no-engine] [--isa-cap AVX2]
                         [--llamacpp-python PATH | --no-llamacpp] [--llamacpp-threads N]
    python -m bench.http --model default-int4 default-int8 default-fp16 --llamacpp-python /tmp/llama-venv/bin/python
    python -m bench.http --model default-int4 default-fp16 --isa-cap AVX2 \\
                         --llamacpp-python /tmp/llama-avx2-venv/bin/python
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from appliance import cpu_isa
from bench.client import http_run
from bench.common import (
    LOGS,
    MODEL_CHOICES,
    ServerProcess,
    arg_parser,
    finish,
    isa_cap_option,
    machine,
    median,
    model_dir,
    paired_ratio,
    print_table,
    prompts,
    ratio,
    rotate,
    side_medians,
)


def engine_cpu_run(engine, batch: list[list[int]], new_tokens: int) -> dict:
    """bench.concurrency.engine_run plus this process's CPU per token (the engine thread and the consumers)."""
    from bench.concurrency import engine_run

    cpu0 = time.process_time()
    r = engine_run(engine, batch, new_tokens)
    return {**r, "engine_cpu_ms_per_token": (time.process_time() - cpu0) * 1e3 / (len(batch) * new_tokens)}


COLUMNS = [
    ("model", "model", ""),
    ("concurrency", "conc", "d"),
    ("http_tok_s", "HTTP tok/s", ".1f"),
    ("engine_tok_s", "engine tok/s", ".1f"),
    ("tok_s_ratio", "HTTP/engine", ".2f"),
    ("http_ttft_ms", "HTTP TTFT ms", ".0f"),
    ("engine_ttft_ms", "engine TTFT ms", ".0f"),
    ("http_itl_p50_ms", "HTTP ITL p50 ms", ".1f"),
    ("http_itl_p99_ms", "HTTP ITL p99 ms", ".1f"),
    ("engine_itl_p50_ms", "engine ITL p50", ".1f"),
    ("engine_itl_p99_ms", "engine ITL p99", ".1f"),
    ("events_per_token", "events/token", ".2f"),
]
CPU_COLUMNS = [
    ("model", "model", ""),
    ("concurrency", "conc", "d"),
    ("engine_cpu_ms_tok", "in-process engine", ".2f"),
    ("http_engine_cpu_ms_tok", "server engine proc", ".2f"),
    ("http_worker_cpu_ms_tok", "workers", ".2f"),
    ("http_arbiter_cpu_ms_tok", "arbiter", ".2f"),
    ("http_client_cpu_ms_tok", "HTTP clients", ".2f"),
]
Side = tuple[str, str, str, Callable[[int, int], dict]]  # (side, impl, model, run(c, seed))


def resolve_models(names: list[str]) -> list[tuple[str, Path]]:
    """(label, export dir) per --model: the name as given, or a directory's last component."""
    models = [(Path(name).name or name, model_dir(name)) for name in names]
    if len({label for label, _ in models}) < len(models):
        raise SystemExit(f"--model: two models with the same label in {names}")
    return models


def choose_llamacpp(args, models: list[tuple[str, Path]]) -> str | None:
    """The python for llama.cpp's side, or None. Refuses what would compare unlike things: --isa-cap with a
    llama.cpp not chosen by hand, and (when asked for) a model that is not an export of the default model."""
    from bench.llamacpp import default_model_mismatch, llamacpp_python

    python = llamacpp_python(args.llamacpp_python, args.no_llamacpp)
    if python is None:
        return None
    if args.isa_cap and not args.llamacpp_python:
        raise SystemExit("--isa-cap: name an llama.cpp built for that ISA with --llamacpp-python, or --no-llamacpp")
    for label, path in models:
        if (why := default_model_mismatch(path)) is not None:
            if args.llamacpp_python:
                raise SystemExit(f"--llamacpp-python: {label} is not an export of the default model's GGUF: {why}")
            print(f"leaving llama.cpp out: {label} is not an export of the default model ({why})", file=sys.stderr)
            return None
    return python


def summarize(runs: list[dict], models: list[str], levels: list[int], engine: bool, llama: bool) -> list[dict]:
    """One row per (model, concurrency): our server's medians, the engine's (first model), llama.cpp's, and the
    ratios as medians of per-repetition ratios (paired_ratio over the runs' `side`)."""
    rows = []
    for k, model in enumerate(models):
        for c in levels:
            mine = [r for r in runs if r["side"] == f"http {model}" and r["concurrency"] == c]
            row: dict[str, Any] = {"model": model, "concurrency": c}
            row["events_per_token"] = median(r["events_per_token"] for r in mine)
            row.update(
                side_medians(runs, "http", seconds=("ttft_s", "itl_p50_s", "itl_p99_s"), model=model, concurrency=c)
            )
            for role in ("engine", "worker", "arbiter", "client"):
                row[f"http_{role}_cpu_ms_tok"] = median(r.get(f"{role}_cpu_ms_per_token", 0.0) for r in mine)
            if engine and k == 0:
                row.update(side_medians(runs, "engine", seconds=("ttft_s", "itl_p50_s", "itl_p99_s"), concurrency=c))
                row["engine_cpu_ms_tok"] = median(
                    r["engine_cpu_ms_per_token"] for r in runs if r["side"] == "engine" and r["concurrency"] == c
                )
                row["tok_s_ratio"] = paired_ratio(runs, "tok_s", f"http {model}", "engine", side="side", concurrency=c)
                row["tok_s_ratio_of_medians"] = ratio(row["http_tok_s"], row["engine_tok_s"])
            if llama:
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
                    r.get("engine_cpu_ms_per_token", 0.0)
                    for r in runs
                    if r["side"] == "llamacpp" and r["concurrency"] == c
                )
                for key, name in (("tok_s", "tok_s_ratio_llamacpp"), ("ttft_s", "ttft_ratio_llamacpp")):
                    row[name] = paired_ratio(runs, key, f"http {model}", "llamacpp", side="side", concurrency=c)
            rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = arg_parser(__doc__, "http", levels=True, reps=5, quick={"reps": 1})
    ap.add_argument(
        "--model",
        nargs="+",
        default=["default-fp16"],
        help=f"one or more of {', '.join(MODEL_CHOICES)} (or default-int4, any default-<format>) or export "
        "directories: each its own server, all interleaved",
    )
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--no-engine", action="store_true", help="leave out the in-process engine (first model) side")
    ap.add_argument(
        "--llamacpp-python",
        metavar="PATH",
        help="a python with llama-cpp-python[server]: add llama.cpp's server on the default model's GGUF "
        "(default: this python, if it has llama_cpp); with --isa-cap, a build for that ISA",
    )
    ap.add_argument("--no-llamacpp", action="store_true", help="leave llama.cpp out even if it is installed")
    ap.add_argument("--llamacpp-threads", type=int, default=os.cpu_count(), help="its --n_threads (default: CPUs)")
    isa_cap_option(ap)
    args = ap.parse_args(argv)

    from appliance.manifest import Manifest
    from bench.concurrency import engine_settings, load_engine
    from bench.llamacpp import COLUMNS as LLAMACPP_COLUMNS
    from bench.llamacpp import isa_report, llamacpp_run, start_llamacpp, text_prompts, workload

    info = machine()
    models = resolve_models(args.model)
    labels = [label for label, _ in models]
    vocab = {label: Manifest.load(path).vocab_size for label, path in models}
    levels = list(args.concurrency)
    llama_python = choose_llamacpp(args, models)
    n_sides = len(models) + (not args.no_engine) + bool(llama_python)
    runs: list[dict] = []
    seed = 7000
    llama, settings, metrics = None, None, {}
    with (
        tqdm(total=n_sides * args.reps * len(levels), desc="http", file=sys.stderr, leave=False) as bar,
        contextlib.ExitStack() as stack,
    ):
        bar.set_postfix_str("starting the server(s)")
        sides: list[Side] = []
        if llama_python:
            llama = start_llamacpp(llama_python, args, stack)
        servers = {}
        for i, (label, path) in enumerate(models):
            srv = stack.enter_context(
                ServerProcess(
                    path,
                    "--workers",
                    str(args.workers),
                    "--log-level",
                    "warning",
                    log_path=LOGS / f"http-serve-{i}.log",
                )
            )
            model_id = srv.model_id()
            http_run(srv.base, model_id, prompts(vocab[label], max(levels), 16, 1), 4)  # warm the workers
            servers[label] = srv

            def ours(c: int, s: int, srv=srv, model_id=model_id, label=label) -> dict:
                batch = prompts(vocab[label], c, args.prompt_len, s)
                return http_run(srv.base, model_id, batch, args.new_tokens, srv.pid)

            sides.append((f"http {label}", "http", label, ours))
        if llama is not None:
            tokenizer, logit_bias = workload()
            llamacpp_run(llama, logit_bias, text_prompts(tokenizer, vocab[labels[0]], 1, 16, 2), 4)  # warm-up

            def theirs(c: int, s: int, llama=llama) -> dict:
                texts = text_prompts(tokenizer, vocab[labels[0]], c, args.prompt_len, s)
                return llamacpp_run(llama, logit_bias, texts, args.new_tokens)

            sides.append(("llamacpp", "llamacpp", "", theirs))
        if not args.no_engine:
            bar.set_postfix_str("loading the in-process engine")
            engine = load_engine(models[0][1])
            stack.callback(engine.shutdown)
            sides.append(
                (
                    "engine",
                    "engine",
                    labels[0],
                    lambda c, s: engine_cpu_run(
                        engine, prompts(vocab[labels[0]], c, args.prompt_len, s), args.new_tokens
                    ),
                )
            )
        for rep in range(args.reps):
            for k, c in enumerate(levels):
                order = rotate(sides, rep + k)
                for side, impl, label, fn in order:
                    bar.set_postfix_str(f"c={c} rep {rep + 1} {side}")
                    row = {"side": side, "impl": impl, "model": label, "concurrency": c, "rep": rep}
                    runs.append({**row, "first": side == order[0][0], **fn(c, seed)})
                    seed += 1
                    bar.update()
        settings = None if args.no_engine else engine_settings(engine)
        metrics = {label: srv.metrics() for label, srv in servers.items()}

    rows = [
        {**row, "workers": args.workers}
        for row in summarize(runs, labels, levels, not args.no_engine, llama is not None)
    ]
    isa_lines = isa_report(cpu_isa.detect(), llama.system_info if llama is not None else None)
    print_table(
        rows,
        COLUMNS,
        title=f"HTTP streaming ({args.workers} worker(s)), medians"
        + (
            ""
            if args.no_engine
            else f"; the engine in-process on {labels[0]}, ratio = median of per-repetition HTTP / engine"
        ),
    )
    print("\n".join(isa_lines))
    cpu_columns = CPU_COLUMNS
    if llama is not None:
        print_table(
            rows,
            LLAMACPP_COLUMNS,
            title=f"ours over HTTP vs llama.cpp's server (llama-cpp-python {llama.version}, "
            f"{Path(llama.settings['model']).name}, text prompts; ratios = median of per-repetition ours / llama.cpp, "
            "TTFT ratio < 1 is better)",
        )
        print("\n".join(isa_lines))
        cpu_columns = [*CPU_COLUMNS, ("llamacpp_cpu_ms_tok", "llama.cpp server", ".2f")]
    print_table(rows, cpu_columns, title="CPU milliseconds per generated token (all threads of each process)")
    print("\n".join(isa_lines))
    extra: dict[str, Any] = {}
    if llama is not None:
        extra["llamacpp"] = {"version": llama.version, "python": llama_python, "settings": llama.settings}
        extra["llamacpp_system_info"] = llama.system_info
    return finish(
        args,
        "http",
        info,
        rows,
        models=[
            {
                "model": label,
                "model_dir": str(path),
                # the /metrics counters at the end (histogram buckets left out)
                "server_metrics_after": {
                    k: v for k, v in metrics[label].items() if not k.split("{")[0].endswith("_bucket")
                },
            }
            for label, path in models
        ],
        engine_settings=settings,
        isa_report=isa_lines,
        **extra,
        runs=runs,
    )


if __name__ == "__main__":
    sys.exit(main())
