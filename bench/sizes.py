"""Our engine vs openvino_genai at the model sizes edge boxes serve: random-weight models with the exact shapes of
Qwen2.5-1.5B / 0.5B and Llama-3.2-1B (bench/models.py), int4 and int8, built on first use (minutes each, cached).

Per model and weight format, three measurements, each reusing an existing benchmark's paired loop:
- batch 1 (bench.batch1_paired): decode tok/s and TTFT vs LLMPipeline (and CB at c=1), rotating which goes first;
- concurrency (bench.concurrency): aggregate tok/s and TTFT at 8 and 16 concurrent vs ContinuousBatchingPipeline;
- memory: one process per side (this module run as `--child engine|genai`), each loading the model, serving the
  `--memory-concurrency` requests once, and reporting its own peak RSS (VmHWM) and peak PSS (sampled every 0.1 s).
Every side gets the engine's compile properties, and the same KV budget: genai's SchedulerConfig.num_kv_blocks =
the engine's pool blocks (EngineConfig's default 16384-token pool, 32-token blocks, u8 KV on CPU through
KV_CACHE_PRECISION on both sides), max_num_seqs and max_num_batched_tokens alike. Prompts are fresh random token
ids, no chat template. Ratios are medians of per-run engine / genai; each row records the load average when it ran.

    python -m bench.sizes [--models qwen2.5-1.5b] [--formats int4 int8] [--runs 3] [--reps 3]
                          [--concurrency 8 16] [--prompt-len 128] [--new-tokens 64] [--only batch1 concurrency memory]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tqdm import tqdm

from bench.common import arg_parser, busy_processes, machine, print_table, prompts, pss_kb, save_results
from bench.models import FAMILIES, NAME, ensure_model

PARTS = ("batch1", "concurrency", "memory")


def _load() -> dict:
    return {"loadavg_1m": round(os.getloadavg()[0], 2), "busy": busy_processes()}


# ---------------------------------------------------------------- memory: one process per side


def child(side: str, path: Path, kv_blocks: int | None, concurrency: int, prompt_len: int, new_tokens: int) -> dict:
    """Runs in its own process: load `side`, serve `concurrency` requests at once, report peak memory."""
    from appliance.config import EngineConfig
    from appliance.manifest import Manifest
    from bench.concurrency import engine_run, genai_run, load_engine, load_genai

    me = os.getpid()
    peak = {"pss_kb": 0}
    halt = threading.Event()

    def sample() -> None:
        while not halt.is_set():
            peak["pss_kb"] = max(peak["pss_kb"], pss_kb(me))
            halt.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out: dict = {"side": side}
    if side == "engine":
        engine = load_engine(path)
        out.update(kv_blocks=engine.pool.num_blocks, kv_cache_bytes=getattr(engine.backend, "cache_bytes", None))
        run = lambda batch: engine_run(engine, batch, new_tokens)  # noqa: E731
    else:
        config = EngineConfig()  # the engine's defaults: its scheduler limits, compile properties, prefix caching
        like = SimpleNamespace(
            config=config,
            scheduler=SimpleNamespace(max_num_seqs=config.max_num_seqs),
            pool=SimpleNamespace(num_blocks=kv_blocks, prefix_caching=config.prefix_caching),
        )
        pipe: Any
        pipe, settings = load_genai(path, like)
        out.update(kv_blocks=kv_blocks, kv_cache_bytes=settings["kv_cache_bytes"])
        run = lambda batch: genai_run(pipe, batch, new_tokens)  # noqa: E731
    out["loaded_rss_kb"] = _status("VmRSS")
    out["loaded_pss_kb"] = pss_kb(me)
    out["run"] = run(prompts(Manifest.load(path).vocab_size, concurrency, prompt_len, 7000))
    if side == "genai":
        out["kv_cache_bytes_after"] = pipe.get_metrics().kv_cache_size_in_bytes
    halt.set()
    sampler.join()
    out["peak_rss_kb"] = _status("VmHWM")
    out["peak_pss_kb"] = max(peak["pss_kb"], pss_kb(me))
    return out


def _status(field: str) -> int:
    from bench.common import status_field

    return status_field(os.getpid(), field)


def _spawn(side: str, path: Path, kv_blocks: int | None, args) -> dict:
    cmd = [sys.executable, "-m", "bench.sizes", "--child", side, "--child-model", str(path)]
    cmd += ["--child-kv-blocks", str(kv_blocks or 0), "--memory-concurrency", str(args.memory_concurrency)]
    cmd += ["--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"memory child {side} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def memory(path: Path, args, bar) -> dict:
    """Engine first (it decides the KV blocks genai gets), then genai; `--memory-reps` alternations after that."""
    runs = []
    kv_blocks = None
    for rep in range(args.memory_reps):
        order = ("engine", "genai") if rep % 2 == 0 or kv_blocks is None else ("genai", "engine")
        for side in order:
            bar.set_postfix_str(f"memory {side} rep {rep + 1}")
            r = _spawn(side, path, kv_blocks, args)
            kv_blocks = kv_blocks or r["kv_blocks"]
            runs.append({**r, "rep": rep, **_load()})
            bar.update()
    row: dict = {}
    for side in ("engine", "genai"):
        mine = [r for r in runs if r["side"] == side]
        for key in ("loaded_rss_kb", "loaded_pss_kb", "peak_rss_kb", "peak_pss_kb"):
            row[f"{side}_{key[:-3]}_mb"] = sorted(r[key] for r in mine)[len(mine) // 2] / 1024
        row[f"{side}_kv_mb"] = (mine[0]["kv_cache_bytes"] or 0) / 2**20
    row["rss_ratio"] = row["engine_peak_rss_mb"] / row["genai_peak_rss_mb"]
    row["pss_ratio"] = row["engine_peak_pss_mb"] / row["genai_peak_pss_mb"]
    row["kv_blocks"] = kv_blocks
    row["loadavg_1m"] = max(r["loadavg_1m"] for r in runs)
    return {"runs": runs, "summary": row}


# ---------------------------------------------------------------- the benchmark


def bench_one(name: str, fmt: str, args, bar) -> dict:
    from bench import batch1_paired, concurrency

    bar.set_postfix_str(f"{name} {fmt}: building (minutes)")
    path = ensure_model(name, fmt)
    label = f"{name} {fmt}"
    out: dict = {"model": name, "format": fmt, "model_dir": str(path)}
    if "memory" in args.only:  # first: once this process has mapped the IR, the children's PSS would halve it
        r = memory(path, args, bar)
        out["memory"] = {**r, "summary": {"model": label, **r["summary"]}}
    if "batch1" in args.only:
        load = _load()
        r = batch1_paired.bench_model(str(path), args.runs, args.prompt_len, args.new_tokens, bar, seed=50000)
        out["batch1"] = {**r, "load": load, "summary": {**r["summary"], "model": label, **load}}
    if "concurrency" in args.only:
        load = _load()
        r = concurrency.bench_model(
            str(path), list(args.concurrency), args.reps, args.prompt_len, args.new_tokens, bar, seed=60000
        )
        out["concurrency"] = {**r, "load": load, "summary": [{**row, "model": label, **load} for row in r["summary"]]}
    return out


BATCH1_COLUMNS = [
    ("model", "model", ""),
    ("engine_decode_tok_s", "engine tok/s", ".2f"),
    ("llm_decode_tok_s", "LLMPipe tok/s", ".2f"),
    ("decode_ratio", "ratio", ".2f"),
    ("engine_ttft_ms", "engine TTFT ms", ".0f"),
    ("llm_ttft_ms", "LLMPipe TTFT ms", ".0f"),
    ("ttft_ratio", "TTFT ratio", ".2f"),
    ("decode_ratio_cb", "vs CB c=1", ".2f"),
    ("ttft_ratio_cb", "TTFT vs CB", ".2f"),
    ("loadavg_1m", "load", ".1f"),
]
CONC_COLUMNS = [
    ("model", "model", ""),
    ("concurrency", "conc", "d"),
    ("engine_tok_s", "engine tok/s", ".1f"),
    ("genai_tok_s", "CB tok/s", ".1f"),
    ("tok_s_ratio", "ratio", ".2f"),
    ("engine_ttft_ms", "engine TTFT ms", ".0f"),
    ("genai_ttft_ms", "CB TTFT ms", ".0f"),
    ("ttft_ratio", "TTFT ratio", ".2f"),
    ("loadavg_1m", "load", ".1f"),
]
MEMORY_COLUMNS = [
    ("model", "model", ""),
    ("kv_blocks", "KV blocks", "d"),
    ("engine_kv_mb", "engine KV MB", ".0f"),
    ("genai_kv_mb", "CB KV MB", ".0f"),
    ("engine_peak_rss_mb", "engine peak RSS MB", ".0f"),
    ("genai_peak_rss_mb", "CB peak RSS MB", ".0f"),
    ("rss_ratio", "ratio", ".2f"),
    ("engine_peak_pss_mb", "engine peak PSS MB", ".0f"),
    ("genai_peak_pss_mb", "CB peak PSS MB", ".0f"),
    ("pss_ratio", "ratio", ".2f"),
    ("loadavg_1m", "load", ".1f"),
]


def main(argv=None) -> int:
    ap = arg_parser(__doc__, "sizes", levels=True, reps=3, new_tokens=64, quick={"runs": 1, "reps": 1})
    ap.set_defaults(concurrency=[8, 16])
    ap.add_argument("--models", nargs="+", default=["qwen2.5-1.5b"], choices=[n for n in FAMILIES if n != NAME])
    ap.add_argument("--formats", nargs="+", default=["int4", "int8"], choices=["fp16", "int8", "int4"])
    ap.add_argument("--runs", type=int, default=3, help="batch-1 repetitions (each side once per repetition)")
    ap.add_argument("--only", nargs="+", default=list(PARTS), choices=PARTS)
    ap.add_argument("--memory-concurrency", type=int, default=16)
    ap.add_argument("--memory-reps", type=int, default=1)
    ap.add_argument("--child", choices=["engine", "genai"], help=argparse_hidden())
    ap.add_argument("--child-model", type=Path, help=argparse_hidden())
    ap.add_argument("--child-kv-blocks", type=int, default=0, help=argparse_hidden())
    args = ap.parse_args(argv)
    if args.child:
        result = child(
            args.child,
            args.child_model,
            args.child_kv_blocks or None,
            args.memory_concurrency,
            args.prompt_len,
            args.new_tokens,
        )
        print(json.dumps(result))
        return 0

    info = machine()
    results = []
    steps = {
        "batch1": 3 * args.runs,
        "concurrency": 2 * args.reps * len(args.concurrency),
        "memory": 2 * args.memory_reps,
    }
    total = len(args.models) * len(args.formats) * sum(steps[p] for p in args.only)
    with tqdm(total=total, desc="sizes", file=sys.stderr, leave=False) as bar:
        for name in args.models:
            for fmt in args.formats:
                results.append(bench_one(name, fmt, args, bar))
    tables = []
    if "batch1" in args.only:
        tables.append(
            print_table(
                [r["batch1"]["summary"] for r in results],
                BATCH1_COLUMNS,
                title=f"batch 1, {args.prompt_len} in / {args.new_tokens} out, {args.runs} rotated runs: engine vs "
                "LLMPipeline (ratio = median of per-run engine / other; TTFT ratio < 1 is better)",
            )
        )
    if "concurrency" in args.only:
        tables.append(
            print_table(
                [row for r in results for row in r["concurrency"]["summary"]],
                CONC_COLUMNS,
                title=f"concurrent, {args.prompt_len} in / {args.new_tokens} out, {args.reps} alternated reps: engine "
                "vs ContinuousBatchingPipeline (same scheduler limits and KV blocks)",
            )
        )
    if "memory" in args.only:
        tables.append(
            print_table(
                [r["memory"]["summary"] for r in results],
                MEMORY_COLUMNS,
                title=f"memory, one process per side, {args.memory_concurrency} concurrent requests, same KV blocks "
                "(ratio = engine / CB; <= 1 is the target)",
            )
        )
    save_results(args, "sizes", info, results=results, tables=tables)
    return 0


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
