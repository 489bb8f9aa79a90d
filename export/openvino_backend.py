"""OpenVINO backend: a stateful IR (the KV cache held as graph state), which the runtime's paged attention
transformation and openvino_genai both require."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
from openvino_telemetry.utils.opt_in_checker import ConsentCheckResult, OptInChecker
from optimum.exporters.openvino import export_from_model
from optimum.intel import OVConfig, OVWeightQuantizationConfig
from optimum.intel.openvino.quantization import _weight_only_quantization

from export import grid
from export.graph import TASK, WeightOptions, first_step_feed

# describe and check read an IR without the export tools (a pulled IR is checked with them too): export/ir.py
from export.ir import MODEL_FILE, check, describe  # noqa: F401 - this backend's ExportBackend functions

DEFAULT_GROUP_SIZE = 128
# Verification only: the CPU plugin defaults to bf16 compute on hosts that have it.
F32_COMPUTE = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}  # no int8 activations either


def convert(model: Any, scratch: Path, weight_format: str) -> None:
    """fp16 is written by the converter itself (f16 weights decompressed to f32 compute); every other format
    starts from the fp32 IR, which is what NNCF expects to compress."""
    _decline_telemetry()
    dtype = "fp16" if weight_format == "fp16" else "fp32"
    export_from_model(model, scratch, task=TASK, ov_config=OVConfig(dtype=dtype), stateful=True)


def _decline_telemetry() -> None:
    """OpenVINO's model converter reports usage to Google Analytics unless the user opted out, and a missing
    consent file counts as consent. An edge appliance must not phone home: record the opt-out, as
    `opt_in_out --opt_out` would, unless the user already made a choice."""
    checker = OptInChecker()
    if not Path(checker.consent_file()).exists():
        checker.update_result(ConsentCheckResult.DECLINED)


def compress(
    scratch: Path, dest: Path, weight_format: str, options: WeightOptions, model_file: str = MODEL_FILE
) -> dict[str, Any]:
    """Writes dest/`model_file` (a VLM's language model has its own name); returns what was done to the weights, for
    the manifest. int4 and int8 keep a source that is already on a 4-bit grid on that grid (export/grid.py: int4
    exactly, int8 with integer zero points) unless an NNCF option was given."""
    model = ov.Core().read_model(scratch / model_file)
    bits = {"int4": 4, "int8": 8}.get(weight_format)
    exact = grid.compress(model, bits) if bits and not options.nncf() else None
    if exact is not None:
        info = exact
    elif weight_format in ("int8", "int4"):
        config, info = _quantization_config(weight_format, options)
        # optimum-intel's wrapper around nncf.compress_weights: it also drops the f16 KV-cache hint the converter
        # put in rt_info for float models, exactly as `optimum-cli export openvino --weight-format int4` does.
        model = _weight_only_quantization(model, config)
    else:
        info = (
            {"method": "none"}
            if weight_format == "fp32"
            else {"method": "openvino compress_to_fp16", "compute": "f32 (weights decompressed at load)"}
        )
    ov.save_model(model, dest / model_file, compress_to_fp16=False)
    return info


def _quantization_config(weight_format: str, options: WeightOptions) -> tuple[Any, dict[str, Any]]:
    """Weight-only, data-free, asymmetric unless --sym (the optimum-cli default: better accuracy on CPU/GPU than
    sym). Also on AVX2 CPUs without VNNI, where --sym decodes faster: there the CPU plugin decompresses every weight
    to f32 for every token (brgemm_avx2_f32, no dynamic quantization) and the zero point is one more op per weight,
    so int4 sym g128 took 24% less CPU per decode step than asym g128 at the Qwen2.5-1.5B shape (133.7 vs 175.8 ms,
    1 thread; llama.cpp's Q4_K_M 86.5). It costs accuracy at every group size measured: next-token TVD from fp32
    0.269 vs 0.237 (random 1.5B), 0.393 vs 0.333 (SmolLM2-135M, g128), 0.297 vs 0.266 (g32): not the default
    (docs/performance-log.md, "Weight formats on AVX2")."""
    tool = f"nncf {version('nncf')} via optimum-intel {version('optimum-intel')}"
    mode = f"{weight_format}_{'sym' if options.sym else 'asym'}"
    if weight_format == "int8":
        config = OVWeightQuantizationConfig(bits=8, sym=options.sym, group_size=-1, ratio=1.0)
        return config, {"method": "weight-only", "tool": tool, "mode": mode, "group_size": "per-channel"}
    group_size = options.group_size or DEFAULT_GROUP_SIZE
    all_layers = options.lm_head == "int4"
    # ADJUST: a weight whose input channels the group size does not divide (tiny or odd hidden sizes) gets the
    # largest smaller power-of-two group that fits, instead of failing the export.
    config = OVWeightQuantizationConfig(
        bits=4,
        sym=options.sym,
        group_size=group_size,
        ratio=options.ratio,
        all_layers=all_layers,
        group_size_fallback="adjust",
    )
    return config, {
        "method": "weight-only",
        "tool": tool,
        "mode": mode,
        "group_size": "per-channel" if group_size == -1 else group_size,
        "group_size_fallback": "adjust",
        "ratio": options.ratio,
        "backup_mode": f"{'int4' if all_layers else 'int8_asym'} for the embeddings and lm_head",
    }


def first_step(dest: Path, input_ids: np.ndarray) -> np.ndarray:
    """Logits of one step with empty state, computed in f32."""
    compiled = ov.Core().compile_model(dest / MODEL_FILE, "CPU", F32_COMPUTE)
    names = [i.get_any_name() for i in compiled.inputs]
    feed = first_step_feed(names, input_ids)
    if "beam_idx" in names:
        feed["beam_idx"] = np.arange(input_ids.shape[0], dtype=np.int32)
    return np.array(compiled.create_infer_request().infer(feed)["logits"])
