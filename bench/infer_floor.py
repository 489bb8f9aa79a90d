"""The time inside OpenVINO's infer() outside any node, isolated: a decode step's infer request replayed with the same
bound inputs (no Python scheduler, sampler or input arrays between calls: only `start_async(); wait()`), its wall
time against the sum of the CPU plugin's node times (PERF_COUNT) over the same calls. What is left, `outside`, is
the plugin's executor per inference (per-node dynamic-shape checks and parameter updates, memory and thread
synchronisation between nodes, the async request's own hand-off), divided by the number of executed nodes to give
a per-node cost: if it holds across models of different sizes but similar depth, it is OpenVINO's floor, not ours.

Variants are compile properties (bench.profile's --variant NAME:KEY=VALUE,...), e.g. one thread (no barrier
between the two threads after every node) or a larger runtime cache. Replays are interleaved across variants.

    python -m bench.infer_floor MODEL [MODEL ...] [--variant t1:INFERENCE_NUM_THREADS=1] [--calls 50] [--reps 3]
"""

from __future__ import annotations

import sys
import time
from typing import Any

from bench.common import arg_parser, finish, machine, median, model_dir, prompts, rotate
from bench.profile import load, parse_variant

COLUMNS = [
    ("model", "model", ""),
    ("variant", "variant", ""),
    ("infer_ms", "infer ms", ".2f"),
    ("nodes_ms", "nodes ms", ".2f"),
    ("outside_ms", "outside ms", ".2f"),
    ("nodes_ran", "nodes", ".0f"),
    ("us_per_node", "us/node outside", ".2f"),
]


def node_total_us(request) -> tuple[float, int]:
    """(sum over nodes of average us x 1, nodes that ran) from the profiling info (averages since compilation)."""
    info = request.profiling_info
    ran = [p for p in info if p.real_time.total_seconds() > 0]
    return sum(p.real_time.total_seconds() * 1e6 for p in info), len(ran)


def replay(engine, calls: int) -> dict:
    """`calls` replays of the request's last inference (its inputs are still bound)."""
    request = engine.backend.request
    infers0 = engine.backend._floor_infers
    before, _ = node_total_us(request)
    t0 = time.perf_counter()
    for _ in range(calls):
        request.start_async()
        request.wait()
    wall_ms = (time.perf_counter() - t0) * 1e3 / calls
    after, ran = node_total_us(request)
    # averages since compilation: total after = avg_after x (n0 + calls); before = avg_before x n0
    n0 = infers0
    nodes_ms = (after * (n0 + calls) - before * n0) / 1e3 / calls
    engine.backend._floor_infers = n0 + calls
    return {"infer_ms": wall_ms, "nodes_ms": nodes_ms, "outside_ms": wall_ms - nodes_ms, "nodes_ran": ran}


def main(argv=None) -> int:
    ap = arg_parser(__doc__, "infer_floor", reps=3, new_tokens=None)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--variant", action="append", default=[])
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args(argv)

    from appliance.manifest import Manifest
    from appliance.params import SamplingParams

    info = machine()
    variants = [parse_variant(v) for v in args.variant] or [("base", {})]
    configs = [(m, v) for m in args.models for v, _ in variants]
    loaded: dict[tuple[str, str], Any] = {}
    results: dict[tuple[str, str], list[dict]] = {c: [] for c in configs}
    try:
        for m, v in configs:
            engine, rec, props = load(model_dir(m), "default", dict(variants)[v])
            vocab = Manifest.load(model_dir(m)).vocab_size
            # one request: prefill + a few decode steps; the request's inputs are then a decode step's
            engine.generate(prompts(vocab, 1, args.prompt_len, 5)[0], SamplingParams(max_tokens=8, ignore_eos=True))
            engine.backend._floor_infers = rec.infers
            loaded[(m, v)] = (engine, props)
        for rep in range(args.reps):
            for c in rotate(configs, rep):
                time.sleep(0.2)
                results[c].append(replay(loaded[c][0], args.calls))
    finally:
        for engine, _ in loaded.values():
            engine.shutdown()
    rows = []
    for m, v in configs:
        rs = results[(m, v)]
        row = {"model": m.rstrip("/").split("/")[-2] + "/" + m.rstrip("/").split("/")[-1] if "/" in m else m}
        row["variant"] = v
        for k in ("infer_ms", "nodes_ms", "outside_ms", "nodes_ran"):
            row[k] = median(r[k] for r in rs)
        row["us_per_node"] = row["outside_ms"] * 1e3 / row["nodes_ran"] if row["nodes_ran"] else 0.0
        rows.append(row)
    for v, props in variants:
        print(f"variant {v}: {props or 'engine defaults'}")
    return finish(
        args,
        "infer_floor",
        info,
        rows,
        COLUMNS,
        f"a decode step's infer replayed ({args.calls} calls x {args.reps} reps, medians)",
        runs={f"{m} {v}": results[(m, v)] for m, v in configs},
    )


if __name__ == "__main__":
    sys.exit(main())
