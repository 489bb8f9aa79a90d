"""Read-only views of Linux's /proc: a process's parent and state, its children and whole tree, numeric fields
of /proc/PID/status, open fds and sockets, CPU time.

The server does not use this; the benchmarks (bench/common.py: memory and CPU of `appliance serve`'s process
tree) and the tests' server harness (tests/helpers.py: the gunicorn workers, leaks after stop) do. It lives in
the package so both import the same code without tests importing bench or bench importing tests, and it
imports nothing outside the standard library.
"""

from __future__ import annotations

import os
from pathlib import Path


def stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name: [0] state, [1] ppid, [11] utime, [12] stime (clock ticks).
    OSError when the process is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def parent(pid: int) -> int:
    return int(stat_fields(pid)[1])


def is_zombie(pid: int) -> bool:
    """True for an exited but not yet reaped process, and for one that is gone altogether."""
    try:
        return stat_fields(pid)[0] == "Z"
    except OSError:
        return True


def children(pid: int) -> list[int]:
    """PIDs whose parent is `pid` (processes vanishing during the scan are skipped)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if parent(int(entry)) == pid:
                    out.append(int(entry))
            except OSError:
                continue
    return out


def process_tree(pid: int) -> list[int]:
    """`pid` first, then all its descendants."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children(p)
    return tree


def status_field(pid: int, name: str) -> int:
    """A numeric field of /proc/PID/status (kB for memory fields such as VmRSS, a count for Threads)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    raise KeyError(f"no {name} in /proc/{pid}/status")


def fd_counts(pid: int) -> tuple[int, int]:
    """(open file descriptors, of which sockets) of `pid`; fds closing during the scan are skipped."""
    fds = sockets = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        fds += 1
        sockets += target.startswith("socket:")
    return fds, sockets


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by `pid` (all its threads)."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
