"""Load-time work on a thread per core (runtime/cores.py): results in order, errors raised, and no more threads
than the cores this process may run on."""

from __future__ import annotations

import os
import threading

import pytest

from appliance.runtime.cores import cores, map_on_cores


def test_results_come_in_the_items_order():
    assert map_on_cores(lambda x: x * x, list(range(50))) == [x * x for x in range(50)]


def test_an_error_in_one_item_is_raised_to_the_caller():
    def work(x: int) -> int:
        if x == 7:
            raise ValueError("seven")
        return x

    with pytest.raises(ValueError, match="seven"):
        map_on_cores(work, list(range(10)))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no affinity masks on this platform")
def test_a_process_pinned_to_one_core_runs_the_work_on_one_thread():
    mask = os.sched_getaffinity(0)
    seen: set[int] = set()
    try:
        os.sched_setaffinity(0, {min(mask)})
        assert cores() == 1
        map_on_cores(lambda x: seen.add(threading.get_ident()), list(range(20)))
    finally:
        os.sched_setaffinity(0, mask)
    assert len(seen) == 1
    assert cores() == len(mask)


@pytest.mark.skipif(cores() < 2, reason="needs two cores")
def test_items_run_side_by_side_on_two_cores():
    both = threading.Barrier(2, timeout=30)  # each of two items waits for the other: only side by side can they pass
    assert map_on_cores(lambda x: both.wait() is not None, [0, 1]) == [True, True]
