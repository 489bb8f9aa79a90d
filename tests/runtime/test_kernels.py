"""Our low-bit kernels (appliance/runtime/kernels): the LowBitMatMul op against a numpy reference on every ISA path
this CPU has, the load-time rewrite of u4 MatMuls, and every fallback to OpenVINO's kernels.

The library is built by `make venv` (appliance.runtime.kernels.build); when it is missing these tests skip, except
under CI=true, where they fail: building it is ours."""

from __future__ import annotations

import ctypes
import logging
import shutil
import subprocess
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
from openvino import opset13 as ops

from appliance.runtime import kernels
from appliance.runtime.kernels.rewrite import (
    LANE_ROWS,
    OP,
    U8_ISAS,
    lanes_layout,
    layout,
    native_matmuls,
    pair_layout,
    rewrite,
    row_groups,
    scale_table,
    u8_layout,
)
from tests.helpers import logits_tvd, ours_missing

F32 = {"INFERENCE_PRECISION_HINT": "f32"}


@pytest.fixture(autouse=True)
def _every_size(monkeypatch):
    """Our kernels on every matching MatMul, however small (the tests' shapes and the default model's layers are
    under kernels.MIN_WEIGHTS, the serving floor; test_small_layers_keep_openvino checks the floor)."""
    monkeypatch.setenv(kernels.MIN_WEIGHTS_ENV, "0")


def _paths() -> list[str]:
    return list(kernels.ISAS)


def _rewrite_layout(factory, k: int, packed: np.ndarray, sz: np.ndarray, group: int, isa: str, **attrs) -> ov.Model:
    """The op alone on u4 weights [N, Kp / 2] laid out as the rewrite does for `isa` (rewrite.layout)."""
    rg, slot = layout(isa, 4, packed.shape[0], k, group)
    packed, sz = _lanes(packed, sz) if slot == 0 else (row_groups(packed, rg), sz)
    return _op_model(factory, k, packed, sz, group, isa, row_group=rg, slot_pairs=slot, **attrs)


def _lanes(packed: np.ndarray, sz: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """u4 weights [N, K / 2] and their scale_table in AVX512-VNNI's lanes (rewrite.lanes_layout)."""
    table = sz.view(np.float16)
    groups = table.shape[1] // 2
    return lanes_layout(packed, table[:, :groups], table[:, groups:])


def _width(slot_pairs: int, m: int, bits: int = 4) -> int:
    """The values of x per int8 scale at M = m: per octet, but per block of 32 in lanes from 4 rows, at every row
    count for u8 (slot_pairs 0: lowbit_kernel.h LANES_BLOCK_ROWS)."""
    return 32 if slot_pairs == 0 and (m >= 4 or bits == 8) else 8


def _op_model(
    factory,
    k: int,
    packed: np.ndarray,
    sz: np.ndarray,
    group: int,
    isa: str,
    bits: int = 4,
    row_group: int = 1,
    residual: int = 0,
    slot_pairs: int = 1,
    gated: int = 0,
) -> ov.Model:
    """The op alone; `packed` row-major (row_group 1) or in row_groups' layout."""
    x = ops.parameter([-1, k], ov.Type.f32)
    attrs = {
        "group_size": group,
        "isa": isa,
        "bits": bits,
        "row_group": row_group,
        "residual": residual,
        "slot_pairs": slot_pairs,
        "gated": gated,
    }
    node = factory.create(OP, [x.output(0), ops.constant(packed).output(0), ops.constant(sz).output(0)], attrs)
    return ov.Model([node.output(0)], [x])


def _case(
    rng: np.random.Generator,
    n: int,
    k: int,
    group: int,
    zero: str,
    scale: str,
    bits: int = 4,
    isa: str = "avx2",
    lanes: bool = False,
):
    """Random u4 (or u8) weights [N, Kp] (zero beyond K), f16 scale and zero point per group, and their packed
    forms (u8: in `isa`'s u8_layout; `lanes`: both in rewrite.lanes_layout). Zero point "15" is the grid's top (255
    for u8), "128" u8's middle."""
    kp, groups, top = -(-k // 32) * 32, -(-k // group), (1 << bits) - 1
    q = rng.integers(0, top + 1, (n, kp)).astype(np.uint8)
    q[:, k:] = 0
    s = {
        "normal": rng.uniform(1e-3, 0.1, (n, groups)),
        "huge": rng.uniform(1e3, 6e4, (n, groups)),
        "denormal": rng.uniform(1e-7, 5e-6, (n, groups)),
    }[scale].astype(np.float16)
    z = {
        "0": np.zeros((n, groups)),
        "15": np.full((n, groups), top),
        "128": np.full((n, groups), 128),
        "f16": rng.uniform(0, top, (n, groups)),
        "u8": rng.integers(0, 256, (n, groups)),
    }[zero]
    z = z.astype(np.float16)
    if lanes:
        packed, sz = lanes_layout(q if bits == 8 else (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8), s, z, bits)
    elif bits == 4:
        packed, sz = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8), scale_table(s, z)
    else:
        packed, z8 = u8_layout(q, z, isa)
        sz = scale_table(s, z8)
    w = (q[:, :k].astype(np.float64) - np.repeat(z, group, 1)[:, :k]) * np.repeat(s, group, 1)[:, :k]
    return packed, sz, w


def _octets(x: np.ndarray) -> tuple[np.ndarray, int]:
    """x [M, K] zero-padded to whole blocks of 32, as [M, octets, 8] (the op scales each octet of 8 values on its
    own: lowbit_kernel.hpp quantize_block), and K padded."""
    m, k = x.shape
    kp = -(-k // 32) * 32
    xb = np.zeros((m, kp), x.dtype)
    xb[:, :k] = x
    return xb.reshape(m, -1, 8), kp


def _bound(x: np.ndarray, w: np.ndarray, width: int = 8) -> np.ndarray:
    """The most int8 activations can move y: each x moves by at most half its run's step (max|x| / 127 / 2, runs of
    `width` values: octets, or blocks of 32), so |dy| <= sum over octets of (max|x| of its run / 254) * sum |w_o|;
    plus f32 rounding of the sums."""
    xo, kp = _octets(np.abs(x))
    amax = np.repeat(xo.reshape(x.shape[0], -1, width).max(-1), width // 8, axis=1)  # [M, octets]: its run's
    wb = np.zeros((w.shape[0], kp))
    wb[:, : w.shape[1]] = np.abs(w)
    wsum = wb.reshape(w.shape[0], -1, 8).sum(-1)  # [N, octets]
    return (amax / 254) @ wsum.T * (1 + 1e-3) + 1e-5 * (np.abs(x) @ np.abs(w).T) + 1e-30


def _int8(x: np.ndarray, width: int, second: bool = False) -> np.ndarray:
    """x (f32) through int8 per run of `width` values as the op rounds it (d = max|x| / 127 in f32, q = x / d rounded
    to nearest even), back to f64. `second`: and through the second digit the lanes tile adds at one row of u4 with
    `residual` (lowbit_kernel.hpp quantize_block's `second`: (x / d - q) in 1/128ths, rounded, in f32)."""
    xo, _ = _octets(x.astype(np.float32))
    runs = xo.reshape(x.shape[0], -1, width)
    d = np.abs(runs).max(-1, keepdims=True) / np.float32(127)
    t = runs / np.where(d > 0, d, np.float32(1))
    q = np.rint(t).astype(np.float64)
    if second:
        q += np.rint((t - np.rint(t)) * np.float32(128)).astype(np.float64) / 128
    return (q * d).reshape(x.shape[0], -1)[:, : x.shape[1]]


# row-major, what the rewrite makes on AVX2, two AVX2 passes, and the lanes tile's (rewrite.layout: avx512vnni)
@pytest.mark.parametrize("row_group, slot_pairs", [(1, 1), (4, 1), (8, 1), (LANE_ROWS, 0)])
@pytest.mark.parametrize("isa", _paths())
@pytest.mark.parametrize(
    "n, k, group, zero, scale",
    [
        (67, 200, 64, "f16", "normal"),  # K not a multiple of 32 nor of the group, N odd
        (33, 256, 128, "0", "normal"),
        (5, 96, 32, "15", "huge"),
        (129, 1536, 128, "f16", "denormal"),
        (16, 4096, 128, "f16", "normal"),  # a group that spans four blocks, many groups
        (11, 320, 128, "15", "normal"),  # a last group of one pair and no unpaired block
        (9, 1120, 32, "f16", "normal"),  # Q4_1's groups of one block: 35 scales, read eight at a time, and a tail
        (21, 448, 64, "f16", "normal"),  # groups of one pair of blocks through the prefill tile, N odd
        (7, 1024, 256, "f16", "normal"),  # groups of four pairs
        (14, 640, 32, "f16", "normal"),  # Q4_1's groups of one block through the prefill tile: two scales a pair
        (600, 8192, 128, "f16", "normal"),  # the 512-bit tile past 4 rows of x: blocks of 64 rows, several a call
        (48, 576, 32, "f16", "normal"),  # lanes: the default model's K and Q4_1 groups
        (160, 1536, 64, "15", "normal"),  # lanes: groups of 8 chunks, 10 groups of rows
        (32, 1280, 256, "0", "huge"),  # lanes: groups of 32 chunks
        (16, 512, 128, "f16", "denormal"),
    ],
)
def test_op_matches_numpy_within_the_int8_bound(loaded, isa, n, k, group, zero, scale, row_group, slot_pairs):
    core, got = loaded
    if isa not in got.supported:
        pytest.skip(f"this CPU has no {isa} (it has {', '.join(got.supported)})")
    if slot_pairs == 0 and layout(isa, 4, n, k, group) != (row_group, slot_pairs):
        pytest.skip(f"lanes are the 512-bit tile's layout, not {isa}'s at N {n}, K {k}, group {group}")
    rng = np.random.default_rng(n * 1000 + k)
    packed, sz, w = _case(rng, n, k, group, zero, scale)
    if slot_pairs == 0:
        packed, sz = _lanes(packed, sz)
    else:
        packed = row_groups(packed, row_group)  # N rounded up to row_group, zero rows past N
    assert packed.shape == (-(-n // row_group) * row_group, -(-k // 32) * 16)
    model = _op_model(got.factory, k, packed, sz, group, isa, row_group=row_group, slot_pairs=slot_pairs)
    compiled = core.compile_model(model, "CPU", F32)
    # From 4: MTILE rows of x per pass (5, 11, 37: and the rest one at a time); grouped u4 with an even number of blocks
    # runs the prefill tile, over blocks of rows (129 x 1536: two).
    for m in (1, 2, 3, 4, 5, 8, 11, 16, 37):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[:, ::7] *= 50  # outliers, as residual streams have
        x[0, :3] = [1e-40, -3e-39, 0.0]  # denormals
        y = compiled(x)[0]
        exact = x.astype(np.float64) @ w.T
        assert y.shape == (m, n) and np.isfinite(y).all()
        over = np.abs(y - exact) - _bound(x.astype(np.float64), w, _width(slot_pairs, m))
        assert over.max() <= 0, f"M={m}: beyond the int8 bound by {over.max()}"


# row-major (what the rewrite makes on AVX2 and AVX-VNNI, and on AVX512-VNNI), grouped (the kernel takes it)
@pytest.mark.parametrize("row_group", [1, 4, 8])
@pytest.mark.parametrize("isa", list(U8_ISAS))
@pytest.mark.parametrize(
    "n, k, group, zero, scale",
    [
        (67, 200, 64, "f16", "normal"),  # K not a multiple of 64 (an unpaired last block), N odd
        (33, 1536, 1536, "u8", "normal"),  # per output channel, as NNCF's int8 LM head
        (5, 96, 32, "15", "huge"),  # zero point 255: w - z down to -255
        (129, 256, 256, "0", "denormal"),  # zero point 0: w - z up to 255
        (31, 352, 32, "128", "huge"),  # zero point 128 (0 in AVX2's s8), 11 blocks
        (7, 1600, 64, "0", "normal"),  # 25 blocks: u8 0 (s8 -128) against negative x in every block
    ],
)
def test_u8_op_matches_numpy_within_the_int8_bound(loaded, isa, n, k, group, zero, scale, row_group):
    """bits=8 in each path's u8_layout: VNNI sums u8 x s8 in i32 (vpdpbusd); AVX2 takes s8 = u8 - 128 through
    maddubs(|w|, sign(x, w)), whose i16 pairs (at most 2 x 128 x 127) cannot saturate."""
    core, got = loaded
    if isa not in got.supported:
        pytest.skip(f"this CPU has no {isa} (it has {', '.join(got.supported)})")
    rng = np.random.default_rng(n * 1000 + k + 8)
    packed, sz, w = _case(rng, n, k, group, zero, scale, bits=8, isa=isa)
    packed = row_groups(packed, row_group, pair_bytes=64)
    compiled = core.compile_model(
        _op_model(got.factory, k, packed, sz, group, isa, bits=8, row_group=row_group), "CPU", F32
    )
    for m in (1, 3, 4, 7, 9):  # from 4: MTILE rows of x per pass over grouped rows (7, 9: and the rest one at a time)
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[:, ::7] *= 50
        x[0, :3] = [1e-40, -3e-39, 0.0]
        x[-1] = -np.abs(x[-1])  # every product of an s8 -128 against a negative x
        y = compiled(x)[0]
        exact = x.astype(np.float64) @ w.T
        assert y.shape == (m, n) and np.isfinite(y).all()
        over = np.abs(y - exact) - _bound(x.astype(np.float64), w)
        assert over.max() <= 0, f"M={m}: beyond the int8 bound by {over.max()}"


@pytest.mark.parametrize(
    "n, k, group, zero, scale",
    [
        (48, 1536, 1536, "u8", "normal"),  # per output channel, as NNCF's int8 LM head
        (32, 256, 256, "0", "denormal"),  # zero point 0: w - z up to 255
        (16, 96, 32, "15", "huge"),  # zero point 255: w - z down to -255, 3 blocks
    ],
)
def test_u8_in_lanes_matches_numpy_within_the_int8_bound(loaded, n, k, group, zero, scale):
    """AVX512-VNNI's u8 (the LM head) in lanes of 16 rows (rewrite.lanes_layout bits 8): each 64-byte chunk 4 values
    of K of the 16 rows, one vpdpbusd as read; x per block of 32 (_width)."""
    core, got = loaded
    if "avx512vnni" not in got.supported:
        pytest.skip(f"this CPU has no avx512vnni (it has {', '.join(got.supported)})")
    rng = np.random.default_rng(n * 1000 + k + 9)
    packed, sz, w = _case(rng, n, k, group, zero, scale, bits=8, lanes=True)
    assert layout("avx512vnni", 8, n, k, group) == (LANE_ROWS, 0)
    model = _op_model(got.factory, k, packed, sz, group, "avx512vnni", bits=8, row_group=LANE_ROWS, slot_pairs=0)
    compiled = core.compile_model(model, "CPU", F32)
    for m in (1, 2, 3, 8, 9):  # 9: a full tile of 8 rows of x and one more
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[:, ::7] *= 50
        x[-1] = -np.abs(x[-1])
        y = compiled(x)[0]
        assert y.shape == (m, n) and np.isfinite(y).all()
        over = np.abs(y - x.astype(np.float64) @ w.T) - _bound(x.astype(np.float64), w, _width(0, m, bits=8))
        assert over.max() <= 0, f"M={m}: beyond the int8 bound by {over.max()}"


@pytest.mark.parametrize("isa", _paths())
@pytest.mark.parametrize("n", [40, 48])  # 48: a multiple of 16, the lanes tile on AVX512-VNNI
def test_each_octet_of_x_has_its_own_int8_scale(loaded, isa, n):
    """An outlier coarsens only its own octet's int8 step: y is the exact product with x rounded per 8 values, and far
    from x rounded per block of 32, where the unit values beside a 1e3 in every block would round to 0. At the row
    counts of the decode tiles, the prefill tile and the 512-bit tile's several rows, in the rewrite's row layout;
    the lanes tile (AVX512-VNNI) rounds per block of 32 from 4 rows (_width), exactly that."""
    core, got = loaded
    if isa not in got.supported:
        pytest.skip(f"this CPU has no {isa} (it has {', '.join(got.supported)})")
    rng = np.random.default_rng(23)
    k, group = 1024, 128
    packed, sz, w = _case(rng, n, k, group, "f16", "normal")
    _, slot = layout(isa, 4, n, k, group)
    compiled = core.compile_model(_rewrite_layout(got.factory, k, packed, sz, group, isa), "CPU", F32)
    for m in (1, 2, 3, 4, 8):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[:, ::32] = 1e3  # each block's first octet: an outlier and ...
        for i in range(1, 8):
            x[:, i::32] = 0.0  # ... zeros, which the octet's coarse step keeps exact
        y = compiled(x)[0].astype(np.float64)
        per_octet, per_block = _int8(x, 8) @ w.T, _int8(x, 32) @ w.T
        sums = 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(w).T)  # f32 rounding of the sums
        want = per_block if _width(slot, m) == 32 else per_octet
        assert (np.abs(y - want) <= sums).all(), f"M={m}: not x rounded per {_width(slot, m)} values"
        assert np.median(np.abs(per_block - per_octet) / sums) > 10, "the case does not tell the two apart"


@pytest.mark.parametrize("isa", _paths())
@pytest.mark.parametrize(
    "n, k, group",
    [
        (37, 1100, 64),  # a last octet of 4 values, an odd number of blocks (the general tile)
        (96, 1536, 128),  # the prefill tile from 2 rows of x (4 with the residual's), the lanes tile
    ],
)
def test_residual_runs_x_rounding_error_too(loaded, isa, n, k, group):
    """residual=1 (the attention projections' option: kernels.RESIDUAL_ENV): y's error is what the residual's own
    int8 rounding leaves, ~127x under one pass's, which the case checks it could not meet. x is rounded per octet
    then at every row count, in lanes too (the residual is x's error per octet); at one row in lanes the error is a
    second int8 digit of x (_int8's `second`)."""
    core, got = loaded
    if isa not in got.supported:
        pytest.skip(f"this CPU has no {isa} (it has {', '.join(got.supported)})")
    rng = np.random.default_rng(k + n)
    packed, sz, w = _case(rng, n, k, group, "f16", "normal")
    once, twice = (
        core.compile_model(_rewrite_layout(got.factory, k, packed, sz, group, isa, residual=r), "CPU", F32)
        for r in (0, 1)
    )
    lanes = layout(isa, 4, n, k, group)[1] == 0
    for m in (1, 2, 3, 5):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[:, ::7] *= 50
        exact = x.astype(np.float64) @ w.T
        bound = _bound((x - _int8(x, 8)).astype(np.float64), w) + 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(w).T)
        if lanes and m == 1:  # as exact as the f32 sums, around x's two digits
            exact, bound = _int8(x, 8, second=True) @ w.T, 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(w).T)
        y = twice(x)[0]
        assert y.shape == (m, n) and (np.abs(y - exact) <= bound).all(), f"M={m}: beyond the residual's bound"
        assert np.median(np.abs(once(x)[0] - exact) / bound) > 2, "one pass would meet the bound too"


def test_residual_2_is_a_second_digit_of_x_at_one_row_in_lanes(loaded):
    """residual=2 (every other u4 op where asked: rewrite.residual_of): at one row of x in lanes, y is x's two int8
    digits times w up to the f32 sums' rounding, which one digit is far from, a gated op's too; at more rows the
    same outputs as without it (no rows doubled); and residual 1 (rows doubled) is refused beside gated."""
    core, got = loaded
    n, k, group, isa = 192, 1536, 128, "avx512vnni"
    if isa not in got.supported:
        pytest.skip(f"this CPU has no {isa}: lanes are its layout")
    assert layout(isa, 4, n, k, group)[1] == 0
    rng = np.random.default_rng(21)
    packed, sz, w = _case(rng, n, k, group, "f16", "normal")
    plain, digits = (
        core.compile_model(_rewrite_layout(got.factory, k, packed, sz, group, isa, residual=r), "CPU", F32)
        for r in (0, 2)
    )
    gated = core.compile_model(_rewrite_layout(got.factory, k, packed, sz, group, isa, residual=2, gated=1), "CPU", F32)
    for m in (1, 2, 3, 5):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[:, ::7] *= 50
        y, y0 = digits(x)[0], plain(x)[0]
        g, u = y[:, : n // 2].astype(np.float64), y[:, n // 2 :].astype(np.float64)
        np.testing.assert_allclose(gated(x)[0], g * u / (1 + np.exp(-g)), rtol=2e-6, atol=1e-6 * np.abs(y).max())
        if m > 1:
            np.testing.assert_array_equal(y, y0)
            continue
        want, sums = _int8(x, 8, second=True) @ w.T, 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(w).T)
        assert (np.abs(y - want) <= sums).all(), "not x's two digits"
        assert np.median(np.abs(y0 - want) / sums) > 10, "one digit would be as near"
    with pytest.raises(Exception, match="not beside residual 1"):
        _rewrite_layout(got.factory, k, packed, sz, group, isa, residual=1, gated=1)


def test_u8_needs_a_named_path(loaded):
    """bits=8 weights are laid out for one path (u8 on VNNI, s8 on AVX2): "auto" could run another's."""
    _, got = loaded
    packed, sz, _ = _case(np.random.default_rng(5), 4, 64, 64, "0", "normal", bits=8)
    with pytest.raises(Exception, match="bits 8 needs a named isa"):
        _op_model(got.factory, 64, packed, sz, 64, "auto", bits=8)
    with pytest.raises(Exception, match="bits must be 4 or 8"):
        _op_model(got.factory, 64, packed, sz, 64, "avx2", bits=6)


def test_lanes_only_where_the_512_bit_tile_reads_them(loaded):
    """slot_pairs 0 is AVX512-VNNI's layout in lanes of 16 rows (rewrite.layout): any other path, row group or
    N would read the weights in another order, so the op refuses it; 2 (the grouped slots before) is gone."""
    core, got = loaded
    packed, sz, _ = _case(np.random.default_rng(5), 16, 256, 128, "0", "normal")
    named = [("avx512vnni", 8)] if "avx512vnni" in got.supported else []  # else refused as a path this CPU lacks
    for isa, rg in [("avx2", LANE_ROWS), ("auto", LANE_ROWS), *named]:
        with pytest.raises(Exception, match="slot_pairs 0 \\(lanes\\) needs"):
            _op_model(got.factory, 256, packed, sz, 128, isa, row_group=rg, slot_pairs=0)
    with pytest.raises(Exception, match="slot_pairs must be 0 or 1"):
        _op_model(got.factory, 256, packed, sz, 128, "avx2", slot_pairs=2)
    if "avx512vnni" in got.supported:  # N 15: not whole lanes
        model = _op_model(got.factory, 256, packed[:15], sz[:15], 128, "avx512vnni", row_group=16, slot_pairs=0)
        with pytest.raises(Exception, match="N of 16"):
            core.compile_model(model, "CPU", F32)(np.ones((1, 256), np.float32))


@pytest.mark.parametrize("bits", [4, 8])
def test_lanes_layout_puts_each_rows_chunk_where_the_tile_reads_it(bits):
    """rewrite.lanes_layout by its definition, index by index (no library needed): group G of 16 rows, chunk c of K
    (8 u4 values or 4 u8), row l in the group -> bytes [G, c, l, 0..3]; u4 byte i holds values 8c + i (low nibble)
    and 8c + 4 + i (high); the table [G, group of K, scales then zero points, l]."""
    rng = np.random.default_rng(11)
    n, k, g = 48, 256, 64
    values = rng.integers(0, 16 if bits == 4 else 256, (n, k), dtype=np.uint8)
    packed = (values[:, 0::2] | values[:, 1::2] << 4).astype(np.uint8) if bits == 4 else values
    scale = rng.random((n, k // g)).astype(np.float16)
    zero = rng.integers(0, 16, (n, k // g)).astype(np.float16)
    out, table = lanes_layout(packed, scale, zero, bits)
    per = 8 if bits == 4 else 4  # values of K per 4 bytes of a row
    got = out.reshape(n // LANE_ROWS, k // per, LANE_ROWS, 4)
    rows = table.view(np.float16).reshape(n // LANE_ROWS, k // g, 2, LANE_ROWS)
    for r in range(n):
        grp, lane = divmod(r, LANE_ROWS)
        for c in range(k // per):
            chunk = values[r, c * per : (c + 1) * per]
            want = chunk[:4] | chunk[4:] << 4 if bits == 4 else chunk
            assert got[grp, c, lane].tolist() == want.tolist(), (r, c)
        assert rows[grp, :, 0, lane].tolist() == scale[r].tolist()
        assert rows[grp, :, 1, lane].tolist() == zero[r].tolist()


@pytest.mark.parametrize("k", [128, 160])  # 160: two pairs of 32-blocks and a last unpaired block
def test_pair_layout_orders_each_pair_of_blocks_even_then_odd(k):
    """rewrite.pair_layout by its definition (no library needed): per pair of 32-blocks the first's even bytes, the
    second's even, the first's odd, the second's odd; a last unpaired block its even bytes, then its odd."""
    q = np.random.default_rng(13).integers(0, 256, (5, k), dtype=np.uint8)
    out = pair_layout(q)
    for row in range(5):
        want: list[int] = []
        for p in range(k // 64):
            a, b = q[row, 64 * p : 64 * p + 32], q[row, 64 * p + 32 : 64 * p + 64]
            want += [*a[0::2], *b[0::2], *a[1::2], *b[1::2]]
        if k % 64:
            last = q[row, -32:]
            want += [*last[0::2], *last[1::2]]
        assert out[row].tolist() == [int(v) for v in want]


def test_every_path_gives_the_same_answer(loaded):
    """AVX2 (maddubs) and VNNI (dpbusd) sum the same integer products: the same outputs, up to the order of the f32
    sums (the 512-bit tile adds 16 lanes where the 256-bit one adds 8), at every row count the tiles split into."""
    core, got = loaded
    rng = np.random.default_rng(7)
    packed, sz, _ = _case(rng, 77, 640, 128, "f16", "normal")
    x = rng.standard_normal((11, 640)).astype(np.float32)
    compiled = {
        isa: core.compile_model(_op_model(got.factory, 640, packed, sz, 128, isa), "CPU", F32) for isa in got.supported
    }
    for rows in (1, 2, 3, 4, 5, 6, 8, 11):
        outs = {isa: c(x[:rows])[0] for isa, c in compiled.items()}
        first = next(iter(outs.values()))
        scale = np.abs(first).max()
        for isa, y in outs.items():
            np.testing.assert_allclose(y, first, rtol=0, atol=1e-6 * scale, err_msg=f"{isa}, {rows} rows")


def test_zero_rows_and_denormal_only_activations(loaded):
    core, got = loaded
    packed, sz, w = _case(np.random.default_rng(1), 9, 64, 32, "f16", "normal")
    compiled = core.compile_model(_op_model(got.factory, 64, packed, sz, 32, "auto"), "CPU", F32)
    assert compiled(np.zeros((0, 64), np.float32))[0].shape == (0, 9)
    x = np.full((2, 64), 1e-42, np.float32)
    y = compiled(x)[0]
    assert np.isfinite(y).all() and np.abs(y - x.astype(np.float64) @ w.T).max() < 1e-30


@pytest.mark.parametrize("isa", _paths())
def test_a_row_of_x_with_inf_or_nan_leaves_the_other_rows_alone(loaded, isa):
    """Rows of x are different requests of a batch: one whose activations overflowed (inf, NaN) must not reach
    another's output. The decode tile reads a row's group sums 8 at a time, past the row's last group into the next
    row's, and masks them off: 12 groups (K = 1536, g128) put 4 of the next row's sums in each row's last read."""
    core, got = loaded
    if isa not in got.supported:
        pytest.skip(f"this CPU has no {isa} (it has {', '.join(got.supported)})")
    rng = np.random.default_rng(11)
    n, k, group = 24, 1536, 128
    packed, sz, w = _case(rng, n, k, group, "f16", "normal")
    compiled = core.compile_model(_rewrite_layout(got.factory, k, packed, sz, group, isa), "CPU", F32)
    for m in (3, 6):  # decode tiles only; the prefill tile's 4 rows and 2 more
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[1, 5], x[m - 2, 700] = np.inf, np.nan
        y = compiled(x)[0]
        good = [i for i in range(m) if i not in (1, m - 2)]
        xg = x[good].astype(np.float64)
        assert np.isfinite(y[good]).all(), f"M={m}: a bad row reached another"
        assert (np.abs(y[good] - xg @ w.T) - _bound(xg, w)).max() <= 0, f"M={m}"


def test_an_isa_the_cpu_lacks_is_refused_at_build_time(loaded):
    _, got = loaded
    missing = [isa for isa in kernels.ISAS if isa not in got.supported]
    if not missing:
        pytest.skip("this CPU runs every path")
    packed, sz, _ = _case(np.random.default_rng(2), 4, 64, 32, "0", "normal")
    with pytest.raises(Exception, match="cannot run"):
        _op_model(got.factory, 64, packed, sz, 32, missing[0])


# ---------------------------------------------------------------- the rewrite at load


def _chain(rng, n: int, k: int, group: int, zero_kind: str) -> ov.Node:
    """A u4 decompression chain as NNCF writes it (u4 zero point), as export/grid.py does (f16 zero point), or
    a chain the rewrite must leave alone (i4 symmetric, no zero point)."""
    groups = k // group
    if zero_kind == "i4":
        q = rng.integers(-8, 8, (n, groups, group)).astype(np.int8)
        out = ops.convert(ops.constant(q, ov.Type.i4), ov.Type.f16)
    else:
        q = rng.integers(0, 16, (n, groups, group)).astype(np.uint8)
        out = ops.convert(ops.constant(q, ov.Type.u4), ov.Type.f16)
        zp = rng.integers(0, 16, (n, groups, 1)).astype(np.uint8)
        zero = (
            ops.convert(ops.constant(zp, ov.Type.u4), ov.Type.f16)
            if zero_kind == "u4"
            else ops.constant(zp.astype(np.float16) + np.float16(0.25))
        )
        out = ops.subtract(out, zero)
    out = ops.multiply(out, ops.constant(rng.uniform(1e-3, 2e-2, (n, groups, 1)).astype(np.float16)))
    return ops.convert(ops.reshape(out, ops.constant(np.array([n, k], np.int64)), False), ov.Type.f32)


def _model(zero_kinds: list[str], n: int = 96, k: int = 256, group: int = 128) -> ov.Model:
    rng = np.random.default_rng(3)
    x = ops.parameter([-1, -1, k], ov.Type.f32)
    return ov.Model([ops.matmul(x, _chain(rng, n, k, group, z), False, True) for z in zero_kinds], [x])


def _u8_head(rng, n: int, k: int) -> ov.Node:
    """NNCF's int8 LM head: u8 per output channel, u8 zero point, f16 scale, no Reshape."""
    q = ops.convert(ops.constant(rng.integers(0, 256, (n, k)).astype(np.uint8)), ov.Type.f16)
    zero = ops.convert(ops.constant(rng.integers(100, 156, (n, 1)).astype(np.uint8)), ov.Type.f16)
    scale = ops.constant(rng.uniform(1e-4, 2e-3, (n, 1)).astype(np.float16))
    return ops.convert(ops.multiply(ops.subtract(q, zero), scale), ov.Type.f32)


@pytest.mark.parametrize("n", [200, 208])  # 208: whole lanes of 16 rows on AVX512-VNNI
@pytest.mark.parametrize("isa", _paths())
def test_rewrite_takes_u8_heads_in_each_paths_layout(loaded, isa, n):
    core, got = loaded
    if isa not in got.supported:
        pytest.skip(f"this CPU has no {isa}")

    def head() -> ov.Model:
        x = ops.parameter([-1, 320], ov.Type.f32)
        return ov.Model([ops.matmul(x, _u8_head(np.random.default_rng(6), n, 320), False, True)], [x])

    native, ours = head(), head()
    assert rewrite(ours, got.factory, isa) == (1 if isa in U8_ISAS else 0)
    [op] = [node for node in ours.get_ordered_ops() if node.get_type_name() == OP]
    packed = op.input_value(1).get_node().get_data()
    q = np.random.default_rng(6).integers(0, 256, (n, 320)).astype(np.uint8)  # _u8_head's first draw
    rg, slot = layout(isa, 8, n, 320, 320)  # AVX2: rows grouped by 4; AVX512-VNNI: lanes, row-major at N 200
    if slot == 0:
        want = lanes_layout(q, np.ones((n, 1)), np.zeros((n, 1)), bits=8)[0]
    else:
        want = row_groups(pair_layout(q) ^ np.uint8(U8_ISAS[isa]), rg, pair_bytes=64)
    assert np.array_equal(packed, want)  # AVX2: s8 = u8 - 128
    assert (op.get_attributes()["row_group"], op.get_attributes()["slot_pairs"]) == (rg, slot)
    x = np.random.default_rng(4).standard_normal((3, 320)).astype(np.float32)
    want, have = core.compile_model(native, "CPU", F32)(x)[0], core.compile_model(ours, "CPU", F32)(x)[0]
    assert np.abs(want - have).max() <= 0.02 * np.abs(want).max()


def _i8_head(rng, n: int, k: int) -> tuple[ov.Node, np.ndarray]:
    """An i8 symmetric head per 32 values (the Q8_0 grid, as the default model's export has it): i8 [N, G, 32],
    f16 scale per group, no zero point, a Reshape to [N, K]; and its weights as f64 [N, K]."""
    q = rng.integers(-128, 128, (n, k // 32, 32)).astype(np.int8)
    scale = rng.uniform(1e-4, 2e-3, (n, k // 32, 1)).astype(np.float16)
    chain = ops.multiply(ops.convert(ops.constant(q), ov.Type.f16), ops.constant(scale))
    w = (q.astype(np.float64) * scale.astype(np.float64)).reshape(n, k)
    return ops.convert(ops.reshape(chain, ops.constant(np.array([n, k], np.int64)), False), ov.Type.f32), w


def _with_head(x: ov.Node, head: ov.Node, layer: bool) -> ov.Model:
    """logits = x @ head (the `logits` output: rewrite.logits_op), beside a u4 layer reading x where `layer`."""
    logits = ops.matmul(x, head, False, True)
    logits.output(0).get_tensor().set_names({"logits"})
    layers = [
        ops.matmul(
            x, _chain(np.random.default_rng(10), 256, x.get_partial_shape()[-1].get_length(), 64, "u4"), False, True
        )
    ] * layer
    return ov.Model([logits, *layers], [x])


@pytest.mark.parametrize("n", [200, 208])  # 208: whole lanes of 16 rows on AVX512-VNNI
@pytest.mark.parametrize("isa", _paths())
def test_rewrite_takes_an_i8_symmetric_head_in_lanes_alone_with_x_exact(loaded, isa, n):
    """In lanes alone (AVX512-VNNI, N a multiple of 16) the i8 LM head becomes u8 = i8 + 128 about a zero point of
    128, its op's residual 1: at one row y is x's two int8 digits times w up to the f32 sums' rounding, at more rows
    within what the residual's own rounding leaves (rows doubled), each of which one digit would miss. Elsewhere it
    keeps OpenVINO's kernels: with x's one digit it moved a 135M model's next token (rewrite.SYMMETRIC_I8). An i8
    chain that is no LM head keeps them everywhere."""
    core, got = loaded
    if isa not in got.supported:
        pytest.skip(f"this CPU has no {isa}")
    k = 320
    head, w = _i8_head(np.random.default_rng(8), n, k)
    ours = _with_head(ops.parameter([-1, k], ov.Type.f32), head, layer=True)
    lanes = layout(isa, 8, n, k, 32)[1] == 0
    assert rewrite(ours, got.factory, isa) == (2 if lanes else 1)
    x = ops.parameter([-1, k], ov.Type.f32)
    plain = ov.Model([ops.matmul(x, _i8_head(np.random.default_rng(8), n, k)[0], False, True)], [x])
    assert rewrite(plain, got.factory, isa) == 0  # no `logits` output: no LM head
    if not lanes:
        return
    [op] = [
        node for node in ours.get_ordered_ops() if node.get_type_name() == OP and node.get_attributes()["bits"] == 8
    ]
    assert op.get_attributes()["residual"] == 1
    q = np.random.default_rng(8).integers(-128, 128, (n, k)).astype(np.int8)  # _i8_head's first draw, [N, G, 32]
    table = np.asarray(op.input_value(2).get_node().get_data()).view(np.float16)
    zeros = table.reshape(n // LANE_ROWS, k // 32, 2, LANE_ROWS)[:, :, 1]
    ones = np.ones((n, k // 32))
    want = lanes_layout(q.view(np.uint8) ^ np.uint8(128), ones, ones, bits=8)[0]
    assert np.array_equal(op.input_value(1).get_node().get_data(), want) and (zeros == 128).all()
    compiled = core.compile_model(ours, "CPU", F32)
    rng = np.random.default_rng(9)
    for m in (1, 3):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[:, ::7] *= 50
        y, sums = compiled(x)[0], 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(w).T)
        if m == 1:
            want, bound = _int8(x, 8, second=True) @ w.T, sums
        else:
            want, bound = x.astype(np.float64) @ w.T, _bound((x - _int8(x, 8)).astype(np.float64), w) + sums
        assert (np.abs(y - want) <= bound).all(), f"M={m}: beyond x's exact bound"
        assert np.median(np.abs(_int8(x, 8) @ w.T - want) / bound) > 2, f"M={m}: one digit would meet it too"


def test_the_lm_head_alone_takes_no_graph(loaded):
    """A model whose only MatMul the rewrite would take is its LM head keeps OpenVINO's kernels: its layers would not
    run ours (the default model, every layer under the floor, takes ours on all of them in its graphs of rows)."""
    _, got = loaded
    if "avx512vnni" not in got.supported:
        pytest.skip("the i8 head is taken in AVX512-VNNI's lanes alone")
    head = _i8_head(np.random.default_rng(10), 208, 256)[0]
    assert rewrite(_with_head(ops.parameter([-1, 256], ov.Type.f32), head, layer=False), got.factory, "avx512vnni") == 0


@pytest.mark.parametrize("n", [97, 96])
@pytest.mark.parametrize("isa", _paths())
def test_rewrite_takes_u4_chains_and_leaves_the_rest(loaded, isa, n):
    """Per path, with its weight layout (rewrite.layout: AVX2's rows in groups of 4, AVX512-VNNI's in lanes of 16;
    97 rows: a padded last group on AVX2, row-major on AVX512-VNNI)."""
    core, got = loaded
    if isa not in got.supported:
        pytest.skip(f"this CPU has no {isa}")
    native, ours = _model(["u4", "f16", "i4"], n=n), _model(["u4", "f16", "i4"], n=n)
    assert rewrite(ours, got.factory, isa) == 2
    kinds = [_producer(r).get_type_name() for r in ours.get_results()]
    assert kinds == [OP, OP, "MatMul"]
    groups = [n.get_attributes()["row_group"] for n in ours.get_ordered_ops() if n.get_type_name() == OP]
    # The two u4 siblings share one op where their rows need no padding, one each where groups of rows would pad 97.
    rg, _ = layout(isa, 4, n, 256, 128)  # _model's K and group
    assert groups == [rg] * (2 if n % rg else 1)
    x = np.random.default_rng(4).standard_normal((2, 3, 256)).astype(np.float32)
    want, have = core.compile_model(native, "CPU", F32)(x), core.compile_model(ours, "CPU", F32)(x)
    for i in range(3):
        a, b = want[i], have[i]
        assert a.shape == b.shape == (2, 3, n)
        assert np.abs(a - b).max() <= 0.02 * np.abs(a).max()  # int8 activations: ~0.5% measured
    np.testing.assert_array_equal(want[2], have[2])  # the i4 chain kept OpenVINO's kernel
    assert [_producer(r).get_friendly_name() for r in ours.get_results()][2:] == [
        n.get_friendly_name() for n in native_matmuls(ours, floor=0)
    ]
    assert len(native_matmuls(native, floor=0)) == 3 and not native_matmuls(native)  # under the floor: 97 x 256


def test_native_matmuls_are_those_with_a_weight(loaded):
    """A MatMul of two activations (attention's scores) is no weight left on OpenVINO's kernels."""
    x, y = ops.parameter([300, 400], ov.Type.f32), ops.parameter([300, 400], ov.Type.f32)
    assert not native_matmuls(ov.Model([ops.matmul(x, y, False, True)], [x, y]))


def _layers(count: int, n: int = 256) -> ov.Model:
    """`count` u4 layers (n x n, group 128) one after another, a ReLU between them."""
    rng = np.random.default_rng(5)
    x = ops.parameter([-1, n], ov.Type.f32)
    out = x.output(0)
    for _ in range(count):
        out = ops.relu(ops.matmul(out, _chain(rng, n, n, 128, "u4"), False, True)).output(0)
    return ov.Model([out], [x])


def test_each_op_reads_the_next_ones_weights_ahead_and_answers_the_same(loaded):
    """rewrite.link_ahead: every op but the last takes the next op's weights (the same constant) as its fourth
    input and reads them ahead between the two calls; the outputs are those of the ops without it, bit for bit."""
    core, got = loaded
    linked, plain = _layers(4), _layers(4)
    assert rewrite(linked, got.factory, got.isa) == rewrite(plain, got.factory, got.isa, ahead=False) == 4
    ours = [n for n in linked.get_ordered_ops() if n.get_type_name() == OP]
    assert [op.get_input_size() for op in ours] == [4, 4, 4, 3]
    for op, after in zip(ours, ours[1:]):
        ahead, weights = op.input_value(3).get_node(), after.input_value(1).get_node()
        assert ahead.get_friendly_name() == weights.get_friendly_name()
    assert all(op.get_input_size() == 3 for op in plain.get_ordered_ops() if op.get_type_name() == OP)
    a, b = core.compile_model(linked, "CPU", F32), core.compile_model(plain, "CPU", F32)
    for rows in (1, 3, 1):
        x = np.random.default_rng(rows).standard_normal((rows, 256)).astype(np.float32)
        np.testing.assert_array_equal(a(x)[0], b(x)[0])


def test_the_weights_read_ahead_must_be_bytes(loaded):
    _, got = loaded
    packed, sz, _ = _case(np.random.default_rng(5), 8, 256, 128, "0", "normal")
    x = ops.parameter([-1, 256], ov.Type.f32)
    inputs = [x.output(0), ops.constant(packed).output(0), ops.constant(sz).output(0)]
    attrs = {"group_size": 128, "isa": "avx2", "bits": 4, "row_group": 1, "residual": 0, "slot_pairs": 1}
    with pytest.raises(Exception, match="next op's w must be u8"):
        got.factory.create(OP, [*inputs, ops.constant(np.zeros(4, np.float32)).output(0)], attrs)
    assert got.factory.create(OP, [*inputs, ops.constant(packed).output(0)], attrs).get_input_size() == 4


def test_attention_projections_run_their_residual(loaded):
    """With residual (kernels.RESIDUAL_ENV), the ops of q/k/v (one op together) and o run x's int8 rounding error
    too (rewrite.ATTENTION_PROJ, by the export's module names); the MLP's only its second digit at one row, where
    its u4 sits in lanes (rewrite.residual_of); without it, none does."""
    _, got = loaded
    up = 2 if layout(got.isa, 4, 64, 256, 128)[1] == 0 else 0
    assert _attention_model(got, residual=False) == {"q_proj": 0, "up_proj": 0, "o_proj": 0}
    assert _attention_model(got, residual=True) == {"q_proj": 1, "up_proj": up, "o_proj": 1}


def _attention_model(got: kernels.Kernels, residual: bool) -> dict[str, int]:
    """q/k/v and o, and an MLP up_proj on another activation, rewritten: each op's `residual` by its module."""
    rng = np.random.default_rng(9)
    x, h = ops.parameter([-1, 256], ov.Type.f32), ops.parameter([-1, 256], ov.Type.f32)
    outputs = []
    for source, name in ((x, "self_attn.q_proj"), (x, "self_attn.k_proj"), (x, "self_attn.v_proj"), (h, "mlp.up_proj")):
        mm = ops.matmul(source, _chain(rng, 64, 256, 128, "u4"), False, True)
        mm.set_friendly_name(f"__module.model.layers.0.{name}/aten::linear/MatMul")
        outputs.append(mm)
    o = ops.matmul(outputs[0], _chain(rng, 64, 64, 64, "u4"), False, True)
    o.set_friendly_name("__module.model.layers.0.self_attn.o_proj/aten::linear/MatMul")
    model = ov.Model([*outputs[1:], o], [x, h])
    assert rewrite(model, got.factory, got.isa, residual=residual) == 5
    ops_ = [n for n in model.get_ordered_ops() if n.get_type_name() == OP]
    return {n.get_friendly_name().split(".")[-1].split("/")[0]: n.get_attributes()["residual"] for n in ops_}


def _producer(result: ov.Node) -> ov.Node:
    """The op behind a model output, through the VariadicSplit of a shared op."""
    node = result.input_value(0).get_node()
    return node.input_value(0).get_node() if node.get_type_name() == "VariadicSplit" else node


@pytest.mark.parametrize("isa", _paths())
def test_siblings_share_one_op_under_one_floor(loaded, isa):
    """q/k/v-like siblings (one activation, u4 g128) become one op over their rows and a split, even where k/v alone
    are under the weight floor; a sibling of another group size keeps its own op (or, under the floor alone,
    OpenVINO's kernel); siblings whose weights together are under the floor stay native."""
    core, got = loaded
    if isa not in got.supported:
        pytest.skip(f"this CPU has no {isa}")

    def model() -> ov.Model:
        rng = np.random.default_rng(8)
        x = ops.parameter([-1, 256], ov.Type.f32)
        shapes = [(64, 128), (16, 128), (16, 128), (32, 64)]  # q, k, v: 96 rows together; one of group 64
        return ov.Model([ops.matmul(x, _chain(rng, n, 256, g, "u4"), False, True) for n, g in shapes], [x])

    native, ours = model(), model()
    assert rewrite(ours, got.factory, isa, min_weights=64 * 256) == 3
    [op] = [n for n in ours.get_ordered_ops() if n.get_type_name() == OP]
    assert op.get_output_partial_shape(0)[-1].get_length() == 96
    kinds = [r.input_value(0).get_node().get_type_name() for r in ours.get_results()]
    assert kinds == ["VariadicSplit"] * 3 + ["MatMul"]
    x = np.random.default_rng(9).standard_normal((3, 256)).astype(np.float32)
    want, have = core.compile_model(native, "CPU", F32)(x), core.compile_model(ours, "CPU", F32)(x)
    for i in range(4):
        assert want[i].shape == have[i].shape
        assert np.abs(want[i] - have[i]).max() <= 0.02 * np.abs(want[i]).max()
    assert rewrite(model(), got.factory, isa, min_weights=0) == 4  # the group-64 sibling on an op of its own
    assert rewrite(model(), got.factory, isa, min_weights=160 * 256 + 1) == 0  # all four together under it


@pytest.mark.parametrize("gate_first", [True, False])
@pytest.mark.parametrize("isa", _paths())
def test_a_swiglu_becomes_one_gated_op(loaded, isa, gate_first):
    """silu(gate) * up over two sibling u4 MatMuls (Llama's and Qwen's MLP) becomes one op whose output is the
    product (rewrite.swiglu: no split, no Swish, no Multiply left), equal to the same op's halves gated in numpy, at
    1 and 2 threads and every row count the tiles split into; with the gate's output read elsewhere too, or a Swish
    beta other than 1, the siblings share an op as before and the graph gates."""
    core, got = loaded
    if isa not in got.supported:
        pytest.skip(f"this CPU has no {isa}")
    n, k = 96, 256

    def model(extra: bool = False, beta: float | None = None) -> ov.Model:
        rng = np.random.default_rng(12)
        x = ops.parameter([-1, -1, k], ov.Type.f32)
        first, second = (ops.matmul(x, _chain(rng, n, k, 128, "u4"), False, True) for _ in range(2))
        gate, up = (first, second) if gate_first else (second, first)
        act = ops.swish(gate) if beta is None else ops.swish(gate, ops.constant(np.float32(beta)))
        outs = [ops.multiply(act, up)] + ([gate] if extra else [])
        return ov.Model(outs, [x])

    gated, split = model(), model(extra=True)
    assert rewrite(gated, got.factory, isa) == rewrite(split, got.factory, isa) == 2
    [op] = [o for o in gated.get_ordered_ops() if o.get_type_name() == OP]
    assert op.get_attributes()["gated"] in (1, 2)  # which half is the gate: the plan's order of the siblings
    assert _producer(gated.get_results()[0]).get_type_name() == OP
    assert not {"Swish", "Multiply", "VariadicSplit"} & {o.get_type_name() for o in gated.get_ordered_ops()}
    [plain] = [o for o in split.get_ordered_ops() if o.get_type_name() == OP]
    assert plain.get_attributes()["gated"] == 0
    other = model(beta=1.5)
    rewrite(other, got.factory, isa)
    assert [o.get_attributes()["gated"] for o in other.get_ordered_ops() if o.get_type_name() == OP] == [0]
    rng = np.random.default_rng(13)
    for threads in (1, 2):
        want = core.compile_model(split, "CPU", {**F32, "INFERENCE_NUM_THREADS": threads})
        have = core.compile_model(gated, "CPU", {**F32, "INFERENCE_NUM_THREADS": threads})
        for m in (1, 2, 5, 9):
            x = rng.standard_normal((m, 1, k)).astype(np.float32)
            a, b = want(x)[0], have(x)[0]
            assert a.shape == b.shape == (m, 1, n)
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * np.abs(a).max())


@pytest.mark.parametrize("isa", _paths())
def test_an_mlp_becomes_one_op(loaded, isa):
    """down(silu(gate) * up) over u4 chains of one group size (Llama's and Qwen's MLP) becomes one op (`down`: the
    gated op runs the down projection of its product, rewrite.mlp), no MatMul, Swish or Multiply left, whose outputs
    are those of the gated op and the down op it replaces (the product also read elsewhere keeps them apart), at 1 and
    2 threads over every row count the tiles split into; the next op's weights are still its last input; a down
    projection of another group size keeps its own op."""
    core, got = loaded
    if isa not in got.supported:
        pytest.skip(f"this CPU has no {isa}")
    n, k = 2 * 96, 256  # the SwiGLU's width (96) is not a multiple of 128: the down projection's K groups by 32

    def model(extra: bool = False, down_group: int = 32, after: bool = False) -> ov.Model:
        rng = np.random.default_rng(21)
        x = ops.parameter([-1, -1, k], ov.Type.f32)
        gate, up = (ops.matmul(x, _chain(rng, n // 2, k, 32, "u4"), False, True) for _ in range(2))
        product = ops.multiply(ops.swish(gate), up)
        y = ops.matmul(product, _chain(rng, k, n // 2, down_group, "f16"), False, True)
        outs = [ops.matmul(y, _chain(rng, 64, k, 32, "u4"), False, True) if after else y]
        return ov.Model(outs + ([product] if extra else []), [x])

    fused, apart = model(), model(extra=True)
    assert rewrite(fused, got.factory, isa) == rewrite(apart, got.factory, isa) == 3
    assert [o.get_type_name() for o in fused.get_ordered_ops() if o.get_type_name() in (OP, "MatMul")] == [OP]
    [op] = [o for o in fused.get_ordered_ops() if o.get_type_name() == OP]
    assert op.get_attributes()["down"] == 1 and op.get_attributes()["gated"] in (1, 2)
    assert not {"Swish", "Multiply"} & {o.get_type_name() for o in fused.get_ordered_ops()}
    assert [o.get_attributes()["down"] for o in apart.get_ordered_ops() if o.get_type_name() == OP] == [0, 0]
    other = model(down_group=48)  # K 96 in groups of 48: the op's groups are 32 or a multiple of 64
    rewrite(other, got.factory, isa)
    assert [o.get_attributes()["down"] for o in other.get_ordered_ops() if o.get_type_name() == OP] == [0]
    linked = model(after=True)
    assert rewrite(linked, got.factory, isa) == 4
    first, second = [o for o in linked.get_ordered_ops() if o.get_type_name() == OP]
    assert first.get_input_size() == 6 and second.get_input_size() == 3
    assert first.input_value(5).get_node().get_instance_id() == second.input_value(1).get_node().get_instance_id()
    rng = np.random.default_rng(22)
    for threads in (1, 2):
        want = core.compile_model(apart, "CPU", {**F32, "INFERENCE_NUM_THREADS": threads})
        have = core.compile_model(fused, "CPU", {**F32, "INFERENCE_NUM_THREADS": threads})
        for m in (1, 2, 5, 9):
            x = rng.standard_normal((m, 1, k)).astype(np.float32)
            a, b = want(x)[0], have(x)[0]
            assert a.shape == b.shape == (m, 1, k)
            np.testing.assert_array_equal(b, a)


@pytest.mark.parametrize("gated", [1, 2])
@pytest.mark.parametrize("isa", _paths())
def test_a_gated_op_is_silu_of_one_half_times_the_other(loaded, isa, gated):
    """The op's `gated` 1 / 2: silu(first half) * second half / silu(second) * first, each task gating the rows it
    computed, in the path's own layout; the same as the ungated op's halves gated in numpy (float32 rounding), at 1
    and 2 threads, over every row count the tiles split into, with inputs that take exp(-g) to both clamps."""
    core, got = loaded
    if isa not in got.supported:
        pytest.skip(f"this CPU has no {isa}")
    n, k, group = 2 * 80, 512, 128
    rng = np.random.default_rng(gated)
    packed, sz, _ = _case(rng, n, k, group, "f16", "normal")
    plain = _rewrite_layout(got.factory, k, packed, sz, group, isa)
    fused = _rewrite_layout(got.factory, k, packed, sz, group, isa, gated=gated)
    assert fused.output(0).get_partial_shape()[-1].get_length() == n // 2
    for threads in (1, 2):
        props = {**F32, "INFERENCE_NUM_THREADS": threads}
        want, have = core.compile_model(plain, "CPU", props), core.compile_model(fused, "CPU", props)
        for m in (1, 2, 3, 5, 9):
            x = rng.standard_normal((m, k)).astype(np.float32) * 4
            x[0] *= 100  # gate values far past +-88
            y = want(x)[0].astype(np.float64)
            g, u = (y[:, : n // 2], y[:, n // 2 :]) if gated == 1 else (y[:, n // 2 :], y[:, : n // 2])
            expected = g * u / (1 + np.exp(np.clip(-g, -700, 700)))
            np.testing.assert_allclose(have(x)[0], expected, rtol=2e-6, atol=1e-6 * np.abs(expected).max())


def _with_logits(model: ov.Model, head: ov.Output | None = None) -> ov.Model:
    """`model` with a `logits` output: `head`'s MatMul of its first input, or its first result renamed."""
    if head is not None:
        out = ops.matmul(model.get_parameters()[0], head, False, True).output(0)
        model = ov.Model([out, *[r.input_value(0) for r in model.get_results()]], model.get_parameters())
    model.outputs[0].get_tensor().set_names({"logits"})
    return model


def test_prefill_fits_names_the_models_ours_serve_at_every_row_count(loaded):
    """rewrite.prefill_fits (the backends run ours alone, prefill too, where it holds): grouped u4 of a group the
    prefill tile takes and K a multiple of 64; a u8 op only as the LM head; a model with none of our ops never."""
    from appliance.runtime.kernels.rewrite import prefill_fits

    _, got = loaded

    def rewritten(model: ov.Model) -> ov.Model:
        rewrite(model, got.factory, "avx2")
        return model

    assert prefill_fits(rewritten(_model(["u4", "f16"])))  # g128, K = 256
    assert prefill_fits(rewritten(_model(["f16"], group=32)))  # Q4_1's g32
    assert not prefill_fits(rewritten(_model(["u4"], k=96, group=32)))  # three 32-blocks: an unpaired last one
    assert not prefill_fits(_model(["i4"]))  # nothing of ours
    rng = np.random.default_rng(5)
    assert prefill_fits(rewritten(_with_logits(_model(["u4"]), _u8_head(rng, 200, 256))))
    x = ops.parameter([-1, 256], ov.Type.f32)
    u4, u8 = (ops.matmul(x, w, False, True) for w in (_chain(rng, 64, 256, 128, "u4"), _u8_head(rng, 200, 256)))
    assert not prefill_fits(rewritten(_with_logits(ov.Model([u4, u8], [x]))))  # a u8 op that is not the head


# ---------------------------------------------------------------- fallbacks


@pytest.fixture(scope="module")
def other_abi(tmp_path_factory) -> Path:
    """The library built from these sources for another ABI, as a stale build beside newer Python code would be."""
    from appliance.runtime.kernels import build

    out = tmp_path_factory.mktemp("other-abi")
    try:
        return build.build(build.HERE, out, abi=kernels.ABI + 1)
    except RuntimeError as exc:
        ours_missing(f"the kernels library does not build here: {exc}")


def test_the_library_reports_the_abi_this_code_needs(loaded):
    _, got = loaded
    assert kernels._abi(ctypes.CDLL(str(got.path))) == kernels.ABI


def test_a_library_of_another_abi_is_refused_and_openvino_serves(loaded, other_abi, monkeypatch, caplog):
    """A stale library is never handed to OpenVINO (an older one asserted at its first call): one log line says
    why, and the model runs OpenVINO's kernels with their exact outputs."""
    core, _ = loaded
    caplog.set_level(logging.INFO, logger="appliance.runtime.kernels")
    monkeypatch.setenv(kernels.LIBRARY_ENV, str(other_abi))
    assert kernels._abi(ctypes.CDLL(str(other_abi))) == kernels.ABI + 1
    got, why = kernels.load(core)
    assert got is None and f"built for ABI {kernels.ABI + 1}, this code needs ABI {kernels.ABI}" in why
    model = _model(["u4", "f16"])
    assert kernels.apply(model, core, choice="ours", device="CPU", precision=None, name="m") == "openvino"
    assert not any(n.get_type_name() == OP for n in model.get_ordered_ops())
    x = np.random.default_rng(4).standard_normal((2, 3, 256)).astype(np.float32)
    have, want = core.compile_model(model, "CPU", F32)(x), core.compile_model(_model(["u4", "f16"]), "CPU", F32)(x)
    for i in range(2):
        np.testing.assert_array_equal(have[i], want[i])
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels: openvino")]
    assert len(lines) == 1 and f"ABI {kernels.ABI + 1}" in lines[0], lines


def test_a_library_from_before_the_abi_is_refused(loaded, monkeypatch, tmp_path):
    """A build older than the version symbol (it exports only appliance_kernels_isas) is refused the same way."""
    compiler = shutil.which("c++")
    if compiler is None:
        ours_missing("no c++ compiler (make venv needs one)")
    src = tmp_path / "old.cpp"
    src.write_text('extern "C" const char* appliance_kernels_isas() { return "avx2"; }\n')
    old = tmp_path / "libold.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(old), str(src)], check=True)
    monkeypatch.setenv(kernels.LIBRARY_ENV, str(old))
    got, why = kernels.load(loaded[0])
    assert got is None and "built for an older ABI (no version)" in why


def test_apply_falls_back_to_openvino_and_says_so(loaded, monkeypatch, tmp_path, caplog):
    core, _ = loaded
    caplog.set_level(logging.INFO, logger="appliance.runtime.kernels")

    def apply(choice: str = "auto", device: str = "CPU", precision: str | None = None) -> tuple[str, int]:
        model = _model(["u4"])
        label = kernels.apply(model, core, choice=choice, device=device, precision=precision, name="m")
        return label, sum(n.get_type_name() == OP for n in model.get_ordered_ops())

    assert apply()[0].startswith("appliance-") and apply()[1] == 1
    assert apply(choice="openvino") == ("openvino", 0)
    assert apply(precision="f32") == ("openvino", 0)  # int8 activations are not f32
    assert apply(choice="ours", precision="f32")[1] == 1
    assert apply(device="GPU") == ("openvino", 0)
    monkeypatch.setenv(kernels.LIBRARY_ENV, str(tmp_path / "absent.so"))
    assert apply() == ("openvino", 0)
    broken = tmp_path / "broken.so"
    broken.write_bytes(b"not a library")
    monkeypatch.setenv(kernels.LIBRARY_ENV, str(broken))
    assert apply() == ("openvino", 0)
    monkeypatch.delenv(kernels.LIBRARY_ENV)
    monkeypatch.setenv(kernels.ISA_ENV, "avx10")
    assert apply() == ("openvino", 0)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels: ")]
    assert any("absent.so is not built" in line for line in lines)
    assert any("did not load" in line for line in lines)
    assert any("--kernels openvino" in line for line in lines)


@pytest.mark.parametrize("isa", _paths())
def test_isa_env_forces_a_path(loaded, monkeypatch, isa):
    core, got = loaded
    if isa not in got.supported:
        pytest.skip(f"this CPU has no {isa}")
    monkeypatch.setenv(kernels.ISA_ENV, isa)
    model = _model(["u4"])
    assert kernels.apply(model, core, choice="auto", device="CPU", precision=None) == f"appliance-{isa}"
    (op,) = [n for n in model.get_ordered_ops() if n.get_type_name() == OP]
    assert op.get_attributes()["isa"] == isa


# ---------------------------------------------------------------- the served default model


def _paged_backend(kernels_choice: str, precision: str | None):
    """The paged backend on the default int4 export, and its vocabulary size."""
    import appliance.runtime.backends.openvino_paged as paged
    from appliance.config import EngineConfig
    from appliance.manifest import Manifest
    from export.default_model import ensure_export

    path = ensure_export("openvino", "int4")
    manifest = Manifest.load(path)
    config = EngineConfig(kernels=kernels_choice, precision=precision, kv_cache_tokens=512)
    return paged.OpenVINOPagedBackend(path, manifest, config), manifest.vocab_size


def _decode(
    kernels_choice: str, precision: str | None, feed: list[int] | None = None, steps: int = 8
) -> tuple[str, list[int], np.ndarray, int]:
    """Greedy decode of a fixed prompt on the default int4 export: (kernels label, tokens, logits per step, dynamic
    compiled models: 1 or 2). `feed`:
    the tokens to feed instead of its own (teacher forcing, so two runs compare the same contexts)."""
    from appliance.runtime.backends.base import StepBatch

    backend, vocab = _paged_backend(kernels_choice, precision)
    prompt = np.random.default_rng(0).integers(100, vocab, 40).tolist()
    try:
        table = list(range(3))
        logits = [backend.forward(StepBatch([prompt], [0], [table]))[0].copy()]
        tokens = [int(logits[-1].argmax())]
        for i in range(steps):
            fed = feed[i] if feed else tokens[-1]
            logits.append(backend.forward(StepBatch([[fed]], [len(prompt) + i], [table]))[0].copy())
            tokens.append(int(logits[-1].argmax()))
        graphs = 1 if backend._small is None else 2  # compiled models: ours alone, or ours beside OpenVINO's
        return backend.kernels, tokens, np.array(logits), graphs
    finally:
        backend.close()


def test_a_model_under_the_floor_runs_ours_in_single_token_steps_alone(loaded, monkeypatch):
    """The default model's layers are all under kernels.MIN_WEIGHTS: its single-token steps run ours in the graph
    of static shapes (kernels.ONE_TOKEN), every other step OpenVINO's kernels (the prefill's logits bit for bit)."""
    _, got = loaded
    monkeypatch.delenv(kernels.MIN_WEIGHTS_ENV)
    _, base_tokens, base_logits, _ = _decode("openvino", "f32")
    label, tokens, logits, graphs = _decode("ours", "f32", feed=base_tokens)
    assert label == got.label + kernels.ONE_TOKEN and graphs == 1  # no dynamic graph of ours
    np.testing.assert_array_equal(logits[0], base_logits[0])
    assert not np.array_equal(logits[1:], base_logits[1:])
    tvd = logits_tvd(logits, base_logits)
    assert np.median(tvd) <= 0.05 and tvd.max() <= 0.15, tvd
    assert sum(a == b for a, b in zip(tokens, base_tokens)) >= len(tokens) - 2, (tokens, base_tokens)


def test_f32_keeps_openvino_kernels_and_its_exact_outputs(loaded):
    """--precision f32 is transformers parity: the kernel stays off and greedy tokens and logits are OpenVINO's."""
    label, tokens, logits, _ = _decode("auto", "f32")
    base_label, base_tokens, base_logits, _ = _decode("openvino", "f32")
    assert label == base_label == "openvino"
    assert tokens == base_tokens
    np.testing.assert_array_equal(logits, base_logits)


@pytest.mark.parametrize("prefill_tile", [True, False])
def test_default_model_runs_our_kernels_close_to_f32(loaded, monkeypatch, prefill_tile):
    """On: decode steps run our op on every u4 layer of the default model (7 per layer). A prefill runs ours too
    where the path wins at every row count (kernels.prefills: AVX2, AVX512-VNNI without AMX): one compiled model;
    elsewhere (AVX-VNNI, AMX), OpenVINO's kernels, bit for bit, from a second compiled model. Next-token
    distributions stay close to OpenVINO's f32 on the same contexts (measured: TVD 0.014-0.040 per step, the same
    greedy tokens)."""
    _, got = loaded
    if prefill_tile and not kernels.prefills(got.isa):
        pytest.skip(f"the {got.isa} path has no prefill tile")
    if not prefill_tile:
        monkeypatch.setattr(kernels, "PREFILL_ISAS", ())
    _, base_tokens, base_logits, _ = _decode("openvino", "f32")
    label, tokens, logits, graphs = _decode("ours", "f32", feed=base_tokens)
    assert label == got.label
    # The 40-token prefill: ours with a prefill tile, else OpenVINO's; the decode steps are ours either way.
    assert graphs == (1 if prefill_tile else 2)
    assert np.array_equal(logits[0], base_logits[0]) != prefill_tile
    assert not np.array_equal(logits[1:], base_logits[1:])
    tvd = logits_tvd(logits, base_logits)
    assert np.median(tvd) <= 0.05 and tvd.max() <= 0.15, tvd
    assert sum(a == b for a, b in zip(tokens, base_tokens)) >= len(tokens) - 2, (tokens, base_tokens)


def test_rows_on_ours_per_path_and_beside_amx(loaded, monkeypatch):
    """Steps of how many tokens run ours: every step where the path prefills and the model fits the prefill tile;
    beside AMX, a model on the lanes tile up to LANES_ROWS_BESIDE_AMX (OpenVINO's AMX GEMM above); otherwise the
    path's KERNEL_ROWS. The paged backend on this CPU takes the same number for the default model (it fits)."""
    from appliance import cpu_isa

    for flags, amx in ((("avx2", "avx512f", "avx512_vnni"), False), (("avx512_vnni", "amx_bf16", "amx_int8"), True)):
        with monkeypatch.context() as patch:
            patch.setattr(cpu_isa, "detect", lambda flags=flags: cpu_isa.CpuIsa(flags))
            assert kernels.rows("avx512vnni", True) == (kernels.LANES_ROWS_BESIDE_AMX if amx else kernels.EVERY_ROW)
            assert kernels.rows("avx512vnni", False) == kernels.KERNEL_ROWS["avx512vnni"]
            assert kernels.rows("avx2", True) == kernels.EVERY_ROW
            assert kernels.rows("avx2", False) == kernels.KERNEL_ROWS["avx2"]
            assert kernels.rows("avxvnni", True) == kernels.rows("avxvnni", False) == kernels.KERNEL_ROWS["avxvnni"]
            assert kernels.rows("sse", True) == 0
    backend, _ = _paged_backend("ours", None)
    try:
        assert backend.kernel_rows == kernels.rows(loaded[1].isa, True)
    finally:
        backend.close()


def test_single_token_steps_run_a_graph_of_static_shapes(loaded):
    """A step of one token (batch-1 decode) runs a compiled model of the rewritten graph with one token's static
    shapes, a padded block table's too (row_graphs.graph), answering as the graph of dynamic shapes does; longer
    steps run that one, since the plugin's attention (an f32 KV cache here) gets no graphs of more rows."""
    from appliance.runtime.backends.base import StepBatch

    backend, vocab = _paged_backend("ours", "f32")
    try:
        assert list(backend._rows) == [1] and backend.kernels == loaded[1].label
        one_row = backend._rows[1]
        shapes = {port.get_any_name(): port.get_partial_shape() for port in one_row.model_inputs}
        # the caches' too where our attention takes them (test_decode_attention); the plugin's keeps them dynamic
        assert all(shape.is_static for name, shape in shapes.items() if "_cache." not in name), shapes
        assert shapes["block_indices"][0].get_length() == -(-backend.max_context // backend.block_size)
        prompt = np.random.default_rng(1).integers(100, vocab, 40).tolist()
        tables = [[0, 1, 2], [3, 4, 5]]
        first = int(backend.forward(StepBatch([prompt], [0], tables[:1]))[0].argmax())
        backend.forward(StepBatch([prompt], [0], tables[1:]))
        step = StepBatch([[first]], [len(prompt)], tables[:1])
        one = backend.forward(step)
        assert np.shares_memory(one, one_row.get_tensor("logits").data)
        one = one.copy()
        # The graph of dynamic shapes: beside OpenVINO's for prefill, or alone where ours take prefill too.
        dynamic_request = backend._small if backend._small is not None else backend.request
        backend._rows.clear()  # the same step again on the dynamic graph
        try:
            dynamic = backend.forward(step)
            assert np.shares_memory(dynamic, dynamic_request.get_tensor("logits").data)
        finally:
            backend._rows[1] = one_row
        np.testing.assert_allclose(one, dynamic[0:1], rtol=0, atol=1e-4 * np.abs(dynamic).max())
        assert one.argmax() == dynamic.argmax()
        two = backend.forward(StepBatch([[first], [first]], [len(prompt)] * 2, tables))  # two sequences: 2 tokens
        assert np.shares_memory(two, dynamic_request.get_tensor("logits").data) and two.shape[0] == 2
    finally:
        backend.close()


def test_single_token_steps_infer_in_f32_where_ours_take_every_matmul_but_the_head(loaded):
    """Our ops compute in f32: at the plugin's default precision the graphs of rows, whose MatMuls are all ours
    but the default model's i8 LM head, infer in f32 (no bf16 Reorders around each op); the graph of dynamic shapes
    keeps the plugin's default (bf16 where the CPU has it). A precision asked for is kept."""
    core, got = loaded
    backend, _ = _paged_backend("ours", None)
    try:
        for request in backend._rows.values():
            assert request.get_compiled_model().get_property("INFERENCE_PRECISION_HINT") == ov.Type.f32
        x = ops.parameter([4], ov.Type.f32)
        default = core.compile_model(ov.Model([ops.relu(x)], [x]), "CPU")
        precision = backend.compiled.get_property("INFERENCE_PRECISION_HINT")
        assert precision == default.get_property("INFERENCE_PRECISION_HINT")
    finally:
        backend.close()
    ours = _model(["u4", "i4"], n=512)  # weights of 2^17 values
    rewrite(ours, got.factory)
    assert kernels.row_graph_properties(ours, None) == {}  # the i4 MatMul is left on OpenVINO's kernels
    ours = _model(["u4"], n=512)
    assert kernels.row_graph_properties(ours, None) == {}
    rewrite(ours, got.factory)
    assert kernels.row_graph_properties(ours, None) == {"INFERENCE_PRECISION_HINT": "f32"}
    assert kernels.row_graph_properties(ours, "bf16") == {}


def test_a_plugin_that_refuses_our_op_leaves_openvino_serving(loaded, monkeypatch, caplog):
    """compile_with_kernels: a compile failure is one log line and None, never an exception; the paged backend then
    serves OpenVINO's kernels alone."""
    import appliance.runtime.backends.openvino_paged as paged
    from appliance.runtime.backends.openvino_common import compile_with_kernels

    core, got = loaded
    model = _model(["u4"])
    rewrite(model, got.factory)
    caplog.set_level(logging.WARNING)
    assert compile_with_kernels(model, "NO_SUCH_DEVICE", {}) is None
    assert any("compiling our kernels failed" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(paged, "compile_with_kernels", lambda *a: None)
    label, tokens, _, _ = _decode("ours", None, steps=2)
    assert label == "openvino" and len(tokens) == 3


def test_small_layers_keep_openvino(loaded, monkeypatch):
    """Under kernels.MIN_WEIGHTS our op's fixed cost per call outweighs what it saves: such MatMuls stay native."""
    core, got = loaded
    monkeypatch.delenv(kernels.MIN_WEIGHTS_ENV)
    small, large = _model(["u4"]), _model(["u4"], n=kernels.MIN_WEIGHTS[got.isa] // 256, k=256)
    assert kernels.apply(small, core, choice="auto", device="CPU", precision=None) == "openvino"
    assert kernels.apply(large, core, choice="auto", device="CPU", precision=None).startswith("appliance-")
    # A caller that runs single-token steps on a graph of their own: a model all under the floor takes ours there.
    small, large = _model(["u4"]), _model(["u4"], n=kernels.MIN_WEIGHTS[got.isa] // 256, k=256)
    assert kernels.apply(small, core, choice="auto", device="CPU", precision=None, one_token=True) == (
        got.label + kernels.ONE_TOKEN
    )
    assert kernels.apply(large, core, choice="auto", device="CPU", precision=None, one_token=True) == got.label


def test_build_without_a_compiler_says_so_and_does_not_fail_the_install(monkeypatch, capsys):
    """`make venv` on a box without g++/cmake: one line, exit 0 (OpenVINO's kernels serve); --require exits 1."""
    from appliance.runtime.kernels import build

    monkeypatch.setattr(build.shutil, "which", lambda tool: None)
    assert build.main([]) == 0
    assert "not built" in capsys.readouterr().err
    assert build.main(["--require"]) == 1


def _layer_types(request: ov.InferRequest) -> dict[str, int]:
    """How many nodes of each kind the CPU plugin runs (our op is a `Reference` node to it)."""
    counts: dict[str, int] = {}
    for node in request.get_compiled_model().get_runtime_model().get_ordered_ops():
        info = node.get_rt_info()
        kind = info["layerType"].astype(str) if "layerType" in info else node.get_type_name()
        counts[kind] = counts.get(kind, 0) + 1
    return counts


@pytest.mark.parametrize("prefill_tile", [True, False])
def test_static_shapes_run_ours_for_decode_and_for_prefill_where_the_path_has_a_prefill_tile(
    loaded, monkeypatch, prefill_tile
):
    from appliance.config import EngineConfig
    from appliance.manifest import Manifest
    from appliance.runtime.backends.openvino_static import OpenVINOStaticBackend
    from export.default_model import ensure_export

    if prefill_tile and not kernels.prefills(loaded[1].isa):
        pytest.skip(f"the {loaded[1].isa} path has no prefill tile")
    if not prefill_tile:
        monkeypatch.setattr(kernels, "PREFILL_ISAS", ())
    path = ensure_export("openvino", "int4")
    backend = OpenVINOStaticBackend(path, Manifest.load(path), EngineConfig(kernels="ours", static=True))
    try:
        decode, prefill = _layer_types(backend.requests["decode"]), _layer_types(backend.requests["prefill"])
    finally:
        backend.close()
    manifest = Manifest.load(path)
    ours = manifest.num_layers * 3  # q/k/v (one op: rewrite._plan), o, the MLP (one op: rewrite.mlp)
    # and the LM head (i8 symmetric per 32): ours where it fits the lanes (rewrite.SYMMETRIC_I8)
    head = int(layout(loaded[1].isa, 8, manifest.vocab_size, manifest.hidden_size, 32)[1] == 0)
    assert backend.kernels == loaded[1].label and backend.kernel_rows >= backend.max_batch
    assert decode.get("Reference") == ours + head
    assert prefill.get("Reference", 0) == (ours + head if prefill_tile else 0)
    assert prefill.get("FullyConnected", 0) == (1 - head if prefill_tile else manifest.num_layers * 7 + 1)
