"""Sibling projections fused into one MatMul (appliance/runtime/backends/projection_fusion.py): which groups fuse on the
default model's IRs (not the one feeding an activation; nothing on the quantized ones, whose graph is left as it
was), and that the paged backend's f32 logits are bit-identical with and without the fusion. The logits are
compared on fp32 and fp16 only: int8 and int4 are not fused, so there both runs would be the same graph."""

from __future__ import annotations

import numpy as np
import pytest

import appliance.runtime.backends.openvino_paged as paged
from appliance.config import EngineConfig
from appliance.manifest import Manifest
from appliance.runtime.backends.base import StepBatch
from appliance.runtime.backends.openvino_common import read_model
from appliance.runtime.backends.projection_fusion import fuse_sibling_projections
from export.default_model import ensure_export

pytestmark = pytest.mark.default_model


def _matmuls(model) -> int:
    return sum(n.get_type_name() == "MatMul" for n in model.get_ordered_ops())


def _graph(model) -> list[tuple[str, str, list[str]]]:
    """Every op: its name, its type and where its inputs come from (a rewired weight shows as a new source)."""
    return [
        (
            n.get_friendly_name(),
            n.get_type_name(),
            [
                f"{i.get_source_output().get_node().get_friendly_name()}:{i.get_source_output().get_index()}"
                for i in n.inputs()
            ],
        )
        for n in model.get_ordered_ops()
    ]


@pytest.mark.parametrize("fmt, fusable", [("fp32", True), ("fp16", True), ("int8", False), ("int4", False)])
def test_groups_fused_per_layer(fmt, fusable):
    path = ensure_export("openvino", fmt)
    manifest = Manifest.load(path)
    model = read_model(path, manifest.model_file)
    before, graph = _matmuls(model), _graph(model)
    fused = fuse_sibling_projections(model)
    if fusable:  # q/k/v in every layer: 3 MatMuls become 1; gate (feeds SiLU) and up stay apart
        assert fused == manifest.num_layers
        assert _matmuls(model) == before - 2 * manifest.num_layers
        assert not any(
            n.get_type_name() == "Swish" and n.input_value(0).get_node().get_type_name() == "VariadicSplit"
            for n in model.get_ordered_ops()
        )
    else:  # quantized weights (int8, int4): left alone, graph unchanged (no op added, removed or rewired)
        assert fused == 0 and _graph(model) == graph


@pytest.mark.parametrize("fmt", ["fp32", "fp16"])
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

    groups: list[int] = []  # what the backend's fusion did: the comparison means something only if it fused

    def counted(model) -> int:
        groups.append(fuse_sibling_projections(model))
        return groups[-1]

    monkeypatch.setattr(paged, "fuse_sibling_projections", counted)
    fused = run()
    assert groups == [manifest.num_layers]
    monkeypatch.setattr(paged, "fuse_sibling_projections", lambda model: 0)
    np.testing.assert_array_equal(fused, run())
