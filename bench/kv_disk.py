"""The prefix cache's disk tier (appliance/runtime/kv_disk.py): what a warm disk buys after a restart, and what
the tier costs when it never hits.

TTFT: each repetition draws a fresh random shared prefix (default 2,000 tokens). Engine "writer" (tier on,
directory D) computes it once and its writes are flushed; engine "restarted" (tier on, the same D, its RAM has
never seen the prefix: a restarted process) then serves prefix + a new suffix, loading the prefix from disk;
engine "cold" (tier off) serves the same prompt from scratch. TTFT = submit -> first token, one request at a
time; ratio = restarted / cold per repetition (paired), median.

Overhead: the same batch of unique random prompts (every block missed and written through) on "restarted"
(tier on) and "cold" (tier off), the order alternating per repetition; throughput = tokens / wall.

    python -m bench.kv_disk [--model default-fp16] [--prefix-len 2000] [--reps 5] [--quick]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
import time

import numpy as np

from bench.common import arg_parser, machine, median, model_dir, print_table, rotate, save_results


def ttft(engine, prompt: list[int]) -> float:
    from appliance.params import SamplingParams

    t0 = time.perf_counter()
    for chunk in engine.submit(prompt, SamplingParams(max_tokens=2, ignore_eos=True)):
        if chunk.token_ids:
            first = time.perf_counter() - t0
            break
    return first


def throughput(engine, batch: list[list[int]], new_tokens: int, in_flight: int) -> float:
    from appliance.params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    slots = threading.Semaphore(in_flight)
    threads = []

    def consume(handle) -> None:
        try:
            handle.results()
        finally:
            slots.release()

    t0 = time.perf_counter()
    for p in batch:
        slots.acquire()
        t = threading.Thread(target=consume, args=(engine.submit(p, params),), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return (sum(map(len, batch)) + new_tokens * len(batch)) / (time.perf_counter() - t0)


COLUMNS = [
    ("model", "model", ""),
    ("cold_ttft_ms", "cold TTFT ms", ".0f"),
    ("disk_ttft_ms", "warm disk TTFT ms", ".0f"),
    ("ttft_ratio", "disk / cold", ".3f"),
    ("load_ms_per_block", "load ms/block", ".2f"),
    ("off_tok_s", "tier off tok/s", ".0f"),
    ("on_tok_s", "tier on, missing tok/s", ".0f"),
    ("cost_pct", "cost %", ".1f"),
    ("tier_cpu_pct", "tier CPU % of run", ".2f"),
    ("copy_us_per_block", "step copy us/block", ".0f"),
    ("writer_us_per_block", "writer CPU us/block", ".0f"),
]


def main(argv=None) -> int:
    ap = arg_parser(__doc__, "kv_disk", model="default-fp16", reps=5, prompt_len=None, new_tokens=16, quick={"reps": 2})
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--prompt-len-overhead", type=int, default=512)
    args = ap.parse_args(argv)

    from appliance.config import EngineConfig
    from appliance.manifest import Manifest
    from bench.concurrency import load_engine

    info = machine()
    path = model_dir(args.model)
    vocab = Manifest.load(path).vocab_size
    disk = tempfile.mkdtemp(prefix="kv-disk-bench-")
    engines = {
        "writer": load_engine(path, EngineConfig(kv_disk_dir=disk)),
        "restarted": load_engine(path, EngineConfig(kv_disk_dir=disk)),
        "cold": load_engine(path, EngineConfig()),
    }
    runs = []
    try:
        backend = engines["restarted"].backend
        t0 = time.perf_counter()
        for b in range(200):
            backend.read_block(b % backend.num_blocks)
        read_us = (time.perf_counter() - t0) / 200 * 1e6
        for rep in range(args.reps):
            rng = np.random.default_rng(900 + rep)
            prefix = rng.integers(100, vocab - 100, size=args.prefix_len).tolist()
            suffix = rng.integers(100, vocab - 100, size=16).tolist()
            ttft(engines["writer"], prefix + suffix[:8])
            assert engines["writer"].pool.disk is not None
            engines["writer"].pool.disk.flush()
            stats0 = engines["restarted"].stats()
            row: dict = {"rep": rep}
            for side in rotate(["restarted", "cold"], rep):
                row[f"{side}_ttft_s"] = ttft(engines[side], prefix + suffix)
            stats = engines["restarted"].stats()
            blocks = stats["kv_disk_hit_blocks"] - stats0["kv_disk_hit_blocks"]
            row["disk_hit_blocks"] = blocks
            row["load_s"] = stats["kv_disk_load_seconds"] - stats0["kv_disk_load_seconds"]
            batch = [
                rng.integers(100, vocab - 100, size=args.prompt_len_overhead).tolist() for _ in range(args.requests)
            ]
            before = engines["restarted"].stats()
            for side in rotate(["restarted", "cold"], rep):
                t0 = time.perf_counter()
                row[f"{side}_tok_s"] = throughput(engines[side], batch, args.new_tokens, args.in_flight)
                row[f"{side}_wall_s"] = time.perf_counter() - t0
            engines["restarted"].pool.disk.flush()  # type: ignore[union-attr]
            after = engines["restarted"].stats()
            for key in ("kv_disk_copy_seconds", "kv_disk_writer_cpu_seconds", "kv_disk_written_blocks"):
                row[key] = after[key] - before[key]
            runs.append(row)
            print(row, file=sys.stderr)
        disk_stats = engines["restarted"].stats()
    finally:
        for e in engines.values():
            e.shutdown()
        shutil.rmtree(disk, ignore_errors=True)

    summary = {
        "model": args.model,
        "cold_ttft_ms": median(r["cold_ttft_s"] for r in runs) * 1e3,
        "disk_ttft_ms": median(r["restarted_ttft_s"] for r in runs) * 1e3,
        "ttft_ratio": median(r["restarted_ttft_s"] / r["cold_ttft_s"] for r in runs),
        "load_ms_per_block": median(r["load_s"] / max(1, r["disk_hit_blocks"]) for r in runs) * 1e3,
        "read_block_us": read_us,
        "off_tok_s": median(r["cold_tok_s"] for r in runs),
        "on_tok_s": median(r["restarted_tok_s"] for r in runs),
        "cost_pct": median((1 - r["restarted_tok_s"] / r["cold_tok_s"]) * 100 for r in runs),
        # load-independent: the tier's own time (the step's copies + the writer thread's CPU) per second of run
        "tier_cpu_pct": median(
            (r["kv_disk_copy_seconds"] + r["kv_disk_writer_cpu_seconds"]) / r["restarted_wall_s"] * 100 for r in runs
        ),
        "copy_us_per_block": median(r["kv_disk_copy_seconds"] / max(1, r["kv_disk_written_blocks"]) for r in runs)
        * 1e6,
        "writer_us_per_block": median(
            r["kv_disk_writer_cpu_seconds"] / max(1, r["kv_disk_written_blocks"]) for r in runs
        )
        * 1e6,
    }
    print_table(
        [summary],
        COLUMNS,
        title=f"disk tier: a {args.prefix_len}-token prefix after a restart (warm disk) vs cold prefill; tier on "
        f"but missing vs off ({args.requests} unique {args.prompt_len_overhead}-token prompts, {args.in_flight} in "
        f"flight); medians of {args.reps} interleaved repetitions",
    )
    save_results(args, "kv_disk", info, model_dir=str(path), runs=runs, summary=[summary], disk=disk_stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
