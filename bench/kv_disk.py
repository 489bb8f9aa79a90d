"""The prefix cache's disk tier (appliance/runtime/kv_disk.py): what a warm disk buys after a restart, what it
buys for a working set of prefixes larger than the RAM pool, and what the tier costs when it never hits.

Restart (`--scenario restart`): each repetition draws a fresh random shared prefix (default 2,000 tokens).
Engine "writer" (tier on, directory D) computes it once and its writes are flushed; engine "restarted" (tier on,
the same D, its RAM has never seen the prefix: a restarted process) then serves prefix + a new suffix, loading the
prefix from disk; engine "cold" (tier off) serves the same prompt from scratch. TTFT = submit -> first token, one
request at a time; ratio = restarted / cold per repetition (paired), median.

Overhead (part of the restart scenario unless `--requests 0`): the same batch of unique random prompts (every
block missed and written through) on "restarted" (tier on) and "cold" (tier off), the order alternating per
repetition; throughput = tokens / wall, and the process CPU time per token (less sensitive than wall time to other
work on a shared box: the idle engine's threads sleep), and the tier's own time (the step's copies + the writer
thread's CPU).

Working set (`--scenario working-set`): two engines with the same small RAM pool (`--ws-ram-tokens`, default a
quarter of the working set), "ram" (tier off) and "disk" (tier on, a fresh directory). `--ws-prefixes` random
prefixes of `--ws-prefix-len` tokens are requested in a cycle (`--ws-cycles` times), each with a fresh 16-token
suffix, the same prompt to both engines back to back (the order alternating): LRU over a cycle longer than the
pool keeps nothing, so RAM alone never hits, and the disk tier serves every prefix after the first cycle. Hit rate
= cached prompt tokens / prompt tokens over the warm cycles (all but the first).

    python -m bench.kv_disk [--model default-fp16] [--scenario restart|working-set|all] [--prefix-len 2000]
                            [--reps 5] [--quick]
    python -m bench.kv_disk --model qwen2.5-1.5b --scenario restart --requests 0 --reps 3 --kv-cache-tokens 8192
                            [--cold-from-writer]

`--model qwen2.5-1.5b` (any bench.models family name) reads its existing `openvino-<--weight-format>` export
(int4 by default) under the data dir; it never builds one (python -m bench.models does).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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


@contextmanager
def scratch_engines(prefix: str) -> Iterator[tuple[str, dict]]:
    """A fresh disk-tier directory and a dict for the scenario's engines (by side); on the way out, however it
    ends (a failed load included), every engine in it is shut down and the directory removed."""
    disk = tempfile.mkdtemp(prefix=prefix)
    engines: dict = {}
    try:
        yield disk, engines
    finally:
        for e in engines.values():
            e.shutdown()
        shutil.rmtree(disk, ignore_errors=True)


def resolve_model(name: str, weight_format: str) -> Path:
    """A bench.models family name -> its existing export (never built here); anything else: bench.common's."""
    from appliance.manifest import MANIFEST_NAME
    from bench.models import FAMILIES, root

    if name in FAMILIES:
        path = root(name) / f"openvino-{weight_format}"
        if not (path / MANIFEST_NAME).is_file():
            raise SystemExit(f"{path} is not built: python -m bench.models --model {name} {weight_format}")
        return path
    return model_dir(name)


RESTART_COLUMNS = [
    ("model", "model", ""),
    ("cold_ttft_ms", "cold TTFT ms", ".0f"),
    ("disk_ttft_ms", "warm disk TTFT ms", ".0f"),
    ("ttft_ratio", "disk / cold", ".3f"),
    ("load_ms_per_block", "load ms/block", ".2f"),
    ("off_tok_s", "tier off tok/s", ".0f"),
    ("on_tok_s", "tier on, missing tok/s", ".0f"),
    ("cost_pct", "cost % (wall)", ".1f"),
    ("cpu_cost_pct", "cost % (CPU/token)", ".1f"),
    ("tier_cpu_pct", "tier CPU % of run", ".2f"),
    ("copy_us_per_block", "step copy us/block", ".0f"),
    ("writer_us_per_block", "writer CPU us/block", ".0f"),
]

WS_COLUMNS = [
    ("side", "side", ""),
    ("ram_pool_tokens", "RAM pool tokens", "d"),
    ("working_set_tokens", "working set tokens", "d"),
    ("hit_rate", "hit rate (warm cycles)", ".3f"),
    ("ttft_first_ms", "TTFT cycle 1 ms", ".0f"),
    ("ttft_warm_ms", "TTFT warm ms", ".0f"),
    ("ttft_vs_ram", "warm TTFT / RAM-only", ".3f"),
    ("disk_hit_blocks", "disk blocks loaded", "d"),
]


def restart_scenario(args, path: Path, vocab: int) -> tuple[dict, list[dict], dict]:
    from appliance.config import EngineConfig
    from bench.concurrency import load_engine

    pool = {"kv_cache_tokens": args.kv_cache_tokens} if args.kv_cache_tokens else {}
    runs = []
    with scratch_engines("kv-disk-bench-") as (disk, engines):
        engines["writer"] = load_engine(path, EngineConfig(kv_disk_dir=disk, **pool))
        engines["restarted"] = load_engine(path, EngineConfig(kv_disk_dir=disk, **pool))
        if not args.cold_from_writer:
            engines["cold"] = load_engine(path, EngineConfig(**pool))
        for rep in range(args.reps):
            rng = np.random.default_rng(900 + rep)
            prefix = rng.integers(100, vocab - 100, size=args.prefix_len).tolist()
            suffix = rng.integers(100, vocab - 100, size=16).tolist()
            row: dict = {"rep": rep}
            row["writer_ttft_s"] = ttft(engines["writer"], prefix + suffix[:8])
            assert engines["writer"].pool.disk is not None
            engines["writer"].pool.disk.flush(timeout=120)
            stats0 = engines["restarted"].stats()
            if args.cold_from_writer:  # the writer's prefill was the cold one
                row["cold_ttft_s"] = row["writer_ttft_s"]
                row["restarted_ttft_s"] = ttft(engines["restarted"], prefix + suffix)
            else:
                for side in rotate(["restarted", "cold"], rep):
                    row[f"{side}_ttft_s"] = ttft(engines[side], prefix + suffix)
            stats = engines["restarted"].stats()
            row["disk_hit_blocks"] = stats["kv_disk_hit_blocks"] - stats0["kv_disk_hit_blocks"]
            row["load_s"] = stats["kv_disk_load_seconds"] - stats0["kv_disk_load_seconds"]
            if args.requests and not args.cold_from_writer:
                batch = [
                    rng.integers(100, vocab - 100, size=args.prompt_len_overhead).tolist() for _ in range(args.requests)
                ]
                before = engines["restarted"].stats()
                for side in rotate(["restarted", "cold"], rep):
                    t0, c0 = time.perf_counter(), time.process_time()
                    row[f"{side}_tok_s"] = throughput(engines[side], batch, args.new_tokens, args.in_flight)
                    row[f"{side}_wall_s"] = time.perf_counter() - t0
                    row[f"{side}_cpu_s"] = time.process_time() - c0
                engines["restarted"].pool.disk.flush(timeout=120)  # type: ignore[union-attr]
                after = engines["restarted"].stats()
                for key in ("kv_disk_copy_seconds", "kv_disk_writer_cpu_seconds", "kv_disk_written_blocks"):
                    row[key] = after[key] - before[key]
            runs.append(row)
            print(row, file=sys.stderr)
        disk_stats = engines["restarted"].stats()

    summary = {
        "model": args.model,
        "prefix_len": args.prefix_len,
        "writer_ttft_ms": median(r["writer_ttft_s"] for r in runs) * 1e3,
        "cold_ttft_ms": median(r["cold_ttft_s"] for r in runs) * 1e3,
        "disk_ttft_ms": median(r["restarted_ttft_s"] for r in runs) * 1e3,
        "ttft_ratio": median(r["restarted_ttft_s"] / r["cold_ttft_s"] for r in runs),
        "ttft_ratios": [r["restarted_ttft_s"] / r["cold_ttft_s"] for r in runs],
        "load_ms_per_block": median(r["load_s"] / max(1, r["disk_hit_blocks"]) for r in runs) * 1e3,
        "disk_hit_blocks": median(r["disk_hit_blocks"] for r in runs),
    }
    if args.requests and not args.cold_from_writer:
        summary |= {
            "off_tok_s": median(r["cold_tok_s"] for r in runs),
            "on_tok_s": median(r["restarted_tok_s"] for r in runs),
            "cost_pct": median((1 - r["restarted_tok_s"] / r["cold_tok_s"]) * 100 for r in runs),
            # the same tokens on both sides: CPU seconds of the process per run, tier on / tier off
            "cpu_cost_pct": median((r["restarted_cpu_s"] / r["cold_cpu_s"] - 1) * 100 for r in runs),
            # load-independent: the tier's own time (the step's copies + the writer thread's CPU) per CPU second
            "tier_cpu_pct": median(
                (r["kv_disk_copy_seconds"] + r["kv_disk_writer_cpu_seconds"]) / r["restarted_cpu_s"] * 100 for r in runs
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
        RESTART_COLUMNS,
        title=f"disk tier: a {args.prefix_len}-token prefix after a restart (warm disk) vs cold prefill; tier on "
        f"but missing vs off ({args.requests} unique {args.prompt_len_overhead}-token prompts, {args.in_flight} in "
        f"flight); medians of {args.reps} interleaved repetitions",
    )
    return summary, runs, disk_stats


def working_set_scenario(args, path: Path, vocab: int) -> tuple[list[dict], list[dict], dict]:
    from appliance.config import EngineConfig
    from bench.concurrency import load_engine

    working_set = args.ws_prefixes * args.ws_prefix_len
    ram_tokens = args.ws_ram_tokens or working_set // 4
    rng = np.random.default_rng(4242)
    prefixes = [rng.integers(100, vocab - 100, size=args.ws_prefix_len).tolist() for _ in range(args.ws_prefixes)]
    runs = []
    with scratch_engines("kv-disk-ws-") as (disk, engines):
        engines["ram"] = load_engine(path, EngineConfig(kv_cache_tokens=ram_tokens))
        engines["disk"] = load_engine(path, EngineConfig(kv_cache_tokens=ram_tokens, kv_disk_dir=disk))
        for cycle in range(args.ws_cycles):
            for i, prefix in enumerate(prefixes):
                prompt = prefix + rng.integers(100, vocab - 100, size=16).tolist()
                row: dict = {"cycle": cycle, "prefix": i, "prompt_tokens": len(prompt)}
                for side in rotate(["ram", "disk"], cycle * len(prefixes) + i):
                    s0 = engines[side].stats()
                    row[f"{side}_ttft_s"] = ttft(engines[side], prompt)
                    s1 = engines[side].stats()
                    row[f"{side}_cached"] = s1["prefix_cache_hit_tokens"] - s0["prefix_cache_hit_tokens"]
                    row[f"{side}_disk_blocks"] = s1.get("kv_disk_hit_blocks", 0) - s0.get("kv_disk_hit_blocks", 0)
                runs.append(row)
                print(row, file=sys.stderr)
        disk_stats = engines["disk"].stats()

    warm = [r for r in runs if r["cycle"] > 0]
    first = [r for r in runs if r["cycle"] == 0]
    rows = []
    for side in ("ram", "disk"):
        rows.append(
            {
                "side": {"ram": "RAM only (tier off)", "disk": "RAM + disk tier"}[side],
                "ram_pool_tokens": ram_tokens,
                "working_set_tokens": working_set,
                "hit_rate": sum(r[f"{side}_cached"] for r in warm) / max(1, sum(r["prompt_tokens"] for r in warm)),
                "ttft_first_ms": median(r[f"{side}_ttft_s"] for r in first) * 1e3,
                "ttft_warm_ms": median(r[f"{side}_ttft_s"] for r in warm) * 1e3,
                "ttft_vs_ram": median(r[f"{side}_ttft_s"] / r["ram_ttft_s"] for r in warm),
                "disk_hit_blocks": sum(r[f"{side}_disk_blocks"] for r in runs),
            }
        )
    print_table(
        rows,
        WS_COLUMNS,
        title=f"disk tier: {args.ws_prefixes} prefixes of {args.ws_prefix_len} tokens cycled {args.ws_cycles} times "
        f"through a {ram_tokens}-token RAM pool ({working_set / ram_tokens:.1f}x); the same prompts to both sides, "
        "interleaved; warm = cycles after the first",
    )
    return rows, runs, disk_stats


def main(argv=None) -> int:
    ap = arg_parser(__doc__, "kv_disk", model="default-fp16", reps=5, prompt_len=None, new_tokens=16, quick={"reps": 2})
    ap.add_argument("--scenario", choices=("restart", "working-set", "all"), default="all")
    ap.add_argument("--weight-format", default="int4", help="the export of a bench.models family name")
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--requests", type=int, default=16, help="unique prompts of the overhead run (0: no run)")
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--prompt-len-overhead", type=int, default=512)
    ap.add_argument(
        "--cold-from-writer",
        action="store_true",
        help="no tier-off engine: the cold TTFT is the writer's (the same prefix, tier on and missing, an 8-token "
        "suffix), one cold prefill per repetition instead of two (for a model whose prefill takes minutes); "
        "no overhead run",
    )
    ap.add_argument("--kv-cache-tokens", type=int, default=None, help="the restart scenario's RAM pools (auto)")
    ap.add_argument("--ws-prefixes", type=int, default=8)
    ap.add_argument("--ws-prefix-len", type=int, default=1024)
    ap.add_argument("--ws-ram-tokens", type=int, default=None, help="default: a quarter of the working set")
    ap.add_argument("--ws-cycles", type=int, default=3)
    args = ap.parse_args(argv)

    from appliance.manifest import Manifest

    info = machine()
    path = resolve_model(args.model, args.weight_format)
    vocab = Manifest.load(path).vocab_size
    out: dict = {"model_dir": str(path)}
    if args.scenario in ("restart", "all"):
        summary, runs, disk_stats = restart_scenario(args, path, vocab)
        out |= {"summary": [summary], "runs": runs, "disk": disk_stats}
    if args.scenario in ("working-set", "all"):
        rows, runs, disk_stats = working_set_scenario(args, path, vocab)
        out |= {"working_set": rows, "working_set_runs": runs, "working_set_disk": disk_stats}
    save_results(args, "kv_disk", info, **out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
