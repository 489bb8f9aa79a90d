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

from appliance import cpu_isa
from export import grid
from export.graph import TASK, WeightOptions, first_step_feed

# describe and check read an IR without the export tools (a pulled IR is checked with them too): export/ir.py
from export.ir import MODEL_FILE, check, describe  # noqa: F401 - this backend's ExportBackend functions

DEFAULT_GROUP_SIZE = 128
# Verification only: the CPU plugin defaults to bf16 compute on hosts that have it.
F32_COMPUTE = {"INFERENCE_PRECISION_HINT": "f32"}


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


def compress(scratch: Path, dest: Path, weight_format: str, options: WeightOptions) -> dict[str, Any]:
    """Writes dest/openvino_model.xml; returns what was done to the weights, for the manifest. int4 and int8 keep
    a source that is already on a 4-bit grid on that grid (export/grid.py: int4 exactly, int8 with integer zero
    points) unless an NNCF option was given."""
    model = ov.Core().read_model(scratch / MODEL_FILE)
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
    ov.save_model(model, dest / MODEL_FILE, compress_to_fp16=False)
    return info


def default_sym(isa: cpu_isa.CpuIsa) -> bool:
    """Symmetric weights (no zero point) unless the CPU has VNNI. Without VNNI the CPU plugin never quantizes the
    activations (FullyConnected runs brgemm_avx2_f32 for every weight format and group size, with or without
    DYNAMIC_QUANTIZATION_GROUP_SIZE): it decompresses every weight to f32 for every token, and batch-1 decode is
    bound by that arithmetic, not by memory. A zero point is one more vector op per weight: on a 2-vCPU AVX2 EPYC
    (OpenVINO 2026.4), the random-weight Qwen2.5-1.5B shape took 24% less CPU per decode step in int4 sym g128
    than in int4 asym g128 (133.7 vs 175.8 ms with 1 thread; the FC nodes are 98% of the step; llama.cpp's Q4_K_M
    86.5), and a 12-FC MLP stack of its shape 21% less (int4) / 10% less (int8 per channel);
    docs/performance.md, "Weight formats on AVX2". On VNNI CPUs, asymmetric keeps the optimum-cli default (the
    better accuracy), which dynamic quantization handles."""
    return not isa.vnni


def _quantization_config(weight_format: str, options: WeightOptions) -> tuple[Any, dict[str, Any]]:
    """Weight-only, data-free; symmetric per --sym / --asym, or by this CPU (`default_sym`)."""
    tool = f"nncf {version('nncf')} via optimum-intel {version('optimum-intel')}"
    isa = cpu_isa.detect()
    sym = default_sym(isa) if options.sym is None else options.sym
    mode = f"{weight_format}_{'sym' if sym else 'asym'}"
    chosen = {"sym_chosen_for": isa.name} if options.sym is None else {}
    if weight_format == "int8":
        config = OVWeightQuantizationConfig(bits=8, sym=sym, group_size=-1, ratio=1.0)
        return config, {"method": "weight-only", "tool": tool, "mode": mode, "group_size": "per-channel", **chosen}
    group_size = options.group_size or DEFAULT_GROUP_SIZE
    all_layers = options.lm_head == "int4"
    # The embeddings and LM head (NNCF's backup precision) follow: int8 with or without a zero point.
    backup = f"int8_{'sym' if sym else 'asym'}"
    # ADJUST: a weight whose input channels the group size does not divide (tiny or odd hidden sizes) gets the
    # largest smaller power-of-two group that fits, instead of failing the export.
    config = OVWeightQuantizationConfig(
        bits=4,
        sym=sym,
        group_size=group_size,
        ratio=options.ratio,
        all_layers=all_layers,
        backup_precision=backup,
        group_size_fallback="adjust",
    )
    return config, {
        "method": "weight-only",
        "tool": tool,
        "mode": mode,
        "group_size": "per-channel" if group_size == -1 else group_size,
        "group_size_fallback": "adjust",
        "ratio": options.ratio,
        "backup_mode": f"{'int4' if all_layers else backup} for the embeddings and lm_head",
        **chosen,
    }


def first_step(dest: Path, input_ids: np.ndarray) -> np.ndarray:
    """Logits of one step with empty state, computed in f32."""
    compiled = ov.Core().compile_model(dest / MODEL_FILE, "CPU", F32_COMPUTE)
    names = [i.get_any_name() for i in compiled.inputs]
    feed = first_step_feed(names, input_ids)
    if "beam_idx" in names:
        feed["beam_idx"] = np.arange(input_ids.shape[0], dtype=np.int32)
    return np.array(compiled.create_infer_request().infer(feed)["logits"])
