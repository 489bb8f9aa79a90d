"""Where the HTTP path's time goes at batch 1: one streaming client through `appliance serve` beside the engine in
this process, interleaved, and per thread of every process: CPU time, time spent runnable but waiting for a CPU,
context switches (voluntary = wakeups after a wait, involuntary = preempted) and read/write syscalls, each per
generated token. Made to survive a loaded box: the kernel's per-thread counters (/proc/<pid>/task/<tid>/schedstat,
status, io) count this server's work whatever else runs, where wall time alone does not.

Threads are named from outside the code under test: the servers start with a `sitecustomize` (written by this bench)
that records each Python thread's name by its OS thread id, so the engine's step loop ("engine"), the job threads
("engine-pump", "engine-conn"), gunicorn's request threads and OpenVINO's own threads (any thread Python did not
start) are told apart, the same way on any checkout.

The first token's path is timed stage by stage (bench/ttft_stages.py, also loaded by that sitecustomize): the worker
getting the request, the job sent, the engine's connection thread getting it, tokenizing, queueing, the engine
thread's admission, the prefill forward (and its CPU time), the first token sampled and detokenized, the event sent,
the worker receiving it, the first byte written, the client's first event; the in-process side the same from its
submit. One clock for every process (CLOCK_MONOTONIC), so the table's steps line up across them.

`--base PATH` also measures a server running another checkout (e.g. main before a change: `git worktree add
/tmp/base REV`): its phases alternate with this checkout's, one server at a time, each against the same
in-process engine (this checkout's runtime). `--busy` adds every cell again with a CPU-bound process running
beside (one core's worth of `while True`), `--workers 1 2` the worker counts.

    python -m bench.http_breakdown [--model default-int8] [--workers 1 2] [--busy] [--reps 3] [--rounds 1]
                                   [--base /tmp/perf-http-base] [--new-tokens 128] [--prompt-len 128]
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import ttft_stages
from bench.common import LOGS, arg_parser, machine, median, model_dir, print_table, prompts, save_results

# the sitecustomize the measured servers start with: each Python thread writes "<pid> <tid> <name>" once it runs
THREAD_NAMES = """
import os, threading
_where = os.environ.get("BENCH_THREAD_NAMES")
_inner = threading.Thread._bootstrap_inner
def _counters():
    base = "/proc/thread-self"
    run, wait, _ = open(base + "/schedstat").read().split()
    st = dict(l.split(":", 1) for l in open(base + "/status").read().splitlines() if ":" in l)
    io = dict(l.split(": ") for l in open(base + "/io").read().splitlines())
    return (f"{int(run) / 1e9} {int(wait) / 1e9} {st['voluntary_ctxt_switches'].strip()} "
            f"{st['nonvoluntary_ctxt_switches'].strip()} {io['syscr']} {io['syscw']}")
def _named(self):
    where = os.path.join(_where or "", f"{os.getpid()}-{threading.get_native_id()}")
    if _where:
        try:
            with open(where, "w") as f:
                f.write(self.name)
        except OSError:
            pass
    try:
        _inner(self)
    finally:
        if _where:
            try:
                with open(where + ".end", "w") as f:
                    f.write(_counters())
            except OSError:
                pass
threading.Thread._bootstrap_inner = _named
if os.environ.get("BENCH_STAGES"):  # the first-token path's timestamps (bench/ttft_stages.py, copied beside)
    import bench_ttft_stages
    bench_ttft_stages.install()
"""
TICK = os.sysconf("SC_CLK_TCK")


def thread_counters(pid: int) -> dict[int, dict[str, float]]:
    """Per OS thread of `pid`: cpu_s (on-CPU, schedstat), wait_s (runnable, waiting for a CPU), vol / invol
    context switches, syscr / syscw (read- and write-family syscalls)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            run_ns, wait_ns, _ = Path(f"{base}/schedstat").read_text().split()
            status = dict(line.split(":", 1) for line in Path(f"{base}/status").read_text().splitlines() if ":" in line)
            io = dict(line.split(": ") for line in Path(f"{base}/io").read_text().splitlines())
        except (OSError, ValueError):
            continue  # ended meanwhile
        out[int(tid)] = {
            "cpu_s": int(run_ns) / 1e9,
            "wait_s": int(wait_ns) / 1e9,
            "vol": int(status["voluntary_ctxt_switches"]),
            "invol": int(status["nonvoluntary_ctxt_switches"]),
            "syscr": int(io["syscr"]),
            "syscw": int(io["syscw"]),
        }
    return out


def process_tree(root: int) -> list[int]:
    pids, i = [root], 0
    while i < len(pids):
        try:
            children = Path(f"/proc/{pids[i]}/task/{pids[i]}/children").read_text().split()
        except OSError:
            children = []
        pids += [int(c) for c in children]
        i += 1
    return pids


def roles(root: int) -> dict[int, str]:
    """engine (the root: `appliance serve`'s engine process), arbiter (gunicorn's), worker (its children)."""
    tree = process_tree(root)
    out = {root: "engine"}
    for pid in tree[1:]:
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        out[pid] = "arbiter" if ppid == root else "worker"
    return out


def thread_group(role: str, pid: int, tid: int, names: dict[tuple[int, int], str]) -> str:
    """The row a thread is counted in: `<process role>: <thread kind>`."""
    name = names.get((pid, tid))
    if tid == pid:
        kind = "main"
    elif name is None:
        kind = "native (OpenVINO)" if role in ("engine", "in-process") else "native"
    elif name.startswith("ThreadPoolExecutor"):
        kind = "request threads"
    elif name.startswith("Thread-"):
        kind = "other"
    else:
        kind = name
    return f"{role}: {kind}"


KEYS = ("cpu_s", "wait_s", "vol", "invol", "syscr", "syscw")
Snapshot = dict[tuple[int, int], tuple[str, dict[str, float]]]


def snapshot(pids: dict[int, str], names: dict[tuple[int, int], str]) -> Snapshot:
    """{(pid, tid): (thread group, counters)} of every live thread of `pids` ({pid: role})."""
    out: Snapshot = {}
    for pid, role in pids.items():
        try:
            counters = thread_counters(pid)
        except OSError:
            continue
        for tid, c in counters.items():
            out[pid, tid] = (thread_group(role, pid, tid, names), c)
    return out


def ended(where: Path | None, seen: set[str]) -> dict[tuple[int, int], dict[str, float]]:
    """The final counters of the Python threads that ended since `seen` (the .end files the sitecustomize wrote)."""
    out = {}
    for f in where.glob("*.end") if where is not None else ():
        if f.name in seen:
            continue
        pid, tid = f.stem.split("-")
        try:
            out[int(pid), int(tid)] = dict(zip(KEYS, map(float, f.read_text().split())))
        except (OSError, ValueError):
            continue
    return out


def per_token(
    before: Snapshot,
    after: Snapshot,
    gone: dict[tuple[int, int], dict[str, float]],
    groups_of: Callable[[tuple[int, int]], str],
    tokens: int,
) -> dict[str, dict[str, float]]:
    """Counter deltas per thread group, per token: live threads' growth, plus threads that started and/or ended
    in between (a job's pump threads) from their final counters."""
    out: dict[str, dict[str, float]] = {}
    threads: dict[str, set] = {}
    for key, (group, c) in after.items():
        b = before.get(key, ("", {}))[1]
        g = out.setdefault(group, dict.fromkeys(KEYS, 0.0))
        for k in KEYS:
            g[k] += c[k] - b.get(k, 0.0)
        threads.setdefault(group, set()).add(key)
    for key, c in gone.items():
        if key in after:
            continue
        group = before[key][0] if key in before else groups_of(key)
        b = before.get(key, ("", {}))[1]
        g = out.setdefault(group, dict.fromkeys(KEYS, 0.0))
        for k in KEYS:
            g[k] += c[k] - b.get(k, 0.0)
        threads.setdefault(group, set()).add(key)
    return {
        group: {**{k: v / tokens for k, v in c.items()}, "threads": len(threads[group])} for group, c in out.items()
    }


def read_names(where: Path) -> dict[tuple[int, int], str]:
    names = {}
    for f in where.glob("*-*"):
        if f.suffix in (".end", ".tmp") or f.name.startswith("stages-"):
            continue
        pid, tid = f.name.split("-")
        names[int(pid), int(tid)] = f.read_text()
    return names


@contextlib.contextmanager
def server(root: Path, path: Path, workers: int, names_dir: Path, label: str):
    """`appliance serve` from checkout `root` (its own code, with THREAD_NAMES as sitecustomize)."""
    from appliance.testing import loopback

    site = names_dir / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(THREAD_NAMES)
    (site / "bench_ttft_stages.py").write_text(Path(ttft_stages.__file__).read_text())
    saved_env = {k: os.environ.get(k) for k in ("PYTHONPATH", "BENCH_THREAD_NAMES", ttft_stages.DIR_ENV)}
    saved_root = loopback.ROOT
    os.environ["PYTHONPATH"] = os.pathsep.join([str(root), str(site)])
    os.environ["BENCH_THREAD_NAMES"] = str(names_dir)
    os.environ[ttft_stages.DIR_ENV] = str(names_dir)
    loopback.ROOT = root  # the server's cwd: `python -m` puts it first on sys.path
    try:
        srv = loopback.ApplianceServer(
            path, "--workers", str(workers), "--log-level", "warning", log_path=LOGS / f"http-breakdown-{label}.log"
        )
    finally:
        loopback.ROOT = saved_root
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    with srv:
        yield srv


@contextlib.contextmanager
def busy_process(on: bool):
    """A CPU-bound process beside the measured ones (one core's worth), or nothing."""
    if not on:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        yield
    finally:
        proc.kill()
        proc.wait()


def server_stages(pids: dict[int, str], where: Path, timeout: float = 10.0) -> list[tuple[float, str]]:
    """Every server process's stage events since its last dump (ttft_stages: each writes them on DUMP_SIGNAL)."""
    files = {pid: where / f"stages-{pid}" for pid in pids}
    for pid, f in files.items():
        f.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            os.kill(pid, ttft_stages.DUMP_SIGNAL)
    deadline = time.monotonic() + timeout
    events = []
    for pid, f in files.items():
        while not f.exists() and time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.01)
        with contextlib.suppress(OSError):
            for line in f.read_text().splitlines():
                t, stage = line.split(" ", 1)
                events.append((float(t), stage))
    return events


def first_token_stages(events: list[tuple[float, str]], t0: float, first: float) -> dict[str, float]:
    """Seconds from t0 (the client's start) to each stage's first event in [t0, first] (the client's first token)."""
    out: dict[str, float] = {}
    timed = sorted((t, s) for t, s in events if not s.startswith("cpu."))
    for t, stage in timed:
        if t0 <= t <= first and stage not in out:
            out[stage] = t - t0
    out["c.first"] = first - t0
    # the prefill forward's CPU seconds (the process's, every thread): the n-th "cpu." pair is the n-th forward
    starts = [t for t, s in events if s == "cpu.e.forward"]
    ends = [t for t, s in events if s == "cpu.e.forwarded"]
    forwards = [t for t, s in sorted(events) if s == "e.forward"]
    n = next((i for i, t in enumerate(forwards) if t0 <= t <= first), None)
    if n is not None and len(starts) == len(ends) == len(forwards):
        out["prefill_cpu"] = ends[n] - starts[n]
    return out


def http_cell(srv, model_id: str, prompt: list[int], new_tokens: int, names_dir: Path) -> dict:
    from bench.client import http_run, stream_one

    pids = roles(srv.pid)
    server_stages(pids, names_dir)  # forget what came before
    seen = {f.name for f in names_dir.glob("*.end")}
    before = snapshot(pids, read_names(names_dir))
    kept: list[dict] = []

    def stream(p: list[int], session) -> dict:
        kept.append(stream_one(srv.base, model_id, p, new_tokens, session))
        return kept[-1]

    r = http_run(srv.base, model_id, [prompt], new_tokens, stream=stream)
    names = read_names(names_dir)
    after = snapshot(pids, names)
    gone = ended(names_dir, seen)
    first = kept[0]["times"][0]
    stages = first_token_stages(server_stages(pids, names_dir), first - r["ttft_s"], first)

    def group_of(key: tuple[int, int]) -> str:
        return thread_group(pids.get(key[0], "?"), key[0], key[1], names)

    return {**r, "stages": stages, "threads": per_token(before, after, gone, group_of, new_tokens)}


def engine_cell(engine, prompt: list[int], new_tokens: int) -> dict:
    from appliance.params import SamplingParams
    from bench.concurrency import _summary, stream_all

    pid = os.getpid()
    names = {(pid, t.native_id): t.name for t in threading.enumerate() if t.native_id is not None}
    before = snapshot({pid: "in-process"}, names)
    ttft_stages.take()
    t0, times, _, reasons = stream_all(engine, [prompt], SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    stages = first_token_stages(ttft_stages.take(), t0, times[0][0])
    if any(r != "length" for r in reasons):
        raise RuntimeError(f"every request must run to max_tokens: finish reasons {reasons}")
    r = _summary(t0, times, new_tokens)
    after = snapshot({pid: "in-process"}, names)
    return {**r, "stages": stages, "threads": per_token(before, after, {}, lambda key: "in-process: ?", new_tokens)}


# The first-token path, in order: (stage, what happened). Each is the first event of its kind after the client
# started (ttft_stages.STAGES names where they are taken); the in-process side has the engine's part only.
STAGE_ORDER = [
    ("w.accept", "worker accepts the connection"),
    ("w.dispatch", "request read, handed to a thread"),
    ("w.thread", "a request thread runs it"),
    ("w.open_job", "request parsed, job built"),
    ("send:tuple", "job written to the engine socket"),
    ("w.job_sent", "job sent"),
    ("e.job_recv", "engine connection thread has the job"),
    ("e.submit", "job checks start"),
    ("e.tokenize", "prompt tokenize start"),
    ("e.tokenized", "prompt tokenized"),
    ("e.submit_prompts", "Engine.submit_prompts called"),
    ("e.queued", "in the engine inbox"),
    ("send:Accepted", "Accepted sent"),
    ("w.recv:Accepted", "worker has Accepted"),
    ("e.pump", "pump thread reads the handle"),
    ("e.admit", "engine thread admits it"),
    ("e.admitted", "admitted (sampler, detokenizer)"),
    ("e.forward", "prefill forward starts"),
    ("e.forwarded", "prefill forward ends"),
    ("e.sampled", "first token sampled"),
    ("e.emitted", "detokenized, on the handle's queue"),
    ("e.pump_got", "pump (in-process: consumer) has it"),
    ("send:ChoiceChunk", "event send starts"),
    ("sent:ChoiceChunk", "event sent"),
    ("w.recv:ChoiceChunk", "worker has the first token"),
    ("w.write", "first response write starts"),
    ("w.written", "first response bytes written"),
    ("c.first", "client has the first token"),
    ("prefill_cpu", "the prefill forward's CPU (process)"),
]


def stage_rows(runs: list[dict]) -> list[dict]:
    """Per cell and stage: ms from the client's start (medians), HTTP and in-process, and the HTTP step from the
    stage before it (median of the per-request steps)."""
    rows = []
    cells = sorted({(r["server"], r["workers"], r["busy"]) for r in runs if r["side"] == "http"})
    for server_label, workers, busy in cells:
        mine = [r for r in runs if (r["server"], r["workers"], r["busy"]) == (server_label, workers, busy)]
        http = [r["stages"] for r in mine if r["side"] == "http" and r.get("stages")]
        eng = [r["stages"] for r in mine if r["side"] == "engine" and r.get("stages")]
        previous: str | None = None
        for stage, label in STAGE_ORDER:
            h = [s[stage] for s in http if stage in s]
            e = [s[stage] for s in eng if stage in s]
            if not h and not e:
                continue
            steps = (
                [s[stage] - s[previous] for s in http if stage in s and previous in s]
                if previous and stage != "prefill_cpu"
                else []
            )
            rows.append(
                {
                    "server": server_label,
                    "workers": workers,
                    "busy": "yes" if busy else "no",
                    "stage": stage,
                    "label": label,
                    "http_ms": median(h) * 1e3 if h else None,
                    "step_ms": median(steps) * 1e3 if steps else None,
                    "engine_ms": median(e) * 1e3 if e else None,
                }
            )
            if h and stage != "prefill_cpu":
                previous = stage
    return rows


COLUMNS = [
    ("server", "server", ""),
    ("workers", "workers", "d"),
    ("busy", "busy", ""),
    ("http_tok_s", "HTTP tok/s", ".1f"),
    ("engine_tok_s", "in-proc tok/s", ".1f"),
    ("tok_s_ratio", "tok/s ratio", ".3f"),
    ("itl_ratio", "ITL p50 in-proc/HTTP", ".3f"),
    ("http_itl_ms", "HTTP ITL p50 ms", ".2f"),
    ("engine_itl_ms", "in-proc ITL p50 ms", ".2f"),
    ("ttft_delta_ms", "TTFT HTTP-in-proc ms", ".1f"),
    ("outside_delta_ms", "TTFT-prefill HTTP-in-proc ms", ".1f"),
    ("http_cpu_ms", "HTTP CPU ms/tok", ".2f"),
    ("engine_cpu_ms", "in-proc CPU ms/tok", ".2f"),
]
STAGE_COLUMNS = [
    ("server", "server", ""),
    ("workers", "w", "d"),
    ("busy", "busy", ""),
    ("stage", "stage", ""),
    ("label", "what", ""),
    ("http_ms", "HTTP ms", ".2f"),
    ("step_ms", "HTTP step ms", ".2f"),
    ("engine_ms", "in-proc ms", ".2f"),
]
THREAD_COLUMNS = [
    ("server", "server", ""),
    ("workers", "w", "d"),
    ("busy", "busy", ""),
    ("group", "process: threads", ""),
    ("threads", "n", "d"),
    ("cpu_ms", "CPU ms/tok", ".3f"),
    ("wait_ms", "runnable-wait ms/tok", ".3f"),
    ("vol", "vol cs/tok", ".2f"),
    ("invol", "invol cs/tok", ".2f"),
    ("syscr", "read sys/tok", ".2f"),
    ("syscw", "write sys/tok", ".2f"),
]


def outside_prefill(run: dict) -> float:
    """A run's TTFT less its prefill forward's wall time (nan without the stages)."""
    s = run.get("stages") or {}
    if not {"c.first", "e.forward", "e.forwarded"} <= s.keys():
        return float("nan")
    return s["c.first"] - (s["e.forwarded"] - s["e.forward"])


def summarize(runs: list[dict]) -> tuple[list[dict], list[dict]]:
    rows, thread_rows = [], []
    cells = sorted({(r["server"], r["workers"], r["busy"]) for r in runs if r["side"] == "http"})
    for server_label, workers, busy in cells:
        mine = [r for r in runs if (r["server"], r["workers"], r["busy"]) == (server_label, workers, busy)]
        pairs = [
            (h, e)
            for h in mine
            if h["side"] == "http"
            for e in mine
            if e["side"] == "engine" and e["pair"] == h["pair"]
        ]
        http = [h for h, _ in pairs]
        eng = [e for _, e in pairs]
        rows.append(
            {
                "server": server_label,
                "workers": workers,
                "busy": "yes" if busy else "no",
                "pairs": len(pairs),
                "http_tok_s": median(h["tok_s"] for h in http),
                "engine_tok_s": median(e["tok_s"] for e in eng),
                "tok_s_ratio": median(h["tok_s"] / e["tok_s"] for h, e in pairs),
                "itl_ratio": median(e["itl_p50_s"] / h["itl_p50_s"] for h, e in pairs),
                "http_itl_ms": median(h["itl_p50_s"] for h in http) * 1e3,
                "engine_itl_ms": median(e["itl_p50_s"] for e in eng) * 1e3,
                "ttft_delta_ms": median((h["ttft_s"] - e["ttft_s"]) for h, e in pairs) * 1e3,
                # the same without the prefill forward's wall time, whose noise on a loaded box is 100s of ms
                "outside_delta_ms": median(outside_prefill(h) - outside_prefill(e) for h, e in pairs) * 1e3,
                "http_cpu_ms": median(sum(g["cpu_s"] for g in h["threads"].values()) for h in http) * 1e3,
                "engine_cpu_ms": median(sum(g["cpu_s"] for g in e["threads"].values()) for e in eng) * 1e3,
            }
        )
        for side_runs in (http, eng):
            groups = sorted({g for r in side_runs for g in r["threads"]})
            for g in groups:
                vals = [r["threads"][g] for r in side_runs if g in r["threads"]]
                row = {"server": server_label, "workers": workers, "busy": "yes" if busy else "no", "group": g}
                row["threads"] = int(median(v["threads"] for v in vals))
                row["cpu_ms"] = median(v["cpu_s"] for v in vals) * 1e3
                row["wait_ms"] = median(v["wait_s"] for v in vals) * 1e3
                for k in ("vol", "invol", "syscr", "syscw"):
                    row[k] = median(v[k] for v in vals)
                if row["cpu_ms"] >= 0.005 or row["vol"] >= 0.05:  # idle threads left out of the table
                    thread_rows.append(row)
    return rows, thread_rows


def main(argv=None) -> int:
    ap = arg_parser(__doc__, "http_breakdown", model="default-int8", reps=3, quick={"reps": 1, "new_tokens": 32})
    ap.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--busy", action="store_true", help="every cell also with a CPU-bound process beside")
    ap.add_argument("--base", type=Path, help="another checkout's server, measured in alternating phases")
    ap.add_argument("--rounds", type=int, default=1, help="phases per server (they alternate with --base)")
    args = ap.parse_args(argv)

    from appliance.manifest import Manifest
    from bench.concurrency import load_engine

    ttft_stages.install(dump_on_signal=False)  # the in-process engine's stages, read in this process
    info = machine()
    path = model_dir(args.model)
    vocab = Manifest.load(path).vocab_size
    here = Path(__file__).resolve().parents[1]
    servers = [("this", here)] + ([("base", args.base.resolve())] if args.base else [])
    engine = load_engine(path)
    runs: list[dict[str, Any]] = []
    seed, pair = 9000, 0
    try:
        for rnd in range(args.rounds):
            for workers in args.workers:
                for label, root in servers if rnd % 2 == 0 else servers[::-1]:
                    with (
                        tempfile.TemporaryDirectory(prefix="bench-threads-") as tmp,
                        server(root, path, workers, Path(tmp), f"{label}-{workers}") as srv,
                    ):
                        from bench.client import http_run

                        model_id = srv.model_id()
                        http_run(srv.base, model_id, prompts(vocab, 1, 16, 1), 8)  # warm the worker(s)
                        for rep in range(args.reps):
                            for busy in (False, True) if args.busy else (False,):
                                with busy_process(busy):
                                    prompt = prompts(vocab, 1, args.prompt_len, seed)[0]
                                    seed += 1
                                    order = ["http", "engine"] if (rep + busy) % 2 == 0 else ["engine", "http"]
                                    for side in order:
                                        if side == "http":
                                            r = http_cell(srv, model_id, prompt, args.new_tokens, Path(tmp))
                                        else:
                                            r = engine_cell(engine, prompt, args.new_tokens)
                                        row = {"server": label, "workers": workers, "busy": busy, "rep": rnd}
                                        runs.append({**row, "side": side, "pair": pair, **r})
                                    pair += 1
                                    print(
                                        f"{label} w={workers} busy={busy} rep {rep}: "
                                        f"HTTP {runs[-2 if order[0] == 'http' else -1]['tok_s']:.1f} "
                                        f"in-process {runs[-1 if order[0] == 'http' else -2]['tok_s']:.1f} tok/s",
                                        file=sys.stderr,
                                    )
    finally:
        engine.shutdown()
    rows, thread_rows = summarize(runs)
    print_table(rows, COLUMNS, title="batch 1, HTTP vs in-process (medians of interleaved pairs)")
    print(f"load average: {os.getloadavg()}")
    print_table(thread_rows, THREAD_COLUMNS, title="per thread group, per generated token (medians)")
    ttft = stage_rows(runs)
    print_table(ttft, STAGE_COLUMNS, title="the first token's path: ms from the client's start (medians)")
    for r in runs:
        r.pop("times", None)
    save_results(
        args,
        "http_breakdown",
        info,
        servers=[str(r) for _, r in servers],
        runs=runs,
        summary=rows,
        threads=thread_rows,
        ttft_stages=ttft,
        loadavg_after=os.getloadavg(),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
