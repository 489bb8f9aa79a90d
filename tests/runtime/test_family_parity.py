"""Every supported family, every backend: the engine's greedy tokens equal transformers' on tiny random models
(fixed seed). Paged OpenVINO, static-shape OpenVINO (the NPU mode, run on CPU) and ONNX Runtime."""

from __future__ import annotations

import pytest

from appliance.config import EngineConfig
from appliance.runtime.engine import Engine
from appliance.runtime.tokenizer import Tokenizer
from tests import tiny_models
from tests.runtime.test_parity import engine_greedy, hf_greedy

PROMPTS = ["Hello world! How are you today?", "The appliance serves", "def main():\n"]
NEW_TOKENS = 24
MODES = {
    "openvino-paged": ("openvino", dict()),
    "openvino-static": ("openvino", dict(static=True, static_context=128, static_batch=2, static_prefill_chunk=8)),
    "onnx": ("onnx", dict(static_context=128, static_batch=2)),
}


@pytest.fixture(scope="session")
def family_reference(tiny):
    cache = {}

    def get(family):
        if family not in cache:
            folder = tiny(family)
            tok = Tokenizer.from_dir(folder)
            prompts = [tok.encode(p) for p in PROMPTS]
            cache[family] = prompts, hf_greedy(folder, prompts, NEW_TOKENS)
        return cache[family]

    return get


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", list(tiny_models.FAMILIES))
def test_family_greedy_matches_transformers(family, mode, exported, family_reference):
    backend, cfg = MODES[mode]
    out, _ = exported(family, backend, "fp32")
    prompts, want = family_reference(family)
    engine = Engine(out, EngineConfig(precision="f32", max_num_batched_tokens=16, **cfg))
    try:
        got = engine_greedy(engine, prompts, NEW_TOKENS)
    finally:
        engine.shutdown()
    assert got == want
