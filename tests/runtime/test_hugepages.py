"""The repacked weights' allocation (appliance.runtime.kernels.hugepages): where it starts, what it holds."""

from __future__ import annotations

import numpy as np

from appliance.runtime.kernels import hugepages
from appliance.runtime.kernels.rewrite import row_groups


def test_a_large_array_starts_on_a_huge_page_and_holds_what_is_written() -> None:
    out = hugepages.empty((1000, 3 * hugepages.HUGE_PAGE // 1000 + 7), np.uint8)
    assert out.ctypes.data % hugepages.HUGE_PAGE == 0
    assert out.flags.c_contiguous and out.flags.writeable
    values = np.random.default_rng(0).integers(0, 256, out.shape, np.uint8)
    out[...] = values
    assert np.array_equal(out, values)


def test_a_small_array_is_a_plain_one() -> None:
    out = hugepages.empty((16, 16), np.float32)
    assert out.shape == (16, 16) and out.dtype == np.float32
    assert out.nbytes < hugepages.HUGE_PAGE


def test_grouped_rows_of_a_large_weight_land_in_huge_pages_unchanged() -> None:
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, (8962, 768), np.uint8)  # 6.9 MB, N not a multiple of the group
    out = row_groups(packed, 4)
    assert out.ctypes.data % hugepages.HUGE_PAGE == 0
    expected = np.concatenate([packed, np.zeros((2, 768), np.uint8)]).reshape(2241, 4, 24, 32)
    assert np.array_equal(out, expected.transpose(0, 2, 1, 3).reshape(8964, 768))
