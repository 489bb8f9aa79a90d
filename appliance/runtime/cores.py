"""Load-time work spread over a thread per core: what lets go of the GIL while it runs (NumPy's copies and
transposes, OpenVINO's compile_model), item by item, results in order.

Where it is used (each caller's docstring has what it bought): the rewrite's repacking of each group of sibling
MatMuls (kernels/rewrite.py _plan) and the compiles of the graphs of rows (backends/openvino_paged.py _row_graphs).
Only at load: a step never waits on a pool.

A core is one this process may run on (its affinity mask: a service pinned with systemd's CPUAffinity= or a
container's cpuset gets that many threads), not every core of the box.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def map_on_cores(work: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """[work(item) for item in items], on up to a thread per core; an exception in any is raised here."""
    with ThreadPoolExecutor(max(1, min(len(items), cores()))) as threads:
        return list(threads.map(work, items))
