"""At load: each MatMul whose weight is OpenVINO's u4 decompression chain becomes our LowBitMatMul op (the model as
read, before compiling; the export on disk stays standard IR that OVMS and genai read).

The chain, as NNCF writes it (u4 zero point) and as export/grid.py writes the exact Q4_1 grid (f16 zero point):
    Constant u4 [N, G, gs] -> Convert -> Subtract(zero point) -> Multiply(scale) -> Reshape [N, K] -> (Convert f32)
    -> MatMul(x, ., transpose_b=True)
or per output channel (G = 1: no Reshape, [N, K] constants). Only u4 with gs 32 or a multiple of 64 is taken;
anything else (i4 symmetric, int8, a group of 16, transpose_b=False) keeps OpenVINO's kernels.

Memory: the op reads the u4 bytes as a u8 copy ([N, K/2]; OpenVINO's Python API cannot share a read-only constant's
memory; the new Constant shares our copy, so it is made once) and a u8 [N, 4 G] of f16 scale and zero point per group.
The backends keep a second, unrewritten graph for prefill (KERNEL_ROWS), which holds the plugin's own copy: the
default model's engine RSS went 243 -> 371 MB with every layer on ours (386 before the Constants shared our copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import openvino as ov

OP = "LowBitMatMul"


@dataclass(frozen=True)
class Chain:
    """A matched u4 decompression chain, as arrays for the op."""

    packed: np.ndarray  # u8 [N, K/2]
    sz: np.ndarray  # u8 [N, 4 G]: f16 scale, f16 zero point per group
    group_size: int


def _u4_values(node: ov.Node) -> np.ndarray:
    """A u4 Constant's values, one per byte, in its shape (OpenVINO packs two per byte, low nibble first)."""
    packed = np.asarray(node.get_data()).view(np.uint8).ravel()
    values = np.empty(packed.size * 2, np.uint8)
    values[0::2], values[1::2] = packed & 15, packed >> 4
    return values[: int(np.prod(node.shape))].reshape(tuple(node.shape))


def _constant(output: ov.Output) -> np.ndarray | None:
    """The value of a Constant, or of Convert(Constant) (a u4/u8 zero point), as float32; else None."""
    node = output.get_node()
    if node.get_type_name() == "Convert":
        node = node.input_value(0).get_node()
    if node.get_type_name() != "Constant":
        return None
    if node.get_element_type() == ov.Type.u4:
        return _u4_values(node).astype(np.float32)
    return np.asarray(node.get_data(), np.float32)


def _is(output: ov.Output, kind: str) -> bool:
    return output.get_node().get_type_name() == kind


def match(matmul: ov.Node) -> Chain | None:
    """The u4 chain feeding `matmul`'s weight input, or None when it is anything else."""
    attrs = matmul.get_attributes()
    if attrs.get("transpose_a") or not attrs.get("transpose_b"):
        return None
    w = matmul.input_value(1)
    if _is(w, "Convert"):
        w = w.get_node().input_value(0)
    n_k = tuple(w.get_partial_shape().to_shape()) if w.get_partial_shape().is_static else ()
    if len(n_k) != 2:
        return None
    if _is(w, "Reshape"):
        w = w.get_node().input_value(0)
    if not _is(w, "Multiply"):
        return None
    sub, scale_out = w.get_node().input_value(0), w.get_node().input_value(1)
    scale = _constant(scale_out)
    if scale is None or not _is(sub, "Subtract"):
        return None
    values_out, zero_out = sub.get_node().input_value(0), sub.get_node().input_value(1)
    if not _is(values_out, "Convert"):
        return None
    values = values_out.get_node().input_value(0).get_node()
    if values.get_type_name() != "Constant" or values.get_element_type() != ov.Type.u4:
        return None
    zero = _constant(zero_out)
    shape = tuple(values.shape)
    n, k = n_k
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
    sz = np.stack([s.astype(np.float16), z.astype(np.float16)], -1).view(np.uint8).reshape(n, 4 * groups)
    packed = np.asarray(values.get_data()).view(np.uint8).reshape(n, k // 2).copy()
    return Chain(packed, np.ascontiguousarray(sz), group_size)


def rewrite(model: ov.Model, factory: Any, isa: str = "auto", min_weights: int = 0) -> int:
    """Replaces every matching MatMul of `model` in place with a LowBitMatMul made by `factory` (an OpenVINO
    NodeFactory holding our extension) whose weight holds at least `min_weights` values; returns how many. The op
    computes in f32 and returns f32, as the MatMul did."""
    from openvino import opset13 as ops

    found = []
    for node in model.get_ordered_ops():
        if node.get_type_name() == "MatMul" and node.get_output_element_type(0) == ov.Type.f32:
            chain = match(node)
            if chain is not None and chain.packed.size * 2 >= min_weights:
                found.append((node, chain))
    # Every op is made before any is swapped in: a failure leaves the model as it was read.
    swaps = []
    for node, chain in found:
        new = factory.create(
            OP,
            [
                node.input_value(0),
                ops.constant(chain.packed, shared_memory=True).output(0),  # our copy, not copied again
                ops.constant(chain.sz, shared_memory=True).output(0),
            ],
            {"group_size": chain.group_size, "isa": isa},
        )
        new.set_friendly_name(node.get_friendly_name())
        swaps.append((node, new))
    for node, new in swaps:
        for target in list(node.output(0).get_target_inputs()):
            target.replace_source_output(new.output(0))
    if swaps:
        model.validate_nodes_and_infer_types()
    return len(swaps)
