"""Fuse sibling projections: MatMuls that read the same activation with constant weights (attention's q/k/v,
the MLP's gate/up) become one MatMul over the concatenated weights and a VariadicSplit.

Why: at decode batch sizes a projection is a matrix-vector product bound by memory and by a fixed cost per
kernel call; OpenVINO's CPU plugin only fuses these itself on AMX machines. On SmolLM2 (fp16 IR, 2 vCPUs,
paired runs) fusing q/k/v made a step 1-5% faster at batch 1-16 and left a 512-token prefill unchanged, with
bit-identical f32 logits.

A group is left alone when a sibling feeds an activation (the MLP's gate -> SiLU): the plugin runs that
activation as a post-op of the projection's kernel, and a split in between costs more than the fusion saves
(gate/up fused: no faster at decode, 4% slower on a 512-token prefill, from an unfused SiLU and a reference
VariadicSplit kernel).

Quantized weights (int8, int4) are left alone: concatenating them copies the weights into anonymous memory while
the IR's originals stay mapped and unused (+92 MB RSS at the Qwen2.5-1.5B shape in int8, +41 MB at 0.5B:
bench/sizes.py), and 0.5B int8 decoded no faster fused (3 paired runs at batch 1: 14.3 / 20.0 / 32.0
tok/s fused vs 16.6 / 18.1 / 32.7 unfused, the box's load moving underneath). f16 and f32 weights are fused.
(Our low-bit kernels share one op among u4 siblings in their own rewrite, from the copy they make anyway:
appliance/runtime/kernels/rewrite.py; both group and split through appliance/runtime/siblings.py.)

The weights keep their compressed form: the decompression chain (Convert / Subtract zero point / Multiply
scale) of the first projection is rewired to concatenated constants, so its nodes keep the runtime marks that
tell the plugin to decompress on the fly instead of folding the weights to f32. Only chains whose every
constant is per output row (dim 0 = the projection's width) are fused; anything else (e.g. group-wise int4
with a Reshape) is left alone.
"""

from __future__ import annotations

import numpy as np
import openvino as ov

from appliance.runtime.siblings import siblings, split_last, width

_CHAIN = ("Convert", "Subtract", "Multiply")
_ACTIVATIONS = {"Swish", "Gelu", "Sigmoid", "Relu", "HSwish", "HSigmoid", "Mish", "Elu", "Tanh", "SoftPlus"}


def _signature(node: ov.Node, rows: int) -> tuple | None:
    """The weight chain's shape with dim 0 left out (siblings must agree on it), or None if not fusable."""
    kind = node.get_type_name()
    if kind == "Constant":
        if node.get_output_element_type(0).is_integral_number():  # quantized weights: left alone (module doc)
            return None
        shape = tuple(node.get_output_shape(0))
        return ("C", str(node.get_output_element_type(0)), shape[1:]) if len(shape) >= 2 and shape[0] == rows else None
    if kind not in _CHAIN:
        return None
    parts = tuple(_signature(node.input_value(i).get_node(), rows) for i in range(node.get_input_size()))
    return None if None in parts else (kind, str(node.get_output_element_type(0)), parts)


def _merge(consumers: list[ov.Node], index: int) -> None:
    """Rewire input `index` of the first consumer in place: a constant becomes the row-wise concatenation of
    the siblings' constants, a chain node is kept and its own inputs are merged the same way."""
    parts = [n.input_value(index).get_node() for n in consumers]
    if parts[0].get_type_name() == "Constant":
        data = np.concatenate([np.array(p.get_data()) for p in parts], axis=0)
        consumers[0].input(index).replace_source_output(ov.op.Constant(ov.Tensor(data)).output(0))
        return
    for i in range(parts[0].get_input_size()):
        _merge(parts, i)
    parts[0].validate_and_infer_types()


def _key(node: ov.Node) -> tuple | None:
    """A fusable projection's weight signature (siblings must agree on it), or None."""
    if node.get_attributes() != {"transpose_a": False, "transpose_b": True}:
        return None
    rows = node.get_output_partial_shape(0)[-1]
    return _signature(node.input_value(1).get_node(), rows.get_length()) if rows.is_static else None


def fuse_sibling_projections(model: ov.Model) -> int:
    """Returns the number of groups fused."""
    fused = 0
    for mms in siblings(model, _key):
        if len(mms) < 2 or any(
            t.get_node().get_type_name() in _ACTIVATIONS for m in mms for t in m.output(0).get_target_inputs()
        ):
            continue
        widths = [width(m) for m in mms]
        consumers = [list(m.output(0).get_target_inputs()) for m in mms]
        _merge(mms, 1)
        mms[0].validate_and_infer_types()
        for part, inputs in zip(split_last(mms[0].output(0), widths), consumers):
            for target in inputs:
                target.replace_source_output(part)
        fused += 1
    model.validate_nodes_and_infer_types()
    return fused
