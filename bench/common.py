"""Helpers shared by the benchmarks: prompts, the genai side's settings, statistics, tables, JSON, a server
subprocess and /proc memory readings.

Every benchmark compares two things measured in the same run on the same IR, alternating which goes first, and
reports medians over repetitions: the machine is shared and noisy, so read the ratios, not the absolutes.
"""
from __future__ import annotations

import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
LOGS = Path(tempfile.gettempdir()) / "appliance-bench"     # server logs: not results
CONCURRENCY = (1, 4, 8, 16)


# ---------------------------------------------------------------- workload

def prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    """`n` random-token prompts: nothing is shared between them or with any earlier run (no cache helps)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab - 100, size=length).tolist() for _ in range(n)]


def engine_properties(config=None) -> dict:
    """The OpenVINO compile properties our engine uses for `config` (default: EngineConfig()), to give the
    openvino_genai pipelines the same ones (same inference precision, KV precision and hint)."""
    from appliance.backends.openvino_common import compile_properties
    from appliance.config import EngineConfig

    return compile_properties(config or EngineConfig())


# ---------------------------------------------------------------- statistics

def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def percentile(values: Iterable[float], q: float) -> float:
    values = list(values)
    return float(np.percentile(values, q)) if values else float("nan")


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def paired_ratio(runs: list[dict], key: str, a: str, b: str, **match) -> float:
    """Median over repetitions of run[a][key] / run[b][key], pairing the two runs of the same repetition (they
    ran back to back, so slow drifts of the machine's load cancel better than in a ratio of medians)."""
    mine = [r for r in runs if all(r[k] == v for k, v in match.items())]
    by_rep: dict = {}
    for r in mine:
        by_rep.setdefault(r["rep"], {})[r["impl"]] = r[key]
    return median(ratio(p[a], p[b]) for p in by_rep.values() if a in p and b in p)


# ---------------------------------------------------------------- output

def print_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]], title: str | None = None) -> str:
    """columns: (key, header, format spec). Prints and returns the table."""
    widths = [max(len(h), *(len(format(r.get(k, ""), f) if r.get(k) is not None else "-") for r in rows))
              for k, h, f in columns]
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
    """What the numbers were measured on, and what else was eating CPU (the load caveat)."""
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                   if l.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    versions = {}
    for mod in ("openvino", "openvino_genai"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:   # not installed: the benchmark that needs it fails on its own
            pass
    return {"cpu": cpu, "nproc": os.cpu_count(), "loadavg": os.getloadavg(), "python": platform.python_version(),
            "versions": versions, "code": code_state(), "busy_processes": busy_processes()}


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
    def ticks() -> dict[int, tuple[int, str]]:
        out = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            out[int(entry)] = (int(fields[11]) + int(fields[12]), cmd.strip()[:120])
        return out

    a = ticks()
    time.sleep(sample_s)
    b = ticks()
    hz = os.sysconf("SC_CLK_TCK")
    mine = set(process_tree(os.getpid()))
    busy = []
    for pid, (t, cmd) in b.items():
        if pid in mine or pid not in a:
            continue
        pct = 100 * (t - a[pid][0]) / hz / sample_s
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


def args_dict(args) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


# ---------------------------------------------------------------- processes and memory (/proc)

def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def process_tree(pid: int) -> list[int]:
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children(p)
    return tree


def status_field(pid: int, name: str) -> int:
    """A numeric field of /proc/PID/status (kB for memory fields, a count for Threads)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    raise KeyError(f"no {name} in /proc/{pid}/status")


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
            snap[pid] = {"rss_kb": status_field(pid, "VmRSS"), "hwm_kb": status_field(pid, "VmHWM"),
                         "pss_kb": pss_kb(pid), "name": _role(pid, root_pid)}
        except (OSError, KeyError):
            continue
    return snap


def cpu_seconds(root_pid: int) -> dict[str, float]:
    """User + system CPU seconds so far of the process tree under root_pid, by role (engine/arbiter/worker)."""
    hz = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in process_tree(root_pid):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        role = _role(pid, root_pid)
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / hz
    return out


def _role(pid: int, root_pid: int) -> str:
    if pid == root_pid:
        return "engine"
    try:
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return "?"
    return "arbiter" if ppid == root_pid else "worker"


# ---------------------------------------------------------------- the real server

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`appliance serve` on loopback as a subprocess; `with ServerProcess(...) as srv:` waits for readiness and
    stops it with SIGTERM at the end."""

    def __init__(self, model_dir: Path, *args: str, log_path: Path | None = None, start_timeout: float = 300):
        import requests   # noqa: F401  (fail early if the test extras are missing)

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or LOGS / f"serve-{self.port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        cmd = [sys.executable, "-m", "appliance.cli", "serve", "--model", str(model_dir), "--host", "127.0.0.1",
               "--port", str(self.port), *args]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.start_timeout = start_timeout

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self) -> "ServerProcess":
        import requests

        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"appliance serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if requests.get(self.base + "/v2/health/ready", timeout=5).status_code == 200:
                    return self
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"appliance serve not ready after {self.start_timeout}s:\n{self.output()}")

    def metrics(self) -> dict[str, float]:
        import requests

        text = requests.get(self.base + "/metrics", timeout=30).text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line and not line.startswith("#")}

    def stop(self, timeout: float = 60) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


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
