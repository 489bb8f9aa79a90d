"""Start-up time of `appliance serve` with the OpenVINO compile cache off, cold (an empty cache dir: compile and
write the blob) and warm (the blob a cold start wrote): process start to the first 200 of /v2/health/ready, which
includes the model load, its compile and the warm-up generation. Each run is a fresh server on loopback; the
three arms are interleaved (the arm that goes first rotates every run), medians and medians of per-run ratios.

Two graph shapes: the paged graph (CPU's default; OpenVINO cannot load its own blob of it on CPU, so the engine
leaves the cache off there: the three arms should match) and static shapes (`--static`, what an NPU runs).

    python -m bench.startup [--model default-fp16] [--runs 5] [--shapes paged static] [--quick]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from appliance.testing.loopback import ApplianceServer
from bench.common import arg_parser, finish, machine, median, model_dir, rotate

ARMS = ("off", "cold", "warm")


COLUMNS = [
    ("shape", "graph", ""),
    ("off", "no cache s", ".2f"),
    ("cold", "cold cache s", ".2f"),
    ("warm", "warm cache s", ".2f"),
    ("warm_vs_off", "off / warm", ".2f"),
    ("cold_vs_off", "off / cold", ".2f"),
    ("blob_mb", "blob MB", ".1f"),
]


def start_seconds(path: Path, cache: str, shape: str, log: Path) -> float:
    args = ["--cache-dir", cache] + (["--static"] if shape == "static" else [])
    began = time.monotonic()
    with ApplianceServer(path, *args, log_path=log) as srv:  # waits for /v2/health/ready, stops with SIGTERM
        ready = time.monotonic() - began
        srv.model_id()
    return ready


def main(argv=None) -> int:
    ap = arg_parser(__doc__, "startup", model="default-fp16", prompt_len=None, new_tokens=None, quick={"runs": 1})
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--shapes", nargs="+", choices=("paged", "static"), default=["paged", "static"])
    args = ap.parse_args(argv)
    info, path = machine(), model_dir(args.model)
    work = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    results = []
    try:
        with tqdm(total=len(args.shapes) * args.runs * len(ARMS), desc="startup", file=sys.stderr) as bar:
            for shape in args.shapes:
                for rep in range(args.runs):
                    warm = work / f"{shape}-warm"
                    if not warm.exists():  # the warm arm's blob, written by a start of its own
                        start_seconds(path, str(warm), shape, work / "prime.log")
                    for position, arm in enumerate(rotate(ARMS, rep)):
                        bar.set_postfix_str(f"{shape} run {rep + 1} {arm}")
                        cold = work / f"{shape}-cold-{rep}"
                        cache = {"off": "none", "cold": str(cold), "warm": str(warm)}[arm]
                        seconds = start_seconds(path, cache, shape, work / f"{shape}-{arm}-{rep}.log")
                        blob_mb = sum(f.stat().st_size for f in cold.rglob("*") if f.is_file()) / 2**20
                        shutil.rmtree(cold, ignore_errors=True)
                        results.append(
                            {"shape": shape, "arm": arm, "rep": rep, "position": position, "seconds": seconds}
                            | ({"blob_mb": blob_mb} if arm == "cold" else {})
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
        row["warm_vs_off"] = median(per_run[(k, "off")] / per_run[(k, "warm")] for k in range(args.runs))
        row["cold_vs_off"] = median(per_run[(k, "off")] / per_run[(k, "cold")] for k in range(args.runs))
        row["blob_mb"] = median(r["blob_mb"] for r in mine if "blob_mb" in r)
        summary.append(row)
    return finish(
        args,
        "startup",
        info,
        summary,
        COLUMNS,
        f"appliance serve start-up to ready, {args.runs} interleaved runs (medians; ratios: medians per run)",
        model_dir=str(path),
        runs=results,
    )


if __name__ == "__main__":
    sys.exit(main())
