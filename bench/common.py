"""Helpers shared by the benchmarks: command-line options, prompts, statistics, paired runs, tables, the results
JSON, `appliance serve` as a subprocess (appliance.testing.loopback's harness) and /proc memory and CPU readings.

Every benchmark compares two things measured in the same run on the same IR, alternating which goes first, and
reports medians over repetitions: the machine is shared and noisy, so read the ratios, not the absolutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from appliance import cpu_isa
from appliance.testing import procinfo
from appliance.testing.loopback import ApplianceServer
from appliance.testing.procinfo import process_tree, status_field

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
LOGS = Path(tempfile.gettempdir()) / "appliance-bench"  # server logs: not results
CONCURRENCY = (1, 4, 8, 16)


# ---------------------------------------------------------------- workload


def prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    """`n` random-token prompts: nothing is shared between them or with any earlier run (no cache helps)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab - 100, size=length).tolist() for _ in range(n)]


# ---------------------------------------------------------------- statistics


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def percentile(values: Iterable[float], q: float) -> float:
    values = list(values)
    return float(np.percentile(values, q)) if values else float("nan")


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def paired_ratio(
    runs: list[dict], key: str, a: str, b: str, *, b_key: str | None = None, side: str = "impl", **match
) -> float:
    """Median over repetitions of run[a][key] / run[b][b_key or key], pairing the two runs of the same repetition
    (they ran back to back, so slow drifts of the machine's load cancel better than in a ratio of medians).
    `side`: the run field that names a and b."""
    by_rep: dict = {}
    for r in runs:
        if all(r[k] == v for k, v in match.items()):
            by_rep.setdefault(r["rep"], {})[r[side]] = r
    return median(ratio(p[a][key], p[b][b_key or key]) for p in by_rep.values() if a in p and b in p)


# ---------------------------------------------------------------- output


def print_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]], title: str | None = None) -> str:
    """columns: (key, header, format spec). Prints and returns the table (its header alone when there are no rows:
    e.g. bench.deployed's batch-1 limits in a run without concurrency 1)."""
    widths = [
        max([len(h)] + [len(format(r.get(k, ""), f) if r.get(k) is not None else "-") for r in rows])
        for k, h, f in columns
    ]
    lines = [title] if title else []
    lines.append("  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths)))
    for r in rows:
        cells = []
        for (k, _, f), w in zip(columns, widths):
            v = r.get(k)
            cells.append((format(v, f) if v is not None else "-").rjust(w))
        lines.append("  ".join(cells))
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def machine() -> dict:
    """What the numbers were measured on, and what else was eating CPU (the load caveat). `isa`: the vector
    extensions our engine's kernels may use (appliance.cpu_isa: the CPU's flags under the
    ONEDNN_MAX_CPU_ISA cap, `isa_cap`, when --isa-cap or the environment sets one)."""
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        cpu = platform.processor()
    versions = {}
    for mod in ("openvino", "openvino_genai"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # not installed: the benchmark that needs it fails on its own
            pass
    isa = cpu_isa.detect()
    return {
        "cpu": cpu,
        "isa": isa.name,
        "isa_flags": list(isa.flags),
        "isa_cap": isa.cap,
        "nproc": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "python": platform.python_version(),
        "versions": versions,
        "code": code_state(),
        "busy_processes": busy_processes(),
    }


def code_state() -> dict:
    """The commit measured, and which runtime files differed from it (read-only git calls)."""

    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
            return done.stdout.rstrip("\n")
        except (OSError, subprocess.SubprocessError):
            return ""

    changed = [line[3:] for line in git("status", "--porcelain", "--", "appliance", "export").splitlines()]
    return {"commit": git("rev-parse", "--short", "HEAD"), "uncommitted_runtime_files": changed}


def busy_processes(sample_s: float = 0.5, min_pct: float = 10.0) -> list[dict]:
    """Other processes using >= min_pct of a CPU over a short sample (not us, not our children)."""

    def ticks() -> dict[int, tuple[float, str]]:
        out = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                seconds = procinfo.cpu_seconds(int(entry))
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            out[int(entry)] = (seconds, cmd.strip()[:120])
        return out

    a = ticks()
    time.sleep(sample_s)
    b = ticks()
    mine = set(process_tree(os.getpid()))
    busy = []
    for pid, (t, cmd) in b.items():
        if pid in mine or pid not in a:
            continue
        pct = 100 * (t - a[pid][0]) / sample_s
        if pct >= min_pct:
            busy.append({"pid": pid, "cpu_pct": round(pct), "cmd": cmd})
    return sorted(busy, key=lambda p: -p["cpu_pct"])


def write_json(path: Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")
    print(f"wrote {path}", flush=True)
    return path


def _jsonable(value: Any):
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    return str(value)


def save_results(args, benchmark: str, machine_before: dict, **payload) -> Path:
    """args.out <- {benchmark, args, machine_before, machine_after (now), **payload}: every benchmark's JSON."""
    return write_json(
        args.out,
        {
            "benchmark": benchmark,
            "args": vars(args),
            "machine_before": machine_before,
            "machine_after": machine(),
            **payload,
        },
    )


def finish(
    args,
    benchmark: str,
    machine_before: dict,
    summary: list[dict],
    columns: Sequence[tuple[str, str, str]] | None = None,
    title: str | None = None,
    **payload,
) -> int:
    """The end of a benchmark's main: its summary rows printed as a table (with `columns`; a benchmark that printed
    its own tables passes none) and saved after the payload (save_results); main's exit status, 0."""
    if columns is not None:
        print_table(summary, columns, title=title)
    save_results(args, benchmark, machine_before, **payload, summary=summary)
    return 0


# ---------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    """parse_args() applies `quick_sets` (option dest -> value) when --quick is given."""

    quick_sets: dict = {}

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        if getattr(parsed, "quick", False):
            vars(parsed).update(self.quick_sets)
        return parsed


def arg_parser(
    doc: str,
    out_name: str,
    *,
    model: str | None = None,
    models: Sequence[str] | None = None,
    levels: bool = False,
    reps: int | None = None,
    prompt_len: int | None = 128,
    new_tokens: int | None = 128,
    quick: dict | None = None,
) -> argparse.ArgumentParser:
    """The options the benchmarks share, each only where asked for: --model (one, default `model`) or --models
    (several), --concurrency (the levels swept), --reps, --prompt-len / --new-tokens (the workload), --quick (sets
    the options in `quick`, {dest: value}, over whatever was given; parse_args() applies it), and always --out
    (default bench/results/<out_name>.json). The caller adds its own options. `doc`: the module's docstring (its
    first paragraph is the description)."""
    ap = _Parser(description=" ".join(doc.strip().split("\n\n")[0].split()))
    if model is not None:
        ap.add_argument("--model", default=model, help=f"{', '.join(MODEL_CHOICES)} or an export directory")
    if models is not None:
        ap.add_argument(
            "--models", nargs="+", default=list(models), help=f"{', '.join(MODEL_CHOICES)} or export directories"
        )
    if levels:
        ap.add_argument("--concurrency", nargs="+", type=int, default=list(CONCURRENCY))
    if reps is not None:
        ap.add_argument("--reps", type=int, default=reps)
    if prompt_len is not None:
        ap.add_argument("--prompt-len", type=int, default=prompt_len)
    if new_tokens is not None:
        ap.add_argument("--new-tokens", type=int, default=new_tokens)
    if quick is not None:
        ap.quick_sets = quick
        ap.add_argument(
            "--quick",
            action="store_true",
            help="a smoke run: "
            + ", ".join(
                f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                for k, v in quick.items()
            ),
        )
    ap.add_argument("--out", type=Path, default=RESULTS / f"{out_name}.json")
    return ap


# oneDNN's ISA names (ONEDNN_MAX_CPU_ISA), lowest first; ALL lifts the cap.
ISA_CAPS = (*cpu_isa.LEVELS, "ALL")


class _IsaCap(argparse.Action):
    """Sets ONEDNN_MAX_CPU_ISA while the command line is parsed: before openvino compiles anything in this process
    and before any server starts (ServerProcess passes os.environ on to `appliance serve`)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        os.environ[cpu_isa.CAP_ENV] = str(values)
        setattr(namespace, self.dest, values)


def isa_cap_option(ap: argparse.ArgumentParser) -> None:
    """--isa-cap NAME, for the benchmarks that run our engine: caps the CPU plugin's oneDNN kernels at that ISA
    (AVX2 approximates an AVX2-only box on an AVX-512 one; appliance.cpu_isa derives the properties)."""
    ap.add_argument(
        "--isa-cap",
        type=str.upper,
        choices=ISA_CAPS,
        action=_IsaCap,
        metavar="ISA",
        help=f"set {cpu_isa.CAP_ENV} for our engine and servers: {', '.join(ISA_CAPS)} (e.g. AVX2)",
    )


# ---------------------------------------------------------------- paired runs


def rotate(sides: Sequence, k: int) -> list:
    """`sides` rotated by k: with the run index as k, each side goes first in turn (for two sides: alternating)."""
    k %= len(sides)
    return list(sides[k:]) + list(sides[:k])


def side_medians(
    runs: list[dict], side: str, rates: Iterable[str] = ("tok_s",), seconds: Iterable[str] = ("ttft_s",), **match
) -> dict:
    """Medians over the runs of `side` matching `match`: `<side>_<key>` for each key of `rates`, and
    `<side>_<key less _s>_ms` (in milliseconds) for each key of `seconds`."""
    mine = [r for r in runs if r["impl"] == side and all(r[k] == v for k, v in match.items())]
    out = {f"{side}_{key}": median(r[key] for r in mine) for key in rates}
    out.update({f"{side}_{key[:-2]}_ms": median(r[key] for r in mine) * 1e3 for key in seconds})
    return out


# ---------------------------------------------------------------- processes and memory (/proc)
# process_tree / status_field: appliance.testing.procinfo (shared with tests/conftest.py).


def pss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    raise KeyError(f"no Pss in /proc/{pid}/smaps_rollup")


def memory_snapshot(root_pid: int) -> dict[int, dict]:
    """{pid: {rss_kb, pss_kb, hwm_kb, name}} for the process tree under root_pid (vanished processes skipped)."""
    snap = {}
    for pid in process_tree(root_pid):
        try:
            snap[pid] = {
                "rss_kb": status_field(pid, "VmRSS"),
                "hwm_kb": status_field(pid, "VmHWM"),
                "pss_kb": pss_kb(pid),
                "name": _role(pid, root_pid),
            }
        except (OSError, KeyError):
            continue
    return snap


def cpu_seconds(root_pid: int) -> dict[str, float]:
    """User + system CPU seconds so far of the process tree under root_pid, by role (engine/arbiter/worker)."""
    out: dict[str, float] = {}
    for pid in process_tree(root_pid):
        try:
            seconds = procinfo.cpu_seconds(pid)
        except OSError:
            continue
        role = _role(pid, root_pid)
        out[role] = out.get(role, 0.0) + seconds
    return out


def _role(pid: int, root_pid: int) -> str:
    if pid == root_pid:
        return "engine"
    try:
        ppid = procinfo.parent(pid)
    except OSError:
        return "?"
    return "arbiter" if ppid == root_pid else "worker"


# ---------------------------------------------------------------- the real server


class ServerProcess(ApplianceServer):
    """`appliance serve` on loopback (this checkout's code), its log under LOGS unless given."""

    def __init__(self, model_dir: Path, *args: str, log_path: Path | None = None, start_timeout: float = 300):
        super().__init__(
            model_dir, *args, log_path=log_path or LOGS / f"serve-{time.time_ns()}.log", start_timeout=start_timeout
        )


# ---------------------------------------------------------------- model selection

MODEL_CHOICES = ("default-fp16", "default-int8", "random250m-fp16", "random250m-int8")


def model_dir(name: str) -> Path:
    """`default-<fmt>`: the default model's export; `random250m-<fmt>`: the random-weight ~250M Llama;
    anything else: a path to an exported model directory."""
    if name.startswith("default-"):
        from export.default_model import ensure_export

        return ensure_export("openvino", name.split("-", 1)[1])
    if name.startswith("random250m-"):
        from bench.models import ensure_random_llama

        return ensure_random_llama(name.split("-", 1)[1])
    path = Path(name).expanduser()
    if not path.is_dir():
        raise SystemExit(f"unknown model {name!r}: choose from {', '.join(MODEL_CHOICES)} or give a directory")
    return path
