"""Finding the rotary embedding in front of the attention of the graphs of rows (kernels/rope.py): HF's
apply_rotary_pos_emb as exported is taken, with q and k before it and the cos / sin rows, one token or a row per
token; anything that computes something else is left to the graph. Graphs built here; the op's own rotation:
test_decode_attention.py."""

from __future__ import annotations

import numpy as np
import openvino as ov
import pytest
from openvino import opset13 as ops

from appliance.runtime.kernels import rope

HEADS, KV_HEADS, HEAD = 4, 2, 8


def _slice(x: ov.Output, start: int, stop: int) -> ov.Output:
    const = [ops.constant(np.array([v], np.int64)) for v in (start, stop, 1, -1)]
    return ops.slice(x, *const).output(0)


def _rotated(
    x: ov.Output, cos: ov.Output, sin: ov.Output, swap: bool = False, negate_lower: bool = False, axis: int = -1
) -> ov.Output:
    """x * cos + concat(-x[..., h:], x[..., :h]) * sin as exported; the flags make variants that compute otherwise."""
    half = HEAD // 2
    upper, lower = _slice(x, half, 2**63 - 1), _slice(x, 0, half)
    minus = ops.constant(np.float32(-1))
    if negate_lower:
        parts = [upper, ops.multiply(lower, minus).output(0)]
    else:
        parts = [ops.multiply(upper, minus).output(0), lower]
    turned = ops.concat(parts[::-1] if swap else parts, axis)
    return ops.add(ops.multiply(x, cos), ops.multiply(turned, sin)).output(0)


def _attention_input(rotated: ov.Output, heads: int, perm=(0, 2, 1, 3)) -> ov.Output:
    moved = ops.transpose(rotated, ops.constant(np.array(perm, np.int64)))
    return ops.reshape(moved, ops.constant(np.array([1, heads * HEAD], np.int64)), False).output(0)


def _graph(**variant):
    """q, k: the projections' output as heads [1, 1, heads, head] transposed to [1, heads, 1, head], as exported."""
    q, k = (ops.parameter([1, 1, n, HEAD], ov.Type.f32) for n in (HEADS, KV_HEADS))
    cos, sin = (ops.parameter([1, 1, 1, HEAD], ov.Type.f32) for _ in range(2))
    perm = ops.constant(np.array([0, 2, 1, 3], np.int64))
    xq, xk = (ops.transpose(p, perm).output(0) for p in (q, k))
    inputs = [
        _attention_input(_rotated(x, cos.output(0), sin.output(0), **variant), n)
        for x, n in ((xq, HEADS), (xk, KV_HEADS))
    ]
    return inputs, (xq, xk), (cos.output(0), sin.output(0))


def test_exported_rotation_is_found_with_x_cos_and_sin():
    (q, k), (xq, xk), (cos, sin) = _graph()
    found = rope.find(q, HEADS, HEAD)
    assert found == rope.Rotation(xq, cos, sin)
    assert rope.find(k, KV_HEADS, HEAD) == rope.Rotation(xk, cos, sin)
    flat = rope.inputs(q, k, HEADS, KV_HEADS, HEAD)
    assert flat is not None
    assert [list(o.get_partial_shape().to_shape()) for o in flat] == [[1, 32], [1, 16], [1, 8], [1, 8]]
    assert [o.get_node().input_value(0) for o in flat] == [xq, xk, cos, sin]


@pytest.mark.parametrize(
    "variant",
    [
        {"swap": True},  # concat(x[..., :h], -x[..., h:]): the opposite rotation
        {"negate_lower": True},  # concat(x[..., h:], -x[..., :h])
    ],
)
def test_another_rotation_is_left_to_the_graph(variant):
    (q, k), _, _ = _graph(**variant)
    assert rope.find(q, HEADS, HEAD) is None
    assert rope.inputs(q, k, HEADS, KV_HEADS, HEAD) is None


def test_heads_reordered_after_the_rotation_are_left_to_the_graph():
    """A Transpose that puts the head axis after the head's values changes the values' order: not taken."""
    _, (xq, _), (cos, sin) = _graph()
    moved = _attention_input(_rotated(xq, cos, sin), HEADS, perm=(0, 2, 3, 1))
    assert rope.find(moved, HEADS, HEAD) is None


def test_q_and_k_rotated_by_different_rows_keep_the_graphs_rotation():
    (q, _), _, _ = _graph()
    k_in = ops.parameter([1, 1, KV_HEADS, HEAD], ov.Type.f32)
    other = [ops.parameter([1, 1, 1, HEAD], ov.Type.f32).output(0) for _ in range(2)]
    xk = ops.transpose(k_in, ops.constant(np.array([0, 2, 1, 3], np.int64))).output(0)
    k = _attention_input(_rotated(xk, *other), KV_HEADS)
    assert rope.find(k, KV_HEADS, HEAD) is not None
    assert rope.inputs(q, k, HEADS, KV_HEADS, HEAD) is None


def test_tokens_as_rows_are_found_with_a_row_of_cos_and_sin_each():
    """The graphs of rows: each token a batch row [T, 1, heads, head] turned to [T, heads, 1, head] (token first
    throughout), cos / sin [T, 1, 1, head]: taken with T rows of q, k, cos and sin."""
    tokens = 3
    q, k = (ops.parameter([tokens, 1, n, HEAD], ov.Type.f32) for n in (HEADS, KV_HEADS))
    cos, sin = (ops.parameter([tokens, 1, 1, HEAD], ov.Type.f32).output(0) for _ in range(2))
    perm = ops.constant(np.array([0, 2, 1, 3], np.int64))
    xq, xk = (ops.transpose(p, perm).output(0) for p in (q, k))

    def attention_input(x: ov.Output, heads: int) -> ov.Output:
        moved = ops.transpose(_rotated(x, cos, sin), perm)
        return ops.reshape(moved, ops.constant(np.array([tokens, heads * HEAD], np.int64)), False).output(0)

    q_in, k_in = attention_input(xq, HEADS), attention_input(xk, KV_HEADS)
    assert rope.find(q_in, HEADS, HEAD) is None  # not one token's worth
    assert rope.find(q_in, HEADS, HEAD, tokens) == rope.Rotation(xq, cos, sin)
    flat = rope.inputs(q_in, k_in, HEADS, KV_HEADS, HEAD, tokens)
    assert flat is not None
    shapes = [[tokens, 32], [tokens, 16], [tokens, 8], [tokens, 8]]
    assert [list(o.get_partial_shape().to_shape()) for o in flat] == shapes


def test_tokens_along_another_axis_are_left_to_the_graph():
    """Tokens after the heads ([1, heads, T, head], as a graph of dynamic shapes lays a step out): the rotated
    values are not token by token in memory, and cos / sin do not lead with the tokens: not taken."""
    x = ops.parameter([1, HEADS, 2, HEAD], ov.Type.f32).output(0)
    cos, sin = (ops.parameter([1, 1, 2, HEAD], ov.Type.f32).output(0) for _ in range(2))
    moved = ops.transpose(_rotated(x, cos, sin), ops.constant(np.array([0, 2, 1, 3], np.int64)))
    flat = ops.reshape(moved, ops.constant(np.array([2, HEADS * HEAD], np.int64)), False).output(0)
    assert rope.find(flat, HEADS, HEAD) is None and rope.find(flat, HEADS, HEAD, 2) is None
    rotated = _rotated(x, cos, sin)  # even seen whole: its tokens are not its first axis
    assert rope.find(rotated, HEADS, HEAD, 2) is None


def test_one_cos_row_for_every_token_is_left_to_the_graph():
    """Several tokens rotated by one row of cos / sin (a broadcast over the tokens): not the op's per-token rows."""
    tokens = 2
    q = ops.parameter([tokens, 1, HEADS, HEAD], ov.Type.f32)
    cos, sin = (ops.parameter([1, 1, 1, HEAD], ov.Type.f32).output(0) for _ in range(2))
    perm = ops.constant(np.array([0, 2, 1, 3], np.int64))
    moved = ops.transpose(_rotated(ops.transpose(q, perm).output(0), cos, sin), perm)
    flat = ops.reshape(moved, ops.constant(np.array([tokens, HEADS * HEAD], np.int64)), False).output(0)
    assert rope.find(flat, HEADS, HEAD, tokens) is None
