"""Sibling MatMuls: the graph's MatMuls that read one activation (attention's q/k/v, the MLP's gate/up), and the
split that gives each of them back its part of one MatMul (or op) over their rows together.

Two load-time rewrites fuse them: backends/projection_fusion.py (f16/f32 weights, one MatMul over the concatenated
weights) and kernels/rewrite.py (u4 weights, one LowBitMatMul over their repacked rows). Both group and split the
same way, here.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import numpy as np
import openvino as ov
import openvino.opset13 as ops


def siblings(model: ov.Model, key: Callable[[ov.Node], Hashable | None]) -> list[list[ov.Node]]:
    """`model`'s MatMuls grouped by the activation output they read and by `key(node)` (None: the MatMul is left
    out), each group in graph order."""
    groups: dict[tuple, list[ov.Node]] = {}
    for node in model.get_ordered_ops():
        if node.get_type_name() != "MatMul":
            continue
        k = key(node)
        if k is not None:
            x = node.input_value(0)
            groups.setdefault((x.get_node().get_name(), x.get_index(), k), []).append(node)
    return list(groups.values())


def width(node: ov.Node) -> int:
    """The static width (last dimension) of `node`'s output."""
    return node.get_output_partial_shape(0)[-1].get_length()


def split_last(output: ov.Output, widths: list[int]) -> list[ov.Output]:
    """`output` split on its last axis into parts of `widths`, in order (a VariadicSplit, not yet consumed)."""
    split = ops.variadic_split(output, ops.constant(np.int64(-1)), ops.constant(np.array(widths, np.int64)))
    return list(split.outputs())
