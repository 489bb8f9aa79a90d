"""The repacked weights' allocation (appliance.runtime.kernels.hugepages): where the arena puts each array, what it
holds, and that its mapping is advised huge."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from appliance.runtime.kernels import hugepages
from appliance.runtime.kernels.rewrite import row_groups


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address` in this process (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_arrays_go_one_after_the_other_from_a_huge_page() -> None:
    """Each array on a 4 KiB boundary after the one before, the first on a 2 MiB boundary, all in a mapping advised
    huge ("hg") to its last byte; each holds what it was given, in its shape and type; past the sum of their
    footprints there is no room."""
    rng = np.random.default_rng(0)
    arrays = [
        rng.integers(0, 256, (3, 1000), np.uint8),
        rng.standard_normal((7, 5)).astype(np.float16),
        rng.integers(0, 256, (1537, 1768), np.uint8),  # 2.6 MiB: over one huge page
    ]
    arena = hugepages.Arena(sum(hugepages.footprint(a) for a in arrays))
    placed = [arena.place(a) for a in arrays]
    assert placed[0].ctypes.data % hugepages.HUGE_PAGE == 0
    assert [p.ctypes.data - placed[0].ctypes.data for p in placed] == [0, 4096, 8192]
    for a, p in zip(arrays, placed):
        assert p.dtype == a.dtype and p.shape == a.shape and p.flags.c_contiguous and np.array_equal(p, a)
    if getattr(mmap, "MADV_HUGEPAGE", None) is not None:
        assert "hg" in _vm_flags(placed[2].ctypes.data + placed[2].nbytes - 1)
    with pytest.raises(ValueError, match="no room"):
        arena.place(np.zeros(1, np.uint8))


@pytest.mark.parametrize("shape", [(0,), (0, 16)])
def test_an_empty_array_is_a_plain_copy(shape) -> None:
    out = hugepages.Arena(0).place(np.zeros(shape, np.float32))
    assert out.shape == shape and out.dtype == np.float32


def test_grouped_rows_of_a_large_weight_unchanged() -> None:
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, (8962, 768), np.uint8)  # 6.9 MB, N not a multiple of the group
    grouped = row_groups(packed, 4)
    out = hugepages.Arena(hugepages.footprint(grouped)).place(grouped)
    assert out.ctypes.data % hugepages.HUGE_PAGE == 0
    expected = np.concatenate([packed, np.zeros((2, 768), np.uint8)]).reshape(2241, 4, 24, 32)
    assert np.array_equal(out, expected.transpose(0, 2, 1, 3).reshape(8964, 768))
