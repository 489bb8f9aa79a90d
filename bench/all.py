"""Every benchmark, one after the other (each in its own process, so none inherits another's memory or threads),
then the issue's targets checked against the results: met / NOT met, written to bench/results/summary.json.

    python -m bench.all            # the full set (~45 min on a busy 2-vCPU box)
    python -m bench.all --quick    # default fp16 model only, 1-3 repetitions (~4 min): a smoke run
    python -m bench.all --only concurrency prefix
    python -m bench.all --targets-only   # re-check the targets against the JSON already in bench/results/
    python -m bench.all --llamacpp-python /tmp/llama-venv/bin/python   # bench.http with llama.cpp's server too
    python -m bench.all --only vlm   # images: not in the default set (it builds a 2B model on first use)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.common import RESULTS, machine, print_table, write_json

BENCHMARKS = ("batch1_paired", "concurrency", "prefix", "http", "memory", "startup")
OPTIONAL = ("vlm",)  # run only when named in --only


def command(name: str, quick: bool, out_dir: Path = RESULTS, llamacpp_python: str | None = None) -> list[str]:
    extra = ["--llamacpp-python", llamacpp_python] if name == "http" and llamacpp_python else []
    return [
        sys.executable,
        "-m",
        f"bench.{name}",
        *(["--quick"] if quick else []),
        *extra,
        "--out",
        str(out_dir / f"{name}.json"),
    ]


def _load(name: str, out_dir: Path = RESULTS) -> dict | None:
    path = out_dir / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def targets(out_dir: Path = RESULTS) -> list[dict]:
    """One row per (target, case): the measured ratio, the bound, met or not."""
    rows = []

    def add(target: str, case: str, value: float, bound: float, higher_is_better: bool) -> None:
        met = value >= bound if higher_is_better else value <= bound
        rows.append(
            {
                "target": target,
                "case": case,
                "value": value,
                "bound": f"{'>=' if higher_is_better else '<='} {bound:g}",
                "met": "yes" if met else "NO",
            }
        )

    if (b := _load("batch1_paired", out_dir)) is not None:
        for t in b["summary"]:
            add("batch-1 decode vs LLMPipeline", f"{t['model']} (paired)", t["decode_ratio"], 1.0, True)
            add("batch-1 TTFT vs LLMPipeline", f"{t['model']} (paired)", t["ttft_ratio"], 1.1, False)
            if "decode_ratio_own" in t:  # the same runs, LLMPipeline by its own perf counters
                add("batch-1 decode vs LLMPipeline", f"{t['model']} (genai's timers)", t["decode_ratio_own"], 1.0, True)
                add("batch-1 TTFT vs LLMPipeline", f"{t['model']} (genai's timers)", t["ttft_ratio_own"], 1.1, False)
    if (c := _load("concurrency", out_dir)) is not None:
        for t in c["summary"]:
            if t["concurrency"] in (8, 16):
                add(
                    "aggregate tok/s vs ContinuousBatchingPipeline",
                    f"{t['model']} c={t['concurrency']}",
                    t["tok_s_ratio"],
                    1.0,
                    True,
                )
    if (h := _load("http", out_dir)) is not None:
        for t in h["summary"]:
            where = f"{t['model']} c={t['concurrency']}"
            if "tok_s_ratio" in t:  # the first model's rows: the in-process engine ran beside it
                add("HTTP streaming tok/s vs engine", where, t["tok_s_ratio"], 0.9, True)
            if (
                "tok_s_ratio_llamacpp" in t
            ):  # the targets vs llama.cpp: batch 1 >= 1.0x, TTFT <= 0.5x, 8 concurrent >= 3x
                if t["concurrency"] == 1:
                    add("HTTP tok/s vs llama.cpp's server", where, t["tok_s_ratio_llamacpp"], 1.0, True)
                    add("HTTP TTFT vs llama.cpp's server", where, t["ttft_ratio_llamacpp"], 0.5, False)
                elif t["concurrency"] == 8:
                    add("HTTP tok/s vs llama.cpp's server", where, t["tok_s_ratio_llamacpp"], 3.0, True)
    if (p := _load("prefix", out_dir)) is not None:
        for t in p["summary"]:
            add("shared-prefix TTFT speedup (cache on)", f"{t['model']} median", t["ttft_speedup"], 3.0, True)
    if (v := _load("vlm", out_dir)) is not None:
        for t in v["summary"]:
            if t.get("ttft_speedup") is not None:
                add("VLM TTFT vs genai (genai / ours)", t["cell"], t["ttft_speedup"], 1.0, True)
                add("VLM decode tok/s vs genai", t["cell"], t["decode_ratio"], 1.0, True)
            if t.get("ours_repeat_ratio") is not None:
                add("VLM repeated picture's TTFT / its first", "c=1", t["ours_repeat_ratio"], 0.3, False)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="+", choices=BENCHMARKS + OPTIONAL, default=list(BENCHMARKS))
    ap.add_argument("--targets-only", action="store_true")
    ap.add_argument("--out-dir", type=Path, default=RESULTS, help="where the JSON goes (default bench/results)")
    ap.add_argument(
        "--llamacpp-python",
        metavar="PATH",
        help="passed to bench.http: a python with "
        "llama-cpp-python[server] (requirements/llamacpp.txt) to compare with llama.cpp's server",
    )
    args = ap.parse_args(argv)

    failed, timings = [], {}
    if not args.targets_only:
        for name in args.only:
            cmd = command(name, args.quick, args.out_dir, args.llamacpp_python)
            print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
            t0 = time.monotonic()
            code = subprocess.run(cmd).returncode
            timings[name] = round(time.monotonic() - t0)
            if code:
                failed.append(name)
                print(f"=== {name} failed with exit code {code}", flush=True)
    print()
    rows = targets(args.out_dir)
    print_table(
        rows,
        [
            ("target", "target", ""),
            ("case", "case", ""),
            ("value", "measured", ".2f"),
            ("bound", "target", ""),
            ("met", "met", ""),
        ],
        title="issue targets",
    )
    write_json(
        args.out_dir / "summary.json",
        {
            "quick": args.quick,
            "ran": args.only if not args.targets_only else [],
            "seconds": timings,
            "failed": failed,
            "machine": machine(),
            "targets": rows,
        },
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
