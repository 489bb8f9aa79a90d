"""ONNX backend: a stateless graph (past_key_values.* in, present.* out) for ONNX Runtime.

Only fp32 is exported by optimum; the other formats are rewrites of that graph with onnxruntime's own tools,
since optimum's fp16 export needs CUDA.
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper
from onnxruntime.transformers.float16 import convert_float_to_float16
from optimum.exporters.onnx import onnx_export_from_model

from export.graph import TASK, GraphInfo, WeightOptions, first_step_feed
from export.source import ExportError

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx_data"
DEFAULT_BLOCK_SIZE = 32
# protobuf cannot serialize a message over 2 GiB: larger graphs keep their tensors in DATA_FILE.
EXTERNAL_DATA_THRESHOLD = 2**31 - (64 << 20)
ORT_TYPES = {"tensor(float)": "f32", "tensor(float16)": "f16"}
NP_TYPES = {"f32": np.float32, "f16": np.float16}


def convert(model: Any, scratch: Path, weight_format: str) -> None:
    """Always fp32: the other formats are derived from it in `compress`. Validation is ours (verify stage)."""
    onnx_export_from_model(model, scratch, task=TASK, do_validation=False)


def compress(scratch: Path, dest: Path, weight_format: str, options: WeightOptions) -> dict[str, Any]:
    """Writes dest/model.onnx (+ model.onnx_data if large); returns what was done to the weights. Of the weight
    options only the block size applies (exporter.py refuses the others for ONNX)."""
    model = onnx.load(str(scratch / MODEL_FILE))
    info: dict[str, Any] = {"method": "none"}
    if weight_format == "fp16":
        # keep_io_types: inputs, logits and present.* stay f32, so the runtime feeds one dtype for every format.
        # Shape inference is skipped because it serializes the model, which fails past 2 GiB; it adds nothing here.
        model = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=True)
        info = {
            "method": "onnxruntime convert_float_to_float16",
            "compute": "f16 inside, f32 inputs/outputs",
            "tool": f"onnxruntime {version('onnxruntime')}",
        }
    elif weight_format in ("int8", "int4"):
        model, info = _quantize(model, 8 if weight_format == "int8" else 4, options.group_size or DEFAULT_BLOCK_SIZE)
    _save(model, dest / MODEL_FILE)
    return info


def _quantize(model: Any, bits: int, block_size: int) -> tuple[Any, dict[str, Any]]:
    """Weight-only block quantization of every MatMul with a constant weight into MatMulNBits (symmetric), which
    ONNX Runtime's CPU provider runs natively. Embeddings (Gather) stay f32."""
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    except ImportError as exc:  # it needs onnx-ir, which onnxruntime does not declare as a dependency
        raise ExportError(f"int{bits} ONNX export needs onnxruntime's MatMulNBitsQuantizer: {exc}") from None

    _gemm_to_matmul(model)
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=True)
    quantizer.process()
    quantized = quantizer.model.model
    count = sum(node.op_type == "MatMulNBits" for node in quantized.graph.node)
    if not count:
        raise ExportError(f"int{bits}: no MatMul weight in the ONNX graph could be quantized")
    return quantized, {
        "method": "weight-only",
        "tool": f"onnxruntime {version('onnxruntime')} MatMulNBitsQuantizer",
        "mode": f"int{bits}_sym",
        "block_size": block_size,
        "quantized_matmuls": count,
        "not_quantized": "embeddings (Gather)",
    }


def _gemm_to_matmul(model: Any) -> None:
    """MatMulNBits only replaces MatMul, but GPT-2's Conv1D layers export as Gemm(x, W, b). Rewrite each plain Gemm
    with a constant, untransposed weight as MatMul (+ Add for the bias) so those layers are quantized too."""
    initializers = {t.name for t in model.graph.initializer}
    nodes = []
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        plain = all(
            attrs.get(k, default) == default
            for k, default in (("transA", 0), ("transB", 0), ("alpha", 1.0), ("beta", 1.0))
        )
        if node.op_type != "Gemm" or node.input[1] not in initializers or not plain:
            nodes.append(node)
            continue
        has_bias = len(node.input) > 2 and bool(node.input[2])
        product = f"{node.output[0]}_matmul" if has_bias else node.output[0]
        nodes.append(helper.make_node("MatMul", node.input[:2], [product], name=f"{node.name}_matmul"))
        if has_bias:
            nodes.append(helper.make_node("Add", [product, node.input[2]], [node.output[0]], name=f"{node.name}_bias"))
    model.graph.ClearField("node")
    model.graph.node.extend(nodes)


def _save(model: Any, path: Path) -> None:
    size = sum(t.ByteSize() for t in model.graph.initializer)
    if size < EXTERNAL_DATA_THRESHOLD:
        onnx.save_model(model, str(path))
    else:
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=DATA_FILE,
            size_threshold=1024,
        )


def describe(dest: Path) -> GraphInfo:
    session = _session(dest)
    inputs, outputs = session.get_inputs(), session.get_outputs()
    past = next(i for i in inputs if i.name.startswith("past_key_values."))
    present = next(o for o in outputs if o.name.startswith("present."))
    return GraphInfo(
        inputs=[i.name for i in inputs],
        outputs=[o.name for o in outputs],
        stateful=False,
        kv_dtype=ORT_TYPES[present.type],
        kv_heads=_static(past.shape, 1),
        head_dim=_static(past.shape, 3),
    )


def _static(shape: list[Any], axis: int) -> int | None:
    return shape[axis] if isinstance(shape[axis], int) else None


def check(dest: Path) -> None:
    """Nothing beyond what `first_step` proves: ONNX Runtime builds a session and runs the graph."""


def first_step(dest: Path, input_ids: np.ndarray) -> np.ndarray:
    """Logits of one step with an empty past (zero-length past_key_values.*)."""
    session = _session(dest)
    names = [i.name for i in session.get_inputs()]
    feed = first_step_feed(names, input_ids)
    for arg in session.get_inputs():
        if arg.name.startswith("past_key_values."):
            shape = (input_ids.shape[0], arg.shape[1], 0, arg.shape[3])
            feed[arg.name] = np.zeros(shape, NP_TYPES[ORT_TYPES[arg.type]])
    return session.run(["logits"], feed)[0]


def _session(dest: Path) -> Any:
    return ort.InferenceSession(str(dest / MODEL_FILE), providers=["CPUExecutionProvider"])
