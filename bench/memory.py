"""Server memory: RSS and PSS summed over `appliance serve`'s process tree (engine, gunicorn arbiter, workers),
idle and under load, with 1 and 4 HTTP workers.

RSS from /proc/PID/status counts shared pages once per process (an upper bound for the tree), PSS from
/proc/PID/smaps_rollup splits them (the honest sum). "idle" is a few seconds after readiness; "load" samples
every 0.2 s while C streaming clients (random token-id prompts, `ignore_eos`) run, repeated `--rounds`
times, and keeps the peak of each sum; `hwm` is the sum of the processes' own RSS high-water marks (VmHWM).

    python -m bench.memory [--model default-fp16] [--workers 1 4] [--concurrency 16] [--rounds 2] [--quick]
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from tqdm import tqdm

from bench.common import (
    LOGS,
    ServerProcess,
    arg_parser,
    machine,
    memory_snapshot,
    model_dir,
    print_table,
    prompts,
    save_results,
)


def _sums(snap: dict[int, dict]) -> dict:
    out = {
        "rss_mb": sum(p["rss_kb"] for p in snap.values()) / 1024,
        "pss_mb": sum(p["pss_kb"] for p in snap.values()) / 1024,
        "hwm_mb": sum(p["hwm_kb"] for p in snap.values()) / 1024,
        "processes": len(snap),
    }
    for role in ("engine", "arbiter", "worker"):
        mine = [p for p in snap.values() if p["name"] == role]
        if mine:
            out[f"{role}_rss_mb"] = max(p["rss_kb"] for p in mine) / 1024  # per process (the largest worker)
            out[f"{role}_pss_mb"] = max(p["pss_kb"] for p in mine) / 1024
    return out


class Sampler(threading.Thread):
    """Peak of the tree's summed RSS and PSS, sampled every `period` seconds."""

    def __init__(self, pid: int, period: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.period = pid, period
        self.peak: dict = {}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            s = _sums(memory_snapshot(self.pid))
            for k, v in s.items():
                self.peak[k] = max(self.peak.get(k, 0), v)
            self._halt.wait(self.period)

    def stop(self) -> dict:
        self._halt.set()
        self.join()
        return self.peak


def measure(
    path: Path, workers: int, concurrency: int, rounds: int, prompt_len: int, new_tokens: int, log_path: Path, bar
) -> dict:
    from appliance.manifest import Manifest
    from bench.client import http_run

    vocab = Manifest.load(path).vocab_size
    with ServerProcess(path, "--workers", str(workers), "--log-level", "warning", log_path=log_path) as srv:
        model = srv.model_id()
        time.sleep(3)
        idle = _sums(memory_snapshot(srv.pid))
        bar.update()
        sampler = Sampler(srv.pid)
        sampler.start()
        for r in range(rounds):
            http_run(srv.base, model, prompts(vocab, concurrency, prompt_len, 900 + r), new_tokens)
            bar.update()
        peak = sampler.stop()
        after = _sums(memory_snapshot(srv.pid))
    return {"workers": workers, "idle": idle, "load_peak": peak, "after_load": after}


COLUMNS = [
    ("workers", "workers", "d"),
    ("idle_rss", "idle RSS MB", ".0f"),
    ("idle_pss", "idle PSS MB", ".0f"),
    ("peak_rss", "load peak RSS MB", ".0f"),
    ("peak_pss", "load peak PSS MB", ".0f"),
    ("hwm", "sum VmHWM MB", ".0f"),
    ("engine_rss", "engine RSS MB", ".0f"),
    ("worker_rss", "worker RSS MB", ".0f"),
    ("worker_pss", "worker PSS MB", ".0f"),
]


def main(argv=None) -> int:
    ap = arg_parser(__doc__, "memory", model="default-fp16", quick={"rounds": 1})
    ap.add_argument("--workers", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)

    info = machine()
    path = model_dir(args.model)
    results = []
    with tqdm(total=len(args.workers) * (1 + args.rounds), desc="memory", file=sys.stderr, leave=False) as bar:
        for w in args.workers:
            bar.set_postfix_str(f"{w} worker(s)")
            results.append(
                measure(
                    path,
                    w,
                    args.concurrency,
                    args.rounds,
                    args.prompt_len,
                    args.new_tokens,
                    LOGS / f"memory-serve-{w}.log",
                    bar,
                )
            )
    rows = [
        {
            "workers": r["workers"],
            "idle_rss": r["idle"]["rss_mb"],
            "idle_pss": r["idle"]["pss_mb"],
            "peak_rss": r["load_peak"]["rss_mb"],
            "peak_pss": r["load_peak"]["pss_mb"],
            "hwm": r["after_load"]["hwm_mb"],
            "engine_rss": r["load_peak"].get("engine_rss_mb"),
            "worker_rss": r["load_peak"].get("worker_rss_mb"),
            "worker_pss": r["load_peak"].get("worker_pss_mb"),
        }
        for r in results
    ]
    print_table(
        rows,
        COLUMNS,
        title=f"appliance serve memory, {args.model}, sums over the process tree; load = "
        f"{args.concurrency} concurrent streams x {args.rounds} round(s)",
    )
    save_results(args, "memory", info, model_dir=str(path), results=results, summary=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
