"""The rotary position embedding (RoPE) in front of the attention of the graphs of rows (backends/row_graphs.py),
found so that DecodeAttention applies it itself (its `rope` attribute: decode_attention.cpp) and the graph's own
rotation nodes go.

Why: at batch 1 the default 135M model's step is bound by per-node overhead, not by its weights, and the CPU
plugin ran the rotation as two RoPE nodes per layer (4.5 us each by PERF_COUNT: ~0.15-0.27 ms of a 7-9 ms step).
The op rotates 9 + 3 heads of 64 values (Qwen2.5-1.5B: 12 + 2 of 128) in under a microsecond. Measured on the 2-vCPU
Zen 3 EPYC (AVX2) as one backend holding the single-token graph compiled twice from one rewritten model (the same
weights' memory), the rotation in our op / in the graph, alternating blocks of 16 steps, medians of 100-200 rounds:
the default model 0.968 / 0.992 / 0.979 / 0.974 at a 128-token context and 0.988 at 512; Qwen2.5-1.5B 0.995 at 512.
With PERF_COUNT the nodes' time moved as expected: the 60 RoPE nodes' 148-182 us a step went, our attention took
23-28 us more. Quality: next-token TVD from transformers' fp32 (bench.quality default-int4 --prompts 16) median 0.0140
/ max 0.0267 with it, 0.0122 / 0.0314 without. The two differ only by float rounding (the plugin's RoPE node is
within ~1 ulp of exact f32 math, as is ours), which the int8 activations of the layers after carry further.

The graphs of more rows lay each token out as a batch row of its own ([T, 1, heads, head] turned to [T, heads, 1,
head], cos and sin [T, 1, 1, head]: the tokens first throughout), so the same pattern holds with a row of cos and sin
per token, which the op takes as [T, head]. There the plugin ran the rotation as RoPE nodes of its reference path
(0.31-0.34 ms a step of 2-4 rows at the default model, by PERF_COUNT); taken by our op, a step of 2 / 3 / 4 rows went
from 1.26-1.27 / 1.40-1.43 / 1.51-1.56 to 1.21-1.22 / 1.36-1.42 / 1.47-1.52 times the one-row step of its own
process (the default model, 200 steps each, three processes of each alternated; 2-vCPU Xeon with AMX).

The pattern is HF's apply_rotary_pos_emb as optimum-intel exports it (export/ writes the GGUF models alike):
    out = x * cos + concat(-x[..., h:], x[..., :h]) * sin,    h = head_size / 2
with x q or k as heads of head_size values, cos and sin one row of head_size values for the token, broadcast over
the heads; Transposes and a Reshape then bring out to the attention's [T, heads * head_size]. It is taken only where
each step checks out in a graph of T rows (static shapes): the rotated tensor and x hold exactly T x heads x
head_size f32 values, head_size last and, for T > 1, the tokens on the first axis; cos and sin hold T x head_size
(for T > 1 of x's rank, the tokens first); the layout nodes between the rotation and the attention keep the values
in order (a Transpose keeps the order of its axes longer than 1); the negation is a Negative or a Multiply by the
constant -1; q and k are rotated by the same cos and sin. Anything else keeps the graph's rotation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openvino as ov
from openvino import opset13 as ops

from appliance.runtime.kernels.rewrite import constant_value, is_kind

# 0: the graph's own rotation stays in front of our attention (the op's `rope` 0), for side-by-side measurements.
ENV = "APPLIANCE_KERNELS_ROPE"
LAYOUT = ("Reshape", "Transpose", "Squeeze", "Unsqueeze")


@dataclass(frozen=True)
class Rotation:
    """out = x * cos + rotate_half(x) * sin."""

    x: ov.Output
    cos: ov.Output
    sin: ov.Output


def _shape(output: ov.Output) -> list[int] | None:
    shape = output.get_partial_shape()
    return [d.get_length() for d in shape] if shape.is_static else None


def _keeps_order(node: ov.Node) -> bool:
    """Whether a layout node leaves its values in memory order: a reshape does; a Transpose where the axes longer
    than 1 keep their relative order."""
    if node.get_type_name() != "Transpose":
        return True
    perm, shape = constant_value(node.input_value(1)), _shape(node.input_value(0))
    if perm is None or shape is None:
        return False
    moved = [int(p) for p in perm.ravel() if shape[int(p)] != 1]
    return moved == sorted(moved)


def source(output: ov.Output, limit: int = 8) -> ov.Output | None:
    """The output behind a chain of layout nodes that keep the values' order; None where one does not."""
    for _ in range(limit):
        node = output.get_node()
        if node.get_type_name() not in LAYOUT:
            return output
        if not _keeps_order(node):
            return None
        output = node.input_value(0)
    return None


def _scalar(output: ov.Output) -> float | None:
    value = constant_value(output)
    return float(value.ravel()[0]) if value is not None and value.size == 1 else None


def _last_axis_slice(output: ov.Output) -> tuple[ov.Output, int, int] | None:
    """(data, start, stop) of a Slice of the last axis with step 1; else None."""
    node = output.get_node()
    if not is_kind(output, "Slice") or node.get_input_size() != 5:
        return None
    data = node.input_value(0)
    shape = _shape(data)
    values = [_scalar(node.input_value(i)) for i in (1, 2, 3, 4)]
    if shape is None or any(v is None for v in values):
        return None
    start, stop, step, axis = (float(v) for v in values if v is not None)
    n = shape[-1]
    if step != 1 or int(axis) % len(shape) != len(shape) - 1:
        return None
    bounds = [int(max(-(2**62), min(2**62, v))) for v in (start, stop)]  # INT64_MAX reads as 2^63 in float32
    b, e = (min(n, max(0, v + n if v < 0 else v)) for v in bounds)
    return data, b, e


def _negated(output: ov.Output) -> ov.Output | None:
    """v where output = -v (a Negative, or a Multiply by the constant -1); else None."""
    node = output.get_node()
    if is_kind(output, "Negative"):
        return node.input_value(0)
    if is_kind(output, "Multiply"):
        for i in (0, 1):
            if _scalar(node.input_value(1 - i)) == -1.0:
                return node.input_value(i)
    return None


def _rotated_half(output: ov.Output, head: int) -> ov.Output | None:
    """x where output = concat(-x[..., h:], x[..., :h]) over the last axis (h = head / 2); else None."""
    node = output.get_node()
    shape = _shape(output)
    if not is_kind(output, "Concat") or node.get_input_size() != 2 or shape is None:
        return None
    if int(node.get_attributes()["axis"]) % len(shape) != len(shape) - 1:
        return None
    negated = _negated(node.input_value(0))
    upper = _last_axis_slice(negated) if negated is not None else None
    lower = _last_axis_slice(node.input_value(1))
    half = head // 2
    if upper is None or lower is None or upper[1:] != (half, head) or lower[1:] != (0, half):
        return None
    return lower[0] if upper[0] == lower[0] else None


def _by_token(shape: list[int] | None, tokens: int, values: int) -> bool:
    """`values` per token, the tokens first: one token holds them whatever its axes; more lead on axis 0."""
    return shape is not None and int(np.prod(shape)) == tokens * values and (tokens == 1 or shape[0] == tokens)


def _row(output: ov.Output, head: int, tokens: int, rank: int) -> bool:
    """A row of head values per token (every axis between 1): the same for every head it broadcasts over; with
    more than one token, of the rotated tensor's rank, so that its token axis meets theirs."""
    shape = _shape(output)
    return (
        shape is not None
        and shape[-1] == head
        and _by_token(shape, tokens, head)
        and (tokens == 1 or len(shape) == rank)
    )


def find(value: ov.Output, heads: int, head: int, tokens: int = 1) -> Rotation | None:
    """The rotation whose output reaches `value` (an attention input of `tokens` rows of heads x head values)
    through layout nodes that keep the values' order; None where the graph computes anything else."""
    rotated = source(value)
    if head % 2 or rotated is None or not is_kind(rotated, "Add"):  # the op rotates even heads
        return None
    shape = _shape(rotated)
    if shape is None or shape[-1] != head or not _by_token(shape, tokens, heads * head):
        return None
    add = rotated.get_node()
    terms = add.input_value(0), add.input_value(1)
    if not all(is_kind(term, "Multiply") for term in terms):
        return None
    first, second = (term.get_node() for term in terms)
    for plain, turned in ((first, second), (second, first)):
        for i in (0, 1):
            x = _rotated_half(turned.input_value(i), head)
            if x is None or _shape(x) != shape:
                continue
            sin = turned.input_value(1 - i)
            for j in (0, 1):
                cos = plain.input_value(1 - j)
                if plain.input_value(j) == x and all(_row(r, head, tokens, len(shape)) for r in (cos, sin)):
                    outputs = (x, cos, sin)
                    if all(o.get_element_type() == ov.Type.f32 for o in outputs):
                        return Rotation(*outputs)
    return None


def _flat(output: ov.Output, tokens: int, width: int) -> ov.Output:
    return ops.reshape(output, ops.constant(np.array([tokens, width], np.int64)), False).output(0)


def inputs(q: ov.Output, k: ov.Output, heads: int, kv_heads: int, head: int, tokens: int = 1) -> list[ov.Output] | None:
    """DecodeAttention's q and k before their rotation and its cos and sin ([tokens, width] each), where q and k
    are rotated by the same cos and sin; else None."""
    rq, rk = find(q, heads, head, tokens), find(k, kv_heads, head, tokens)
    if rq is None or rk is None:
        return None
    for a, b in ((rq.cos, rk.cos), (rq.sin, rk.sin)):
        ours, theirs = source(a), source(b)
        if ours is None or ours != theirs:
            return None
    widths = (heads * head, kv_heads * head, head, head)
    return [_flat(o, tokens, w) for o, w in zip((rq.x, rk.x, rq.cos, rq.sin), widths)]
