"""Exact int4 (export/grid.py): a source whose weights already lie on llama.cpp's Q4_1 / Q8_0 grids (a model
dequantized from a GGUF, like the default model) is exported on that grid, not quantized a second time.

A tiny random Llama is snapped onto the grids the way llama.cpp quantizes (per 32 input channels: Q4_1 for every
linear layer, Q8_0 for the tied embedding / LM head, f16 scales), then exported: the exact export must match
transformers as closely as an fp16 export does, and much more closely than NNCF's requantized int4 of the same
weights (`--requantize`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
from openvino import opset13 as ops

from appliance.manifest import Manifest
from export import grid
from export.exporter import export_model
from export.graph import WeightOptions
from export.openvino_backend import first_step

PROBE = np.array([[5, 17, 42, 99, 123, 7, 64, 200]], np.int64)


def _q4_1(w: np.ndarray) -> np.ndarray:
    g = w.reshape(w.shape[0], -1, 32)
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    d16, m16 = ((hi - lo) / 15).astype(np.float16), lo.astype(np.float16)
    q = np.clip(np.round((g - lo) / np.where(d16 == 0, 1, d16.astype(np.float32))), 0, 15)
    return (m16.astype(np.float32) + d16.astype(np.float32) * q).reshape(w.shape)


def _q8_0(w: np.ndarray) -> np.ndarray:
    g = w.reshape(w.shape[0], -1, 32)
    d16 = (np.abs(g).max(-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    return (d16 * np.clip(np.round(g / np.where(d16 == 0, 1, d16)), -127, 127)).reshape(w.shape)


@pytest.fixture(scope="module")
def gridded(tiny, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    """The tiny Llama with GGUF-style weights, and transformers' fp32 logits on PROBE."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("grid") / "llama-q4_1"
    shutil.copytree(tiny("llama"), folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":  # lm_head is tied to the embedding
                module.weight.copy_(torch.from_numpy(_q4_1(module.weight.numpy())))
        emb = model.get_input_embeddings()
        emb.weight.copy_(torch.from_numpy(_q8_0(emb.weight.numpy())))
        model.save_pretrained(folder)
        reference = model(torch.from_numpy(PROBE)).logits.numpy()
    return folder, reference


def test_exact_grid_is_kept(gridded, tmp_path: Path) -> None:
    folder, reference = gridded
    exact = export_model(folder, tmp_path / "exact", "openvino", "int4")
    requantized = export_model(folder, tmp_path / "nncf", "openvino", "int4", weights=WeightOptions(requantize=True))
    assert exact.weight_compression["method"].startswith("exact grid")
    assert exact.weight_compression["weights"] == {"int4": 14, "int8": 1}  # 2 layers x 7 linears; the embedding
    assert requantized.weight_compression["method"] == "weight-only"
    diff_exact = np.abs(first_step(tmp_path / "exact", PROBE) - reference).max()
    diff_nncf = np.abs(first_step(tmp_path / "nncf", PROBE) - reference).max()
    assert diff_exact < 2e-3, diff_exact  # an fp16 export's tolerance (tests/export/test_export.py ATOL)
    assert diff_exact < diff_nncf / 10, (diff_exact, diff_nncf)
    # the IR itself turns off int8 activations (dynamic quantization) for the int8 LM head
    compiled = ov.Core().compile_model(tmp_path / "exact" / "openvino_model.xml", "CPU")
    assert compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE") == 0
    assert Manifest.load(tmp_path / "exact").weight_format == "int4"


def _matmul_model(weight: np.ndarray) -> ov.Model:
    x = ops.parameter([1, weight.shape[1]], np.float32)
    return ov.Model([ops.matmul(x, ops.constant(weight), False, True)], [x])


def test_off_grid_weights_are_left_to_nncf() -> None:
    rng = np.random.default_rng(0)
    on_grid = _q4_1(rng.standard_normal((8, 64)).astype(np.float32))
    assert grid.compress(_matmul_model(on_grid)) is not None
    off = on_grid.copy()
    off[3, 5] += 1e-3  # one weight off its group's grid
    model = _matmul_model(off)
    assert grid.compress(model) is None
    assert "Constant" in [n.get_type_name() for n in model.get_ordered_ops()]  # untouched: still the f32 weight
    assert not any(n.get_type_name() == "Convert" for n in model.get_ordered_ops())


def test_int8_grid_keeps_the_q4_1_grid_without_zero_points(gridded, tmp_path: Path) -> None:
    """int8 of a Q4_1 source: i8 values k*q - round(k*z) and a scale d/k per group, no zero point (so the CPU
    plugin's dynamic quantization may apply, and its AVX2 kernels skip the subtraction), within a small fraction of
    a step of the exact grid, and far closer to transformers than NNCF's per-channel int8 of the same weights."""
    folder, reference = gridded
    on_grid = export_model(folder, tmp_path / "grid8", "openvino", "int8")
    nncf = export_model(folder, tmp_path / "nncf8", "openvino", "int8", weights=WeightOptions(requantize=True))
    compression = on_grid.weight_compression
    assert compression["method"].startswith("exact grid in 8 bits"), compression
    assert compression["weights"] == {"q4_1": 14, "q8_0": 1}
    assert compression["offset_error_steps"]["max"] <= 1 / 16 + 1e-3
    assert "runtime_options" not in compression  # dynamic quantization is the plugin's call
    assert nncf.weight_compression["method"] == "weight-only"
    ops_ = ov.Core().read_model(tmp_path / "grid8" / "openvino_model.xml").get_ordered_ops()
    assert not any(n.get_type_name() == "Subtract" for n in ops_)  # no zero point anywhere
    assert sum(n.get_type_name() == "Constant" and n.get_element_type() == ov.Type.i8 for n in ops_) == 15
    diff_grid = np.abs(first_step(tmp_path / "grid8", PROBE) - reference).max()
    diff_nncf = np.abs(first_step(tmp_path / "nncf8", PROBE) - reference).max()
    print(f"int8 on the grid {diff_grid:.5f}, NNCF int8 {diff_nncf:.5f}")
    assert diff_grid < 4e-3, diff_grid  # twice an fp16 export's tolerance (tests/export/test_export.py ATOL)
    assert diff_grid < diff_nncf / 2, (diff_grid, diff_nncf)


def test_symmetric8_grid_reproduces_the_q4_1_grid() -> None:
    """Every Q4_1 group's 8-bit form: values in -128..127, w = scale * v within the chosen offset's error of the
    exact `d * q + m`, that error at most 1/16 of a step and far less on average (k is chosen per group), and exact
    when -m/d is an integer."""
    rng = np.random.default_rng(1)
    w = _q4_1(rng.standard_normal((64, 256)).astype(np.float32) * 0.05)
    w[0, :32] = _q4_1(np.linspace(-0.375, 0.5625, 32, dtype=np.float32)[None])  # -m/d = 6 exactly
    q, d, zero = grid._affine4(w)
    plan = grid._symmetric8_grid(q, d, zero)
    assert plan is not None
    values, scale, error = plan
    assert values.dtype == np.int8
    rebuilt = scale.astype(np.float16).astype(np.float64) * values
    exact = d * (q - zero.astype(np.float64))
    assert (np.abs(rebuilt - exact).max(-1, keepdims=True) <= error * d + 1e-6).all()
    assert error.max() <= 1 / 16 + 1e-3
    assert error.mean() < 1 / 64  # k = 8 alone would average 1/32
    assert error[0, 0, 0] < 1e-3
    np.testing.assert_allclose(rebuilt.reshape(w.shape), w, atol=float(d.max()) / 16 + 1e-6)
