"""The repacked weights and their scale tables in 2 MiB pages: the arrays the op's Constants hold, which the
kernel streams with few TLB misses.

A decode step reads every weight once, front to back; on 4 KiB pages that is a TLB miss and a page walk every 4 KiB
of the stream. Measured on the 2-vCPU AVX2 EPYC (Zen 3, KVM), our op over 16 layers of 8960 x 1536 u4 g128 at M = 1
(2 threads, one process, the two kinds of arrays interleaved, medians of 21), 2 MiB-aligned arrays took 0.94-0.95 of
the time of NumPy's (which advise huge pages, but only the 2 MiB-aligned interior of each is huge). In a
standalone loop over 24 such layers (the same kernel, TBB) whole huge pages against none at all: 0.49 vs 0.69 ms a
layer (14.0 vs 10.0 GB/s).

An Arena per model: the rewrite sums what its ops will hold and copies each array into one private anonymous mapping
of that size (Python's `mmap(-1, n)` alone is MAP_SHARED, i.e. shmem, whose huge pages `shmem_enabled` governs,
usually `never`), advised MADV_HUGEPAGE from a 2 MiB boundary over its whole length, the arrays one after the other
on 4 KiB boundaries. Before, each array had its own mapping with only its whole 2 MiB pages advised: at Qwen2.5-1.5B
the attention projections' (1.2-1.6 MB) had none, the MLP's lost their last 1-2 MB and no scale table had any, so
~120 MB of the step's 922 MB streamed through 4 KiB pages (/proc/self/smaps: 772 MB AnonHugePages). One engine with
its weights placed so beside one without, in one process, alternated per request (24 rounds of 48 single-token steps
after 128-token prompts, the 2-vCPU Intel Xeon with AMX, the engines made in either order): the step took 0.977 and
0.977 of its time at Qwen2.5-1.5B (p25-p75 0.972-0.981), 0.997 at Llama-3.2-3B (its projections' arrays, 4.7-7.9 MB,
were mostly huge already), 0.95-0.98 at the default 135M model (docs/performance-log.md). Cost: under 4 KiB an array
more and one partly used 2 MiB page, and each array is copied once at load. Where transparent huge pages are off
(`never`), or no huge page is free, the kernel backs the same range with 4 KiB pages: same arrays, NumPy's speed.
"""

from __future__ import annotations

import mmap

import numpy as np

HUGE_PAGE = 2 << 20
_ALIGN = 4096


def footprint(array: np.ndarray) -> int:
    """The bytes `array` takes in an Arena (whole 4 KiB)."""
    return -(-np.asarray(array).nbytes // _ALIGN) * _ALIGN


class Arena:
    """Copies of arrays in one huge-page-advised mapping of `nbytes` (the sum of their footprints), made at the first
    copy. A copy keeps the mapping alive, so it goes when the last array in it does (the model's Constants)."""

    def __init__(self, nbytes: int) -> None:
        self._size = nbytes
        self._memory: mmap.mmap | None = None
        self._next = self._end = 0  # the first free byte and the end, from the mapping's start

    def place(self, array: np.ndarray) -> np.ndarray:
        """A C-contiguous copy of `array` on a 4 KiB boundary, after the arrays placed before it."""
        array = np.asarray(array)
        if array.nbytes == 0:
            return array.copy()
        if self._memory is None:
            self._memory, self._next = _mapping(self._size)
            self._end = self._next + self._size
        if self._next + footprint(array) > self._end:
            raise ValueError(f"the arena holds {self._size} bytes: no room for {array.nbytes} more")
        out = np.frombuffer(self._memory, array.dtype, array.size, self._next).reshape(array.shape)
        out[...] = array
        self._next += footprint(array)
        return out


def _mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping holding `nbytes` from a 2 MiB boundary (returned as an offset into it), that span
    advised huge where the platform can."""
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    memory = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -np.frombuffer(memory, np.uint8, 1).ctypes.data % HUGE_PAGE
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        memory.madvise(advice, start, span)
    return memory, start
