"""Timestamps of one request's path to its first token, taken from outside the code under test (bench.http_breakdown).

Each process of a measured server (and the bench's own, for the in-process engine) wraps a few functions on their
way in and out and appends (time.monotonic(), stage) to a buffer: the HTTP worker getting the request, the job sent,
the engine's connection thread getting it, tokenizing, queueing, the engine thread admitting it, the prefill's
forward, the first token sampled and detokenized, the event sent, the worker receiving it, the first byte written.
`time.monotonic` is CLOCK_MONOTONIC, one clock for every process on the box (and what `time.perf_counter` reads on
Linux), so stages of three processes line up on the client's own timestamps.

Nothing in appliance/ knows about this: the servers start with a `sitecustomize` that imports this file (copied next
to it) and calls `install()`, which wraps the functions of STAGES as their modules are imported (an import hook) or
at once if they already are; a function that a checkout does not have is skipped. A process writes its buffer to
`<dir>/stages-<pid>` when it receives DUMP_SIGNAL (bench.http_breakdown sends it after each request), so nothing is
written while a request runs. The wrappers cost about a microsecond per call (a few calls per token), the same on
both sides of the comparison.
"""

from __future__ import annotations

import functools
import importlib.abc
import inspect
import os
import signal
import sys
import time
from collections import deque
from typing import Any

DUMP_SIGNAL = signal.SIGRTMIN + 5  # a real-time signal: gunicorn and the server handle none of them
DIR_ENV = "BENCH_STAGES"

# module -> [(class or "" for a module function, function, stage on entry, stage on return)]. A stage on entry that
# ends in ":" gets the type name of the function's second argument (what Connection.send / send_event sends: the
# job tuple, Accepted, ChoiceChunk); on return, of the returned value (JobStream.next: which event arrived), or with
# "=" at the end, again of the second argument's.
STAGES: dict[str, list[tuple[str, str, str | None, str | None]]] = {
    "appliance.http.worker": [
        ("EdgeWorker", "accept", "w.accept", None),
        ("EdgeWorker", "_dispatch", "w.dispatch", None),
        ("EdgeWorker", "handle", "w.thread", None),
    ],
    "appliance.http.client": [
        ("EngineClient", "open_job", "w.open_job", "w.job_sent"),
        ("JobStream", "next", None, "w.recv:"),
    ],
    "gunicorn.http.wsgi": [("Response", "write", "w.write", "w.written")],
    "appliance.server.jobs": [
        ("JobRunner", "run", "e.job_recv", None),
        ("JobRunner", "submit", "e.submit", "e.submitted"),
        ("", "prompt_ids", "e.tokenize", "e.tokenized"),  # a checkout from before prompts.py
    ],
    "appliance.server.prompts": [("", "prompt_ids", "e.tokenize", "e.tokenized")],
    "appliance.runtime.engine.admission": [
        ("Admission", "submit_prompts", "e.submit_prompts", "e.queued"),
        ("Admission", "_take", "e.admit", "e.admitted"),
    ],
    "appliance.runtime.engine.core": [
        ("Engine", "_forward", "e.forward", "e.forwarded"),  # with the process's CPU time: "cpu.e.forward(ed)"
        ("Engine", "_append", "e.sampled", "e.emitted"),
    ],
    "appliance.runtime.engine.handles": [("RequestHandle", "events", "e.pump", "e.pump_got")],
    "appliance.protocol": [
        ("", "send_event", "send:", "sent:="),
        ("EventConnection", "try_send", "send:", "sent:="),  # the first token, from the engine thread
    ],
    "multiprocessing.connection": [("Connection", "send", "send:", None)],
}

_events: deque[tuple[float, str]] = deque(maxlen=100_000)
_clock = time.monotonic
_where = ""


def mark(stage: str) -> None:
    _events.append((_clock(), stage))


def take() -> list[tuple[float, str]]:
    """This process's events so far (and forget them)."""
    out = []
    while _events:
        out.append(_events.popleft())
    return out


def _wrapped(fn: Any, enter: str | None, leave: str | None) -> Any:
    events, clock = _events, _clock
    typed_enter = enter is not None and enter.endswith(":")
    typed_leave = leave is not None and leave.endswith(":")
    arg_leave = leave is not None and leave.endswith("=")
    if leave is not None and arg_leave:
        leave = leave[:-1]

    if inspect.isgeneratorfunction(fn):  # `leave` at each item it yields (a handle's chunks)

        @functools.wraps(fn)
        def staged_items(*args, **kwargs):
            if enter is not None:
                events.append((clock(), enter))
            for item in fn(*args, **kwargs):
                if leave is not None:
                    events.append((clock(), leave))
                yield item

        staged_items.__staged__ = True  # type: ignore[attr-defined]
        return staged_items

    if enter == "e.forward":  # the forward's CPU time too (every thread of the process: OpenVINO's)
        cpu = time.process_time

        @functools.wraps(fn)
        def staged_cpu(*args, **kwargs):
            events.append((clock(), enter))
            events.append((cpu(), "cpu." + enter))
            result = fn(*args, **kwargs)
            events.append((cpu(), f"cpu.{leave}"))
            events.append((clock(), f"{leave}"))
            return result

        staged_cpu.__staged__ = True  # type: ignore[attr-defined]
        return staged_cpu

    @functools.wraps(fn)
    def staged(*args, **kwargs):
        if enter is not None:
            events.append((clock(), enter + type(args[1]).__name__ if typed_enter else enter))
        result = fn(*args, **kwargs)
        if leave is not None:
            kind = type(args[1]).__name__ if arg_leave else type(result).__name__ if typed_leave else ""
            events.append((clock(), leave + kind))
        return result

    staged.__staged__ = True  # type: ignore[attr-defined]
    return staged


def _patch(name: str, module: Any) -> None:
    for owner_name, attr, enter, leave in STAGES.get(name, ()):
        owner = getattr(module, owner_name, None) if owner_name else module
        fn = getattr(owner, attr, None) if owner is not None else None
        if fn is None or getattr(fn, "__staged__", False) or not callable(fn):
            continue  # another checkout without it: skipped
        setattr(owner, attr, _wrapped(fn, enter, leave))


class _Hook(importlib.abc.MetaPathFinder):
    """Patches a module of STAGES right after it executes."""

    def find_spec(self, name, path, target=None):
        if name not in STAGES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):
            run(module)
            _patch(name, module)

        loader.exec_module = exec_module
        return spec


def _dump(signum, frame) -> None:
    if not _where:
        return
    path = os.path.join(_where, f"stages-{os.getpid()}")
    with open(path + ".tmp", "w") as f:
        f.write("\n".join(f"{t:.7f} {s}" for t, s in take()))
    os.replace(path + ".tmp", path)


def install(where: str | None = None, *, dump_on_signal: bool = True) -> None:
    """Wrap the STAGES functions in this process (now, and as their modules are imported); with `dump_on_signal`
    (call it from the main thread), write the events to `where` on DUMP_SIGNAL."""
    global _where
    _where = where or os.environ.get(DIR_ENV, "")
    for name in STAGES:
        if name in sys.modules:
            _patch(name, sys.modules[name])
    if not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook())
    if dump_on_signal:
        signal.signal(DUMP_SIGNAL, _dump)
