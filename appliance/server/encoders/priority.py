"""The encoder's background thread's scheduling priority (appliance/server/encoders/service.py runs its forwards
there while chat runs), and OS thread names for per-thread CPU accounting.

While a generation model in the process has sequences running or waiting, encoder forwards run on a thread at
nice +19 over the process (`--encoder-nice`) and Linux's SCHED_IDLE policy (`--encoder-sched idle`): it runs only
on a core no normal thread wants, and a waking chat thread preempts it at once, so chat decoding keeps its pace
while clients embed.
Otherwise they run on a thread at the process's own priority, so an embedding request on a box with no chat
running is not slowed by a nice it does not need (a one-sentence forward took 94 ms at nice +5 against 48 ms at
nice 0 on the loaded dev box). Two threads, not one whose priority changes: an unprivileged thread can neither
lower its nice again nor leave SCHED_IDLE.

Measured with bench/embeddings_http.py `mixed` (4 chat streams, 8 clients embedding 16 sentences per request, 1
encoder inference thread; with one, OpenVINO runs the forward on the calling thread, so its priority is the
forward's) on the 2-core dev box under other agents' load (average 12-23), chat ITL p99 growth over chat alone,
median of the pairs: +59% with the encoder always at nice 5 (6 pairs), +24% always at nice 19 (4 pairs), +11% at
nice 19 following chat (6 pairs), -1% and +7% with SCHED_IDLE too (6 pairs each; docs/performance.md). The cost:
while chat streams, embeddings get what chat leaves (1.8 sentences/s there, against 24-47 with no chat).
The serve options `--encoder-nice` (0: no background thread, no priority change) and `--encoder-sched` (idle |
normal; APPLIANCE_ENCODER_NICE / _SCHED) declare both, with their defaults (ServeSettings, appliance/settings.py);
the supervisor hands them to the EncoderService it loads, which hands them to `lower_priority`.
"""

from __future__ import annotations

import os
import threading


def lower_priority(nice: int, sched: str) -> None:
    """The calling thread at `nice` over the process's and, with `sched` "idle", SCHED_IDLE (Linux: both per
    thread; elsewhere nothing)."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, 0) + nice)
    except (OSError, AttributeError):
        pass
    if sched == "idle":
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError):
            pass


def name_os_thread(name: str) -> None:
    """The OS thread's name (Linux: /proc/<pid>/task/<tid>/comm, what top -H and per-thread CPU accounting show)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
