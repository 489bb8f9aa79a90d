"""At load: each MatMul whose weight is OpenVINO's u4 decompression chain becomes our LowBitMatMul op (the model as
read, before compiling; the export on disk stays standard IR that OVMS and genai read).

The chain, as NNCF writes it (u4 zero point) and as export/grid.py writes the exact Q4_1 grid (f16 zero point):
    Constant u4 [N, G, gs] -> Convert -> Subtract(zero point) -> Multiply(scale) -> Reshape [N, K] -> (Convert f32)
    -> MatMul(x, ., transpose_b=True)
or per output channel (G = 1: no Reshape, [N, K] constants). Only u4 and u8 (NNCF's int8 LM head, per output
channel), and in lanes i8 without a zero point (SYMMETRIC_I8), with gs 32 or a multiple of 64 are taken; anything
else (i4 symmetric, a group of 16, transpose_b=False) keeps OpenVINO's kernels.

The u8 LM head: Qwen2.5-1.5B's (151936 x 1536, 19% of a decode step on OpenVINO's brgemm_avx512_bf16) ran at 0.68
of OpenVINO's time on our AVX512-VNNI path at M = 1 (0.71 at M = 2; CPU time 0.76 / 0.78; bench.kernels --shapes
151936x1536 --formats u8 --layers 2 --reps 7, load 5 on 2 vCPUs) and in the decode graph 53.3 vs 78.0 ms/step
(bench.profile, same load); at the default model's head shape (49152 x 576) 0.70 at M = 1, 1.11 at M = 4 (CPU
time 0.78 / 0.99), though its served head is i8 symmetric per 32 (the Q8_0 grid): taken as u8 = i8 + 128 about a
zero point of 128, in the single-token graph only, it ran at 0.68-0.78 of OpenVINO's time on AVX2 (bench.profile on
the Zen 3 EPYC, 3 interleaved pairs: 1.37-1.45 ms against 1.81-2.14, the step 0.84-0.96), but moved the next-token
TVD from OpenVINO's kernels 0.0136 -> 0.0165 (median; max 0.0297 -> 0.0363; from fp32 0.0122 -> 0.0161;
bench.quality default-int4 --prompts 16 --kernels auto openvino): a 135M model's head over 49152 tokens feels the
int8 activations. So it is taken only where x can be exact to a second int8 digit (SYMMETRIC_I8). What the u8 head
on ours moves: next-token TVD against
OpenVINO's kernels at Qwen2.5-1.5B (bench.quality --precision default --kernels auto openvino, 8 prompts) median
0.0137 / max 0.0169 with it, 0.0140 / 0.0162 with only the u4 layers on ours: within the noise of the u4 layers' own
(above the 0.01 target either way).

On AVX2 (no VNNI) the head is stored as s8 = u8 - 128 with zero points z - 128 (u8_layout: an xor folded into the
repack made anyway) and multiplied as maddubs(|w|, sign(x, w)) (kernel_avx2.cpp), its rows grouped by 4 as u4's
(ROW_GROUPS). Against OpenVINO's brgemm_avx2_f32 on the 2-vCPU Zen 3 EPYC (bench.kernels --shapes 151936x1536
--formats u8 --rows 1 2 4 --layers 2 --reps 9 --precision default, load 5.2): 0.62 / 0.69 / 0.96 of its time at
M = 1 / 2 / 4 (CPU time 0.69 / 0.74 / 1.06). Grouped rows against row-major, same op interleaved: 0.50 / 0.73 of
the time at M = 1 / 2, 1.35 at M = 4 (row-major shares each weight by 4 rows of x there).

On AVX512-VNNI the head is in lanes of 16 rows where its N is a multiple of 16 (lanes_layout, bits 8; Qwen2.5-1.5B's
151936 and Llama-3.2's 128256 are), each 64-byte chunk one vpdpbusd as read. Against the row-major 512-bit tile on the
Zen 4 EPYC (151936x1536, 2 layers, paired processes, 4 interleaved runs): 1 thread 1.48 / 1.38 / 1.02 / 1.25x its
rate at M = 1 / 2 / 4 / 8 (22.1 -> 32.0 GB/s at M = 1, a plain streaming read's rate there); 2 threads 1.04 / 1.22 /
1.06 / 1.15x (memory-bound at 1). The 1.5B decode step on 1 thread took the head 10.0-10.2 -> 7.3 ms (bench.profile).

Memory: the op reads the u4 bytes as a u8 copy ([N, K/2], on AVX2 rows interleaved by groups of 4: row_groups;
OpenVINO's Python API cannot share a read-only constant's memory, so a copy is made anyway, and the new Constant
shares it) and a u8 [N, 4 G] of f16 scales and zero points
(scale_table: 4 bytes per group, against the IR's 2.5-4; 40 MB at Qwen2.5-1.5B's rewritten u4 g128 layers, 80 MB as
the f32 scales and products it replaced).
Where a path's kernels lose at many rows (KERNEL_ROWS), the backends keep a second, unrewritten graph for prefill,
which holds the plugin's own copy: the default model's engine RSS went 243 -> 371 MB with every layer on ours (386
before the Constants shared our copy). Where the prefill tile takes every op (prefill_fits: AVX2, NNCF's u4 g128,
the Q4_1 grid) ours run alone: Qwen2.5-1.5B's engine RSS after load 2026 -> 1899 MB.
A u8 head is repacked (pair_layout, row_groups, or lanes_layout) into a copy of its size: +233 MB at Qwen2.5-1.5B.

Siblings (u4 MatMuls reading one activation: q/k/v, gate/up; appliance/runtime/siblings.py) share one op over their
rows, its output split (_plan): one call and one quantization of the activations instead of three or two, and k/v
(under the weight floor alone) on ours. 28 layers of the Qwen2.5-1.5B shapes, ours fused / unfused time
(interleaved, medians; the fused copy is made from the parts, then they are freed): AVX512-VNNI on Zen 5 q/k/v 0.60
and gate/up 0.95 at M = 1, 0.55 / 0.71 at M = 4; the AVX2 path 0.61 / 0.89 at M = 1, 0.92 / 0.90 at M = 256 (the
prefill tile and the split).
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import openvino as ov

from appliance.runtime.cores import map_on_cores
from appliance.runtime.kernels import hugepages
from appliance.runtime.siblings import siblings, split_last, width

OP = "LowBitMatMul"
# The paths that take u8 weights (NNCF's int8 LM head), each with the offset its layout subtracts from them and from
# their zero points at load (u8_layout). VNNI: vpdpbusd sums u8 x s8 in i32, u8 as read. AVX2's maddubs(u8 w, s8 x)
# would saturate its i16 pair sums (2 x 255 x 127): it takes s8 = u8 - 128 and multiplies maddubs(|w|, sign(x, w))
# (pairs at most 2 x 128 x 127, kernel_avx2.cpp).
U8_ISAS = {"avxvnni": 0, "avx512vnni": 0, "avx2": 128}
# Weight rows (u4 and u8) per group of the op's interleaved layout (row_groups), per path: the rows one pass of the
# AVX2 kernel reads at M = 1 (lowbit_kernel.hpp CHAINS), so that it streams one contiguous run instead of 4 rows'
# streams. On the 2-vCPU AVX2 EPYC (Zen 3) it took the op from 0.84 / 0.48 of OpenVINO's time to 0.52 / 0.56 at
# M = 1 (8960x1536 / 1536x8960; CPU time 0.85 / 0.61 -> 0.51 / 0.45; bench.kernels --layers 10, load 9-12:
# docs/performance.md), the u8 head to 0.50 of its row-major time at M = 1 (above). AVX-VNNI keeps row-major weights
# (rg 1): on a Zen 5 EPYC rows grouped by 4 gave no gain at M = 1 and took 1.0-1.4x the row-major time at M = 2-4
# (bench.kernels, docs/performance-log.md). AVX512-VNNI: LANE_ROWS.
ROW_GROUPS = {"avx2": 4}
# AVX512-VNNI's u4 and u8 in lanes (lowbit_kernel.hpp lanes_tile; lanes_layout): rows by groups of 16, 4 bytes of each
# row in turn, so that each i32 lane of a 512-bit dot is one row. Where it does not fit (N not a multiple of 16) u4
# with groups of a multiple of 128 and u8 stay row-major on the 512-bit tile (tile_zmm). Rows grouped by 8 in
# 64-byte slots (the layout before) ran at parity with lanes at M = 1 and 1.6-2.2x its time at M = 4-8 on a Zen 4
# EPYC (lanes_tile's measurements).
LANE_ROWS = 16


def layout(isa: str, bits: int, n: int, k: int, group_size: int) -> tuple[int, int]:
    """The op's row_group and slot_pairs for weights [n, k] of `bits` with `group_size` on `isa`'s path."""
    if isa == "avx512vnni" and k % group_size == 0 and n % LANE_ROWS == 0:
        return LANE_ROWS, 0
    return ROW_GROUPS.get(isa, 1), 1


def lanes_layout(
    packed: np.ndarray, scale: np.ndarray, zero: np.ndarray, bits: int = 4
) -> tuple[np.ndarray, np.ndarray]:
    """u4 weights [N, K/2] (OpenVINO's order), or u8 [N, K], and their scales and zero points [N, G] in the lanes
    layout (lowbit_kernel.hpp lanes_tile; N a multiple of LANE_ROWS, K of 32): per group of 16 rows and per 8 values
    of K (u4) or 4 (u8), each row's 4 bytes (u4: values 8c .. 8c + 3 in the low nibbles, 8c + 4 .. 8c + 7 in the
    high), one row after the other; the table per group of rows and of K, the 16 scales then the 16 zero points. Same
    sizes as before.

    Each row's 4 bytes are moved as one u32 (x86: little endian), the u4 nibbles regrouped inside it by shifts and
    masks (_u4_lanes_words): at 8960 x 1536 u4 that took 0.013 s against 0.042 with the bytes moved one by one after
    a one-value-per-byte copy (the transposed write of single bytes was most of it), on the 2-vCPU Xeon with AMX. The
    engine's load there (one process per load, alternated): Qwen2.5-1.5B 10.6-12.8 -> 7.6-8.8 s, Llama-3.2-3B
    17.3-18.0 -> 12.0-12.9 s, its peak RSS 5207-5215 -> 4684-4699 MB (no 2 GB of one-value-per-byte temporaries)."""
    n, nb = packed.shape
    words = np.ascontiguousarray(packed).view(np.uint32)  # [N, nb / 4]: a row's 4 bytes of a chunk each
    if bits == 4:
        words = _u4_lanes_words(words)
    out = np.empty((n, nb), np.uint8)
    out.view(np.uint32).reshape(n // LANE_ROWS, nb // 4, LANE_ROWS)[:] = words.reshape(
        n // LANE_ROWS, LANE_ROWS, nb // 4
    ).transpose(0, 2, 1)
    g = scale.shape[1]
    table = scale_table(scale, zero).view(np.float16).reshape(n // LANE_ROWS, LANE_ROWS, 2, g).transpose(0, 3, 2, 1)
    return out, np.ascontiguousarray(table).view(np.uint8).reshape(n, 4 * g)


# Where each nibble of a chunk's u32 goes (bit shift, mask of its place after it): OpenVINO's bytes hold values
# (0, 1), (2, 3), (4, 5), (6, 7) low nibble first; the lanes' bytes (0, 4), (1, 5), (2, 6), (3, 7). Values 0 and 7 stay.
_LANES_MOVES = ((-12, 0xF0), (4, 0xF00), (-8, 0xF000), (8, 0xF0000), (-4, 0xF00000), (12, 0xF000000))


def _u4_lanes_words(words: np.ndarray) -> np.ndarray:
    """u32 words of 8 u4 values each, OpenVINO's order -> the lanes' order (lanes_layout)."""
    out = words & np.uint32(0xF000000F)
    for shift, mask in _LANES_MOVES:
        moved = words << np.uint32(shift) if shift > 0 else words >> np.uint32(-shift)
        moved &= np.uint32(mask)
        out |= moved
    return out


# An i8 symmetric chain (no zero point: the Q8_0 grid of the default model's LM head, 49152 x 576 per 32) is taken as
# the LM head only (an int8 export's layers keep OpenVINO's kernels: not measured on ours), where it fits the lanes
# (AVX512-VNNI), as u8 = i8 + 128 about a zero point of 128, its x always exact to a second int8 digit at one row and
# to the residual's rows beyond (Chain.exact_x: the op's residual 1): with x's one digit the head moved the
# next-token TVD from OpenVINO's kernels 0.0136 -> 0.0165 (AVX2, module docstring); so taken, from fp32 0.0145 / max
# 0.0334 against 0.0144 / 0.0334 with OpenVINO's head (bench.quality default-int4 --prompts 16 --precision default
# --kernels auto openvino, AMX Xeon; OpenVINO's own default 0.0208). At the default model on the 2-vCPU Xeon with AMX
# (two engines in one process alternated, 128-token prompts, 64 new, medians of 12-16 rounds) the single-token step
# took 0.904-0.912 of its time, a step of 4 / 8 rows 0.982 / 0.834; and every graph of rows (backends/row_graphs.py)
# compiles without a copy of OpenVINO's head: engine RSS 594 -> 567 MB.
SYMMETRIC_I8 = 128

# The attention projections (q/k/v, o: HF's module names, which the exports keep; a fused q/k/v keeps q_proj's): with
# `residual` (kernels.RESIDUAL_ENV, off by default) their ops also run the activations' int8 rounding error (the
# op's `residual`: x minus its int8 value as M more rows of x, lowbit_matmul.cpp), so their error is what that
# second rounding leaves. Why these: at Qwen2.5-1.5B (bench.quality --prompts 8 --precision default --kernels auto
# openvino, AVX2 on Zen 1) our kernels moved the next-token distribution from OpenVINO's by TVD 0.0137 (median;
# activations per octet), 0.0086 with q/k/v left on OpenVINO's kernels, 0.0078 with o_proj too, 0.0126-0.0127 with
# down_proj or gate/up instead. They hold ~12% of a layer's weights there, yet twice their rows cost 7% of batch-1
# decode and 12% of time to first token on that core: hence an option. Where the 512-bit lanes tile takes one row of
# u4 (decode), every u4 op's x goes in with a second int8 digit instead (the op's `residual` 1 there, 2 for the rest:
# lowbit_kernel.hpp lanes_tile's TWO), which at Qwen2.5-1.5B on the AMX Xeon took that TVD 0.0113 -> 0.0081 for 7%
# of the decode step (the attention projections' alone: 0.0106; no op's rows doubled).
ATTENTION_PROJ = re.compile(r"(?:^|[./])(?:q|k|v|o|qkv)_proj\b")
# Group sizes the prefill tile takes (lowbit_kernel.hpp prefill_fits: grouped u4 rows, an even number of 32-blocks).
PREFILL_GROUPS = (32, 64, 128, 256)


@dataclass(frozen=True)
class Chain:
    """A matched u4 decompression chain, as arrays for the op."""

    packed: np.ndarray  # u8 [N, K/2] (u4: row_groups) or [N, K] (u8, in the op's paired layout: pair_layout)
    sz: np.ndarray  # u8 [N, 4 G]: scale_table
    group_size: int
    bits: int = 4
    row_group: int = 1  # the packed rows' interleaving (row_groups)
    slot_pairs: int = 1  # 1; 0: in lanes of 16 rows, the table likewise (lanes_layout)
    exact_x: bool = False  # x's int8 rounding error always runs too (the op's residual 1: SYMMETRIC_I8)


def pair_layout(q: np.ndarray) -> np.ndarray:
    """u8 weights [N, K] (K a multiple of 32) in the order the op quantizes activations (lowbit_kernel.hpp): per pair
    of 32-blocks [first's even 16, second's even 16, first's odd 16, second's odd 16], a last unpaired block [even
    16, odd 16]. Then the kernel's u8 path reads its even and odd halves with two plain loads."""
    n, k = q.shape
    pairs = q[:, : k // 64 * 64].reshape(n, k // 64, 2, 32)
    out = [np.stack([pairs[:, :, 0, 0::2], pairs[:, :, 1, 0::2], pairs[:, :, 0, 1::2], pairs[:, :, 1, 1::2]], 2)]
    if k % 64:
        last = q[:, -32:]
        out.append(np.concatenate([last[:, 0::2], last[:, 1::2]], 1))
    return np.ascontiguousarray(np.concatenate([o.reshape(n, -1) for o in out], 1))


def u8_layout(q: np.ndarray, zero: np.ndarray, isa: str) -> tuple[np.ndarray, np.ndarray]:
    """u8 weights [N, K] and their zero points [N, G] as `isa`'s op reads them: the weights in pair_layout, both
    minus U8_ISAS[isa] (128 on AVX2: s8 bytes, u8 ^ 0x80; the zero points stay exact integers in f16)."""
    offset = U8_ISAS[isa]
    packed = pair_layout(q)
    if offset:
        packed ^= np.uint8(offset)
    return packed, (zero.astype(np.float32) - offset).astype(np.float16)


def row_groups(packed: np.ndarray, rows: int, pair_bytes: int = 32) -> np.ndarray:
    """Weights [N, bytes] (each row's pairs of 32-blocks `pair_bytes`: 32 of u4, 64 of u8) in the op's interleaved
    layout (lowbit_kernel.h): N rounded up to `rows` with zero rows, then per group of `rows` rows their first pairs
    one after the other, their second pairs, ..., and their unpaired last blocks (half a pair each). A pass over
    `rows` weight rows then reads one contiguous run instead of `rows` interleaved streams. Same size (plus padding
    rows)."""
    n, nb = packed.shape
    padded = -(-n // rows) * rows
    full, groups = nb // pair_bytes, padded // rows
    p = packed if padded == n else np.concatenate([packed, np.zeros((padded - n, nb), np.uint8)])
    out = np.empty((padded, nb), np.uint8)
    grouped = out.reshape(groups, rows * nb)  # a view: `out` is contiguous
    head = p[:, : full * pair_bytes].reshape(groups, rows, full, pair_bytes).transpose(0, 2, 1, 3)
    grouped[:, : rows * full * pair_bytes] = head.reshape(groups, -1)
    grouped[:, rows * full * pair_bytes :] = p[:, full * pair_bytes :].reshape(groups, -1)
    return out


def scale_table(scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """The op's per-group table from f16 scales and zero points [N, G]: per row the G scales, then the G zero points,
    f16 as the IR has them, as u8 bytes [N, 4 G]. A pass reads the table beside the weights: at u4 g128 its 4 bytes a
    group are 6% of the bytes (12% as f32 scales and products, the layout before), at Q4_1's g32 25% (50%); the
    kernel converts eight groups at a time (lowbit_kernel.hpp row_bias)."""
    return np.ascontiguousarray(np.concatenate([scale, zero], 1).astype(np.float16)).view(np.uint8)


def nibbles(packed: np.ndarray) -> np.ndarray:
    """u4 bytes [..., B] (two values per byte, low nibble first: OpenVINO's order) as one value per byte [..., 2 B]."""
    values = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.uint8)
    values[..., 0::2], values[..., 1::2] = packed & 15, packed >> 4
    return values


def _u4_values(node: ov.Node) -> np.ndarray:
    """A u4 Constant's values, one per byte, in its shape."""
    values = nibbles(np.asarray(node.get_data()).view(np.uint8).ravel())
    return values[: int(np.prod(node.shape))].reshape(tuple(node.shape))


def constant_value(output: ov.Output) -> np.ndarray | None:
    """The value of a Constant, or of Convert(Constant) (a u4/u8 zero point), as float32; else None."""
    node = output.get_node()
    if node.get_type_name() == "Convert":
        node = node.input_value(0).get_node()
    if node.get_type_name() != "Constant":
        return None
    if node.get_element_type() == ov.Type.u4:
        return _u4_values(node).astype(np.float32)
    return np.asarray(node.get_data(), np.float32)


def is_kind(output: ov.Output, kind: str) -> bool:
    """Whether `output` comes out of a node of type `kind`."""
    return output.get_node().get_type_name() == kind


def _weights(matmul: ov.Node) -> int:
    """The values of `matmul`'s weight input ([N, K]), or 0 when its shape is not static (match refuses those)."""
    shape = matmul.input_value(1).get_partial_shape()
    return int(np.prod(shape.to_shape())) if shape.is_static else 0


def match(matmul: ov.Node, isa: str = "avx2", head: bool = False) -> Chain | None:
    """The u4 chain (or on a path of U8_ISAS, also a u8 one, in its u8_layout; where `head`, the LM head, also an
    i8 symmetric one in lanes: SYMMETRIC_I8) feeding `matmul`'s weight input, or None when it is anything else; rows
    grouped as `isa`'s path reads them (layout, row_groups)."""
    attrs = matmul.get_attributes()
    if attrs.get("transpose_a") or not attrs.get("transpose_b"):
        return None
    w = matmul.input_value(1)
    if is_kind(w, "Convert"):
        w = w.get_node().input_value(0)
    n_k = tuple(w.get_partial_shape().to_shape()) if w.get_partial_shape().is_static else ()
    if len(n_k) != 2:
        return None
    if is_kind(w, "Reshape"):
        w = w.get_node().input_value(0)
    if not is_kind(w, "Multiply"):
        return None
    sub, scale_out = w.get_node().input_value(0), w.get_node().input_value(1)
    scale = constant_value(scale_out)
    if scale is None:
        return None
    n, k = n_k
    zero: np.ndarray | None
    if is_kind(sub, "Convert"):  # no zero point: i8 symmetric (the Q8_0 grid), the head's in lanes (SYMMETRIC_I8)
        values = sub.get_node().input_value(0).get_node()
        if not head or values.get_type_name() != "Constant" or values.get_element_type() != ov.Type.i8:
            return None
        exact, bits, zero = True, 8, np.full(1, SYMMETRIC_I8, np.float32)
    elif is_kind(sub, "Subtract") and is_kind(sub.get_node().input_value(0), "Convert"):
        values = sub.get_node().input_value(0).get_node().input_value(0).get_node()
        kinds = (ov.Type.u4, ov.Type.u8) if isa in U8_ISAS else (ov.Type.u4,)
        if values.get_type_name() != "Constant" or values.get_element_type() not in kinds:
            return None
        exact, bits = False, 4 if values.get_element_type() == ov.Type.u4 else 8
        zero = constant_value(sub.get_node().input_value(1))
    else:
        return None
    shape = tuple(values.shape)
    if zero is None or shape[0] != n or int(np.prod(shape)) != n * k or k % 32:
        return None
    groups = shape[1] if len(shape) == 3 else 1
    group_size = k // groups
    if group_size != 32 and group_size % 64:  # the op's pairs of 32-blocks share a scale or have one each
        return None
    try:
        s = np.broadcast_to(scale, (n, groups, 1) if len(shape) == 3 else (n, 1)).reshape(n, groups)
        z = np.broadcast_to(zero, (n, groups, 1) if len(shape) == 3 else (n, 1)).reshape(n, groups)
    except ValueError:
        return None
    data = np.asarray(values.get_data()).view(np.uint8)
    row_group, slot = layout(isa, bits, n, k, group_size)
    if exact:
        if slot != 0:
            return None
        data = data ^ np.uint8(SYMMETRIC_I8)  # i8 + 128 as u8, about a zero point of 128
    if slot == 0:  # lanes: u8 as read (U8_ISAS: AVX512-VNNI's offset is 0)
        table = lanes_layout(data.reshape(n, k * bits // 8), s, z, bits)
        return Chain(*table, group_size, bits, row_group, slot, exact_x=exact)
    if bits == 8:
        packed, z8 = u8_layout(data.reshape(n, k), z, isa)
        if row_group > 1:  # pair_layout made the copy already
            packed = row_groups(packed, row_group, pair_bytes=64)
        return Chain(packed, scale_table(s, z8), group_size, bits, row_group, slot)
    packed = row_groups(data.reshape(n, k // 2), row_group)
    return Chain(packed, scale_table(s, z), group_size, bits, row_group, slot)


def _fused(chains: list[Chain]) -> Chain:
    """One op's chain for sibling u4 chains of one group size, K and layout, none with padding rows: their rows
    one after the other (each part's groups of rows stay whole)."""
    packed = np.concatenate([c.packed for c in chains])
    sz = np.concatenate([c.sz for c in chains])
    first = chains[0]
    return Chain(packed, sz, first.group_size, first.bits, first.row_group, first.slot_pairs)


def _plan(model: ov.Model, isa: str, min_weights: int) -> list[tuple[list[ov.Node], Chain]]:
    """Which MatMuls become which op: sibling u4 MatMuls that agree on the group size, K and layout share one
    (their outputs split after it); the rest one op each. A group's floor is its siblings' weights together, so
    q/k/v take ours together where k/v alone are under it. The groups are matched on a thread per core
    (cores.map_on_cores): on the 2-vCPU Xeon with AMX the engine's load went 12.4-12.6 -> 8.4-10.7 s at
    Qwen2.5-1.5B and 23.9 -> 20.2 s at Llama-3.2-3B, whose RSS after load (heap trimmed) went 5132 -> 4101 MB
    (2425 -> 2172 at 1.5B): the threads' glibc arenas give their temporaries back where the main heap kept them."""
    head = logits_op(model)
    at_head = head.get_instance_id() if head is not None else None
    groups = [
        group
        for group in siblings(model, lambda node: () if node.get_output_element_type(0) == ov.Type.f32 else None)
        if sum(_weights(n) for n in group) >= min_weights  # before match: it copies and repacks the weights
    ]

    def planned(group: list[ov.Node]) -> list[tuple[list[ov.Node], Chain]]:
        shares: dict[tuple[int, int, int], list[tuple[ov.Node, Chain]]] = {}
        alone, out = [], []
        for node in group:
            chain = match(node, isa, head=node.get_instance_id() == at_head)
            if chain is None:
                continue
            if chain.bits == 4 and chain.packed.shape[0] == width(node):  # no padding rows
                shares.setdefault((chain.group_size, chain.sz.shape[1], chain.slot_pairs), []).append((node, chain))
            else:
                alone.append((node, chain))
        for members in shares.values():
            if len(members) > 1:
                out.append(([n for n, _ in members], _fused([c for _, c in members])))
            else:
                alone += members
        return out + [([n], c) for n, c in alone if _weights(n) >= min_weights]

    plan = [op for ops in map_on_cores(planned, groups) for op in ops]
    # The LM head alone takes no graph: the layers would keep OpenVINO's kernels, and the default model (every layer
    # under the floor) then takes ours on all of them in its graphs of rows instead (kernels.apply's one_token).
    if [n.get_instance_id() for nodes, _ in plan for n in nodes] == [at_head]:
        return []
    return plan


def rewrite(
    model: ov.Model, factory: Any, isa: str = "auto", min_weights: int = 0, residual: bool = False, ahead: bool = True
) -> int:
    """Replaces every matching MatMul of `model` in place with a LowBitMatMul made by `factory` (an OpenVINO
    NodeFactory holding our extension) whose weight holds at least `min_weights` values; returns how many MatMuls.
    `residual`: the attention projections' ops also run x's int8 rounding error, and every u4 op in lanes a second
    digit of x at one row (ATTENTION_PROJ, residual_of).
    Siblings that read one activation share one op and a VariadicSplit of its output (_plan); a SwiGLU's gate and up
    share one gated op (swiglu), which also runs the down projection of its product (mlp). The op computes in f32
    and returns f32, as the MatMul did. u8 weights (NNCF's int8 LM head) are taken on the paths of U8_ISAS.
    `ahead`: each op also takes the next one's weights to read ahead (link_ahead). The ops' weights and scale tables
    are copied into huge pages (hugepages.Arena), each chain's arrays freed as it is placed."""
    from openvino import opset13 as ops

    # Every op is made before any is swapped in: a failure leaves the model as it was read.
    swaps, count, plan = [], 0, _with_downs(_plan(model, isa, min_weights), residual)
    arena = hugepages.Arena(sum(hugepages.footprint(a) for op in plan for c in op.chains() for a in (c.packed, c.sz)))
    while plan:
        op = plan.popleft()
        nodes, chain, down = op.nodes, op.chain, op.down
        count += len(nodes) + (down is not None)
        inputs = [nodes[0].input_value(0)]
        for c in op.chains():
            inputs += [  # shared, not copied again
                ops.constant(arena.place(c.packed), shared_memory=True).output(0),
                ops.constant(arena.place(c.sz), shared_memory=True).output(0),
            ]
        new = factory.create(
            OP,
            inputs,
            {
                "group_size": chain.group_size,
                "isa": isa,
                "bits": chain.bits,
                "row_group": chain.row_group,
                "slot_pairs": chain.slot_pairs,
                "residual": residual_of(nodes, chain, residual),
                "gated": op.gated,
                "down": int(down is not None),
            },
        )
        new.set_friendly_name(nodes[0].get_friendly_name())  # q_proj's, gate_proj's: bench.profile's roles
        if down is not None:  # the op's output is the MLP's: down(silu(gate) * up)
            swaps.append((down, new.output(0)))
        elif op.product is not None:  # the op's output is the SwiGLU's: silu(gate) * up
            swaps.append((op.product, new.output(0)))
        else:
            outputs = split_last(new.output(0), [width(n) for n in nodes]) if len(nodes) > 1 else [new.output(0)]
            swaps += list(zip(nodes, outputs))
    for node, output in swaps:
        for target in list(node.output(0).get_target_inputs()):
            target.replace_source_output(output)
    if swaps and ahead:
        link_ahead(model)
    if swaps:
        model.validate_nodes_and_infer_types()
    return count


Planned = tuple[list[ov.Node], Chain]


class _Op(NamedTuple):
    """One op to make: the MatMuls it replaces and their chain, its `gated` and the SwiGLU's product (swiglu), and
    the down projection it also runs (mlp) with that one's chain."""

    nodes: list[ov.Node]
    chain: Chain
    gated: int
    product: ov.Node | None
    down: ov.Node | None = None
    down_chain: Chain | None = None

    def chains(self) -> list[Chain]:
        return [self.chain] if self.down_chain is None else [self.chain, self.down_chain]


def _with_downs(plan: list[Planned], residual: bool) -> deque[_Op]:
    """The plan's ops, a gated op holding the down projection that mlp() finds for it, which then makes no op of its
    own."""
    gates = [swiglu(nodes, chain.row_group) for nodes, chain in plan]
    alone = {nodes[0].get_instance_id(): i for i, (nodes, _) in enumerate(plan) if len(nodes) == 1}
    downs = {}
    for i, (_, product) in enumerate(gates):
        down = mlp(product) if product is not None else None
        j = alone.get(down.get_instance_id()) if down is not None else None
        if j is not None and _fits_down(plan[i], plan[j], residual):
            downs[i] = j
    taken = set(downs.values())
    out: deque[_Op] = deque()
    for i, (nodes, chain) in enumerate(plan):
        if i in taken:
            continue
        down = (plan[downs[i]][0][0], plan[downs[i]][1]) if i in downs else (None, None)
        out.append(_Op(nodes, chain, *gates[i], *down))
    return out


def mlp(product: ov.Node) -> ov.Node | None:
    """The MatMul that alone reads a SwiGLU's product (swiglu), as its x: the MLP's down projection; else None. Why
    in the gated op: on the 2-vCPU Xeon with AMX, the time from the gated op's end to the down op's start was 28-32 us
    a layer at Qwen2.5-1.5B with no node between them (timers inside the ops), the plugin's way from one node to the
    next running from caches the weight stream had just emptied; within one op the down projection starts at once.
    Two engines in one process (the MLP in one op / apart) alternated per request, medians of 10-24 rounds' step
    ratios, both load orders: the single-token step took 0.980-0.988 of its time at Qwen2.5-1.5B (39.2-40.5 ms),
    0.988 / 0.996 at Llama-3.2-3B, 0.94-1.04 (median 0.98; the engine loaded first ran up to 3% faster) at the
    default 135M model."""
    targets = list(product.output(0).get_target_inputs())
    if len(targets) != 1 or targets[0].get_index() != 0:
        return None
    node = targets[0].get_node()
    return node if node.get_type_name() == "MatMul" else None


def _fits_down(gate: Planned, down: Planned, residual: bool) -> bool:
    """Whether the down projection's chain runs in the gated op: u4 in the same group size and layout, x's digits
    alike."""
    (nodes, chain), (down_nodes, down_chain) = gate, down
    same = ("bits", "group_size", "row_group", "slot_pairs", "exact_x")
    return (
        down_chain.bits == 4
        and all(getattr(chain, f) == getattr(down_chain, f) for f in same)
        and residual_of(nodes, chain, residual) == residual_of(down_nodes, down_chain, residual)
    )


def residual_of(nodes: list[ov.Node], chain: Chain, asked: bool) -> int:
    """The op's `residual`: 1 for a chain that wants x exact (Chain.exact_x) and, where asked (ATTENTION_PROJ), for
    the attention projections (x's int8 rounding error as a second digit at one row in lanes, as M more rows of x
    elsewhere); where asked, 2 for any other u4 op in lanes (the digit only: twice the rows of a gated op or of a
    prefill would cost far more); else 0."""
    if chain.exact_x:
        return 1
    if not asked:
        return 0
    if any(ATTENTION_PROJ.search(n.get_friendly_name()) for n in nodes):
        return 1
    return 2 if chain.slot_pairs == 0 and chain.bits == 4 else 0


def swiglu(nodes: list[ov.Node], row_group: int) -> tuple[int, ov.Node | None]:
    """The op's `gated` for sibling MatMuls that share one op, and the Multiply it then replaces: two MatMuls of one
    width (whole row groups) whose outputs feed only silu(one) * other (Swish and Multiply, as Llama's and Qwen's
    MLPs export; a Swish beta other than 1 is not silu), gated 1 where the first is the gate, 2 where the second is;
    else (0, None). Why one op: at Qwen2.5-1.5B on 2 threads (Zen 4) the plugin's Swish-Multiply node after our
    gate/up op took 43-46 us a layer against 7 on 1 thread (one compiled graph, bench.profile's per-node times; 3.4 us
    in a model of that node alone after our op), 1.2 ms of a 21 ms decode step; each task of the op now gates the
    rows it computed, and the step took 20.4-20.6 ms against 21.3-21.8 (docs/performance-log.md)."""
    if len(nodes) != 2 or width(nodes[0]) != width(nodes[1]) or width(nodes[0]) % row_group:
        return 0, None
    targets = [list(n.output(0).get_target_inputs()) for n in nodes]
    if any(len(t) != 1 for t in targets):
        return 0, None
    consumers = [t[0].get_node() for t in targets]
    for gate in (0, 1):
        swish, product = consumers[gate], consumers[1 - gate]
        if swish.get_type_name() != "Swish" or product.get_type_name() != "Multiply":
            continue
        if swish.get_input_size() > 1:  # x sigmoid(beta x): silu only where beta is 1
            beta = constant_value(swish.input_value(1))
            if beta is None or beta.size != 1 or float(beta.ravel()[0]) != 1.0:
                continue
        after = list(swish.output(0).get_target_inputs())
        if len(after) == 1 and after[0].get_node().get_instance_id() == product.get_instance_id():
            return gate + 1, product
    return 0, None


def link_ahead(model: ov.Model) -> None:
    """Gives each LowBitMatMul the next one's weights (in the model's execution order) as its last input, which it
    reads ahead while the nodes between them run (lowbit_matmul.cpp read_ahead). The constant is shared, not
    copied: the plugin binds both inputs to one memory."""
    ours = [node for node in model.get_ordered_ops() if node.get_type_name() == OP]
    for op, after in zip(ours, ours[1:]):
        op.set_arguments([*(op.input_value(i) for i in range(weight_inputs(op))), after.input_value(1)])


def weight_inputs(op: ov.Node) -> int:
    """Our op's inputs before the next op's weights: x, w, sz, and with `down` the down projection's w and sz."""
    return 5 if op.get_attributes().get("down") else 3


def logits_op(model: ov.Model) -> ov.Node | None:
    """The LM head: the MatMul (or, rewritten, our op) that produces the logits, walking up from the `logits` result
    through each node's first input (element-wise ops, a Convert); None when there is no such output or op."""
    try:
        node = model.output("logits").get_node().input_value(0).get_node()
    except RuntimeError:
        return None
    while node.get_type_name() not in (OP, "MatMul"):
        if node.get_input_size() == 0:
            return None
        node = node.input_value(0).get_node()
    return node


def _from_constants(output: ov.Output) -> bool:
    """Whether `output` is computed from constants alone (a weight, however decompressed), no Parameter above it."""
    stack, seen = [output.get_node()], set()
    while stack:
        node = stack.pop()
        if node.get_type_name() == "Parameter":
            return False
        if node.get_instance_id() not in seen:
            seen.add(node.get_instance_id())
            stack += [node.input_value(i).get_node() for i in range(node.get_input_size())]
    return True


def native_matmuls(model: ov.Model, floor: int = 1 << 16) -> list[ov.Node]:
    """The MatMuls of `model` left on OpenVINO's kernels whose weight (an input computed from constants alone) holds
    `floor` values or more, the LM head excepted (kernels.row_graph_properties)."""
    head = logits_op(model)
    found = []
    for node in model.get_ordered_ops():
        if node.get_type_name() != "MatMul" or (head is not None and node.get_instance_id() == head.get_instance_id()):
            continue
        if _weights(node) >= floor and _from_constants(node.input_value(1)):
            found.append(node)
    return found


def prefill_fits(model: ov.Model) -> bool:
    """Whether every LowBitMatMul in `model` runs the prefill tile at many rows, so that ours win at every row count
    (kernels.EVERY_ROW): u4 in lanes (AVX512-VNNI), or in grouped rows with a group size of PREFILL_GROUPS and K a
    multiple of 64 (AVX2's prefill tile). A u8 op fits only as the LM head, which the backends feed one row per
    sequence (their gather of the last tokens); elsewhere it would run the general tile at many rows, slower than
    OpenVINO's there."""
    head = logits_op(model)
    ops = [n for n in model.get_ordered_ops() if n.get_type_name() == OP]
    for op in ops:
        attrs = op.get_attributes()
        k = op.input_value(0).get_partial_shape()[-1]
        ks = [k.get_length()] if k.is_static else []
        if attrs.get("down"):  # the down projection's K: the SwiGLU's width, half the gated rows
            ks.append(op.input_value(2).get_shape()[0] // 2)
        if attrs["bits"] == 8:
            fits = head is not None and op.get_friendly_name() == head.get_friendly_name()
        else:
            grouped = attrs["row_group"] % 2 == 0 and attrs["group_size"] in PREFILL_GROUPS
            fits = attrs["slot_pairs"] == 0 or (grouped and k.is_static and all(n % 64 == 0 for n in ks))
        if not fits:
            return False
    return bool(ops)
