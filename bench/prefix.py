"""Shared-prefix workload: time-to-first-token with prefix caching on vs off (our engine, same model).

Each repetition draws a fresh random common prefix (default 1,024 tokens) and N distinct random suffixes
(default 32 tokens); the N requests are submitted keeping a few in flight (a new one as soon as one finishes),
as a chat front-end with a long system prompt sees them. TTFT = submit -> first token. Two engines stay loaded
(EngineConfig(prefix_caching=True / False)) and alternate which goes first. Medians over repetitions of the
per-run median / p90.

    python -m bench.prefix [--model default-fp16] [--prefix-len 1024] [--suffix-len 32] [--requests 32]
                           [--in-flight 4] [--new-tokens 16] [--reps 3] [--quick]
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
from tqdm import tqdm

from bench.common import (
    arg_parser,
    machine,
    median,
    model_dir,
    paired_ratio,
    percentile,
    print_table,
    ratio,
    rotate,
    save_results,
)


def workload(vocab: int, prefix_len: int, suffix_len: int, n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(100, vocab - 100, size=prefix_len).tolist()
    return [prefix + rng.integers(100, vocab - 100, size=suffix_len).tolist() for _ in range(n)]


def run(engine, batch: list[list[int]], in_flight: int, new_tokens: int, bar=None) -> dict:
    """Submits `batch` keeping `in_flight` requests running; returns TTFT stats and prefix-cache hits."""
    from appliance.params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    slots = threading.Semaphore(in_flight)
    ttft: list[float] = [0.0] * len(batch)
    hits0 = engine.stats()["prefix_cache_hit_tokens"]

    def consume(i: int, t0: float, handle) -> None:
        try:
            for chunk in handle:
                if chunk.token_ids and not ttft[i]:
                    ttft[i] = time.perf_counter() - t0
        finally:
            slots.release()
            if bar is not None:
                bar.update()

    start = time.perf_counter()
    threads = []
    for i, p in enumerate(batch):
        slots.acquire()
        t0 = time.perf_counter()
        t = threading.Thread(target=consume, args=(i, t0, engine.submit(p, params)), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    hits = engine.stats()["prefix_cache_hit_tokens"] - hits0
    return {
        "ttft_median_s": median(ttft),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_first_s": ttft[0],
        "wall_s": wall,
        "cache_hit_tokens": hits,
        "prompt_tokens": sum(map(len, batch)),
    }


COLUMNS = [
    ("model", "model", ""),
    ("on_ttft_ms", "cache on TTFT ms", ".0f"),
    ("off_ttft_ms", "cache off TTFT ms", ".0f"),
    ("ttft_speedup", "speedup", ".2f"),
    ("on_p90_ms", "on p90 ms", ".0f"),
    ("off_p90_ms", "off p90 ms", ".0f"),
    ("p90_speedup", "p90 speedup", ".2f"),
    ("hit_rate", "hit rate", ".2f"),
    ("wall_speedup", "wall speedup", ".2f"),
]


def main(argv=None) -> int:
    ap = arg_parser(__doc__, "prefix", model="default-fp16", reps=3, prompt_len=None, new_tokens=16, quick={"reps": 1})
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--in-flight", type=int, default=4)
    args = ap.parse_args(argv)

    from appliance.config import EngineConfig
    from appliance.manifest import Manifest
    from bench.concurrency import load_engine

    info = machine()
    path = model_dir(args.model)
    vocab = Manifest.load(path).vocab_size
    engines = {
        "on": load_engine(path, EngineConfig(prefix_caching=True)),
        "off": load_engine(path, EngineConfig(prefix_caching=False)),
    }
    runs = []
    try:
        with tqdm(total=2 * args.reps * args.requests, desc="prefix", file=sys.stderr, leave=False) as bar:
            for rep in range(args.reps):
                batch = workload(vocab, args.prefix_len, args.suffix_len, args.requests, seed=500 + rep)
                order = rotate(["on", "off"], rep)
                for mode in order:
                    bar.set_postfix_str(f"rep {rep + 1} caching {mode}")
                    runs.append(
                        {
                            "caching": mode,
                            "rep": rep,
                            "first": mode == order[0],
                            **run(engines[mode], batch, args.in_flight, args.new_tokens, bar),
                        }
                    )
    finally:
        for e in engines.values():
            e.shutdown()

    def med(mode: str, key: str) -> float:
        return median(r[key] for r in runs if r["caching"] == mode)

    row = {
        "model": args.model,
        "on_ttft_ms": med("on", "ttft_median_s") * 1e3,
        "off_ttft_ms": med("off", "ttft_median_s") * 1e3,
        "on_p90_ms": med("on", "ttft_p90_s") * 1e3,
        "off_p90_ms": med("off", "ttft_p90_s") * 1e3,
        "hit_rate": med("on", "cache_hit_tokens") / med("on", "prompt_tokens"),
        "wall_speedup": ratio(med("off", "wall_s"), med("on", "wall_s")),
    }
    for key, col in (("ttft_median_s", "ttft_speedup"), ("ttft_p90_s", "p90_speedup")):
        row[col] = paired_ratio(runs, key, "off", "on", side="caching")  # same workload, back to back
    print_table(
        [row],
        COLUMNS,
        title=f"shared {args.prefix_len}-token prefix + {args.suffix_len}-token suffixes, "
        f"{args.requests} requests, {args.in_flight} in flight "
        "(speedup = median of per-repetition off / on, higher is better)",
    )
    save_results(args, "prefix", info, model_dir=str(path), runs=runs, summary=[row])
    return 0


if __name__ == "__main__":
    sys.exit(main())
