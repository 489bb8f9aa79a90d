"""Sibling projections fused into one MatMul (appliance/backends/projection_fusion.py): which groups fuse on the
default model's IRs (not the one feeding an activation), and that the paged backend's f32 logits are
bit-identical with and without the fusion."""

from __future__ import annotations

import numpy as np
import pytest

import appliance.backends.openvino_paged as paged
from appliance.backends.base import StepBatch
from appliance.backends.openvino_common import read_model
from appliance.backends.projection_fusion import fuse_sibling_projections
from appliance.config import EngineConfig
from appliance.manifest import Manifest
from export.default_model import ensure_export

pytestmark = pytest.mark.default_model


def _matmuls(model) -> int:
    return sum(n.get_type_name() == "MatMul" for n in model.get_ordered_ops())


@pytest.mark.parametrize("fmt, fusable", [("fp32", True), ("fp16", True), ("int8", False), ("int4", False)])
def test_groups_fused_per_layer(fmt, fusable):
    path = ensure_export("openvino", fmt)
    manifest = Manifest.load(path)
    model = read_model(path, manifest.model_file)
    before = _matmuls(model)
    fused = fuse_sibling_projections(model)
    if fusable:  # q/k/v in every layer: 3 MatMuls become 1; gate (feeds SiLU) and up stay apart
        assert fused == manifest.num_layers
        assert _matmuls(model) == before - 2 * manifest.num_layers
        assert not any(
            n.get_type_name() == "Swish" and n.input_value(0).get_node().get_type_name() == "VariadicSplit"
            for n in model.get_ordered_ops()
        )
    else:  # quantized weights (int8, int4): left alone, graph unchanged
        assert fused == 0 and _matmuls(model) == before


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "int8", "int4"])
def test_f32_logits_identical_with_and_without(fmt, monkeypatch):
    path = ensure_export("openvino", fmt)
    manifest, config = Manifest.load(path), EngineConfig(precision="f32", kv_cache_tokens=512)
    prompt = np.random.default_rng(0).integers(100, manifest.vocab_size, 40).tolist()

    def run() -> np.ndarray:
        backend = paged.OpenVINOPagedBackend(path, manifest, config)
        try:
            table = list(range(3))
            first = backend.forward(StepBatch([prompt], [0], [table])).copy()
            second = backend.forward(StepBatch([[int(first[0].argmax())]], [len(prompt)], [table])).copy()
            return np.concatenate([first, second])
        finally:
            backend.close()

    fused = run()
    monkeypatch.setattr(paged, "fuse_sibling_projections", lambda model: 0)
    np.testing.assert_array_equal(fused, run())
