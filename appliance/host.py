"""This machine's memory, from /proc/meminfo: shared by the start-up checks (appliance/options.py refuses a
--kv-cache-size larger than MemTotal) and the engine's auto KV budget (appliance/runtime/backends/kv_budget.py
sizes the pool from MemAvailable).

Its own root module because the checks run in the CLI and in the engine process's config reload, and neither
should pay for the backends package to read one text file: importing appliance/runtime/backends/kv_budget.py loads
the backends package and numpy, 0.33 s and 26 MB peak RSS against this module's 0.002 s and 10 MB (a fresh
interpreter here, three runs each), which a start-up check has no use for."""

from __future__ import annotations

from pathlib import Path


def read_meminfo() -> str:
    """/proc/meminfo's text ('' where there is none); a function so tests can replace it."""
    try:
        return Path("/proc/meminfo").read_text()
    except OSError:
        return ""


def meminfo_bytes(field: str) -> int | None:
    """A /proc/meminfo field in bytes, e.g. MemAvailable (the kernel's estimate of what can be allocated
    without swapping) or MemTotal; None if there is no such line."""
    for line in read_meminfo().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None
