"""Reload time of a model loaded on demand: what a request to a model that keep_alive or the memory budget unloaded
waits for (Ollama's `load_duration`: the engine's load, compile and warm-up, measured engine-side), with the
OpenVINO compile cache off ("cold": every load compiles) and on ("cached": a cache dir a start-up filled). One
server per arm and run, started with `--keep-alive 0` so every request reloads the model; each server answers
`--loads` requests (a 1-token Ollama generate, after /api/ps shows the model unloaded), the median of which is the
run's number. Arms interleaved (the first rotates every run); medians of runs, and the median per-run ratio.

Two graph shapes, as bench/startup.py: the paged graph (CPU's default; the engine leaves the cache off there,
since OpenVINO cannot load its own blob of it on CPU, so the arms should match) and static shapes (`--static`,
what an NPU runs).

    python -m bench.reload [--model default-int4] [--runs 3] [--loads 4] [--shapes paged static] [--quick]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import requests
from tqdm import tqdm

from appliance.testing.loopback import ApplianceServer
from bench.common import arg_parser, finish, machine, median, model_dir, rotate

ARMS = ("cold", "cached")
NS = 1e9


COLUMNS = [
    ("shape", "graph", ""),
    ("cold", "cold load s", ".2f"),
    ("cached", "compile-cached load s", ".2f"),
    ("ratio", "cold / cached", ".2f"),
]


def unloaded(srv: ApplianceServer) -> bool:
    return not requests.get(srv.base + "/api/ps", timeout=30).json()["models"]


def load_seconds(path: Path, cache: str, shape: str, loads: int, log: Path) -> list[float]:
    """`loads` reloads on one server: each request's load_duration (seconds)."""
    args = ["--cache-dir", cache, "--keep-alive", "0"] + (["--static"] if shape == "static" else [])
    out = []
    with ApplianceServer(path, *args, log_path=log) as srv:
        name = srv.model_id()
        for _ in range(loads):
            deadline = time.monotonic() + 120
            while not unloaded(srv):
                if time.monotonic() > deadline:
                    raise RuntimeError("the model was not unloaded after its keep_alive 0 request")
                time.sleep(0.05)
            body = {"model": name, "prompt": "Hello", "stream": False, "options": {"num_predict": 1}}
            r = requests.post(srv.base + "/api/generate", json=body, timeout=600)
            r.raise_for_status()
            out.append(r.json()["load_duration"] / NS)
    return out


def main(argv=None) -> int:
    ap = arg_parser(
        __doc__, "reload", model="default-int4", prompt_len=None, new_tokens=None, quick={"runs": 1, "loads": 2}
    )
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--loads", type=int, default=4)
    ap.add_argument("--shapes", nargs="+", choices=("paged", "static"), default=["paged", "static"])
    args = ap.parse_args(argv)
    info, path = machine(), model_dir(args.model)
    work = Path(tempfile.mkdtemp(prefix="bench-reload-"))
    results = []
    try:
        with tqdm(total=len(args.shapes) * args.runs * len(ARMS), desc="reload", file=sys.stderr) as bar:
            for shape in args.shapes:
                cached = work / f"{shape}-cache"  # filled by the first cached server's start-up, kept after
                for rep in range(args.runs):
                    for position, arm in enumerate(rotate(ARMS, rep)):
                        bar.set_postfix_str(f"{shape} run {rep + 1} {arm}")
                        cache = "none" if arm == "cold" else str(cached)
                        seconds = load_seconds(path, cache, shape, args.loads, work / f"{shape}-{arm}-{rep}.log")
                        results.append(
                            {
                                "shape": shape,
                                "arm": arm,
                                "rep": rep,
                                "position": position,
                                "loads": seconds,
                                "seconds": median(seconds),
                            }
                        )
                        bar.update()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    summary = []
    for shape in args.shapes:
        mine = [r for r in results if r["shape"] == shape]
        row: dict = {"shape": shape}
        for arm in ARMS:
            row[arm] = median(r["seconds"] for r in mine if r["arm"] == arm)
        per_run = {(r["rep"], r["arm"]): r["seconds"] for r in mine}
        row["ratio"] = median(per_run[(k, "cold")] / per_run[(k, "cached")] for k in range(args.runs))
        summary.append(row)
    return finish(
        args,
        "reload",
        info,
        summary,
        COLUMNS,
        f"reload on demand (load_duration), {args.runs} interleaved runs x {args.loads} loads (medians)",
        model_dir=str(path),
        runs=results,
    )


if __name__ == "__main__":
    sys.exit(main())
