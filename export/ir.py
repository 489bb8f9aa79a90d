"""An OpenVINO IR as the runtime needs it: what the graph says of itself (`describe`), whether it survives the
runtime's paged-attention rewrite (`check`), and `serve_ir`, which turns an IR made elsewhere (a hub repository such
as OpenVINO's own `*-int4-ov` ones: openvino_model.xml/.bin, config.json, tokenizer files) into a folder the
appliance serves.

Only openvino and numpy: `appliance pull` runs this where the export tools (torch, transformers, optimum) are not
installed, and export/openvino_backend.py uses the same `describe` and `check` on its own exports. The manifest is
made from the same parts the exporter uses (export/source.py's config.json checks and Dims, export/metadata.py's
side files), so a pulled IR and an exported one are described alike.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import openvino as ov
from openvino._offline_transformations import paged_attention_transformation

from appliance.manifest import Manifest
from export.graph import GraphInfo
from export.metadata import TOKENIZER_FILE, llm_manifest, write_metadata
from export.source import Dims, ExportError, inspect_source

MODEL_FILE = "openvino_model.xml"
WEIGHTS_FILE = "openvino_model.bin"
# What a folder must hold for `serve_ir`: the graph, its weights, the geometry, the tokenizer (a slow-only tokenizer
# would need transformers to convert)
REQUIRED = (MODEL_FILE, WEIGHTS_FILE, "config.json", TOKENIZER_FILE)
# The files of an IR repository the runtime reads (the rest, e.g. openvino_tokenizer.xml or README.md, is skipped)
WANTED = (
    *REQUIRED,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


def describe(dest: Path) -> GraphInfo:
    return _describe(ov.Core().read_model(dest / MODEL_FILE))


def _describe(model: Any) -> GraphInfo:
    variables = [v.get_info() for v in model.get_variables()]
    if not variables:
        raise ExportError("the IR holds no KV-cache state; the runtime needs a stateful model")
    kv = variables[0]
    return GraphInfo(
        inputs=[i.get_any_name() for i in model.inputs],
        outputs=[o.get_any_name() for o in model.outputs],
        stateful=True,
        kv_dtype=kv.data_type.get_type_name(),
        kv_heads=_static(kv.data_shape, 1),
        head_dim=_static(kv.data_shape, 3),
    )


def _static(shape: Any, axis: int) -> int | None:
    return shape[axis].get_length() if shape[axis].is_static else None


def check(dest: Path) -> None:
    """The runtime rewrites the IR for paged attention on load; do it here on a read copy so a family that
    cannot be rewritten fails at export (or pull) time, not when serving."""
    _check(ov.Core().read_model(dest / MODEL_FILE))


def _check(model: Any) -> None:
    """Rewrites `model` in place (so: the last use of a model read for it)."""
    try:
        paged_attention_transformation(model)
    except Exception as exc:  # noqa: BLE001 - OpenVINO raises plain RuntimeError with the pass's message
        raise ExportError(f"the IR does not survive paged_attention_transformation: {exc}") from None


def verify(model: Any, config: dict[str, Any]) -> tuple[GraphInfo, Dims]:
    """What a stateful decoder IR says of itself, checked against its config.json's geometry and rewritten for paged
    attention as the runtime will (so: the last use of `model`). A pulled IR's and a VLM's language model's check."""
    graph, dims = _describe(model), Dims.from_config(config)
    graph.check_geometry(dims)
    _check(model)
    return graph, dims


def weight_format(model: Any) -> str:
    """int4 / int8 / fp16 / fp32 from the element types of the IR's constants (the weights): 4-bit ones make it
    int4 (an int4 export keeps the embeddings and LM head in int8), else 8-bit ones int8, else the float type."""
    constants = (op for op in model.get_ops() if op.get_type_name() == "Constant")
    types = Counter(op.get_output_element_type(0).get_type_name() for op in constants)
    if types["u4"] or types["i4"]:
        return "int4"
    if types["u8"] or types["i8"] > 1:  # one i8 scalar turns up in float graphs too
        return "int8"
    return "fp16" if types["f16"] or types["bf16"] else "fp32"


def serve_ir(src: Path, dst: Path, name: str, source: str) -> Manifest:
    """Makes `dst` (a new, empty folder) serve the IR in `src`: the graph and weights hard-linked (copied across
    filesystems), the runtime's side files written from the folder's own (export/metadata.py), the IR read and
    rewritten for paged attention as the runtime will, and the manifest last. ExportError on anything missing or
    inconsistent. `source`: where the files came from, for the manifest (e.g. repo@commit)."""
    missing = [f for f in REQUIRED if not (src / f).is_file()]
    if missing:
        raise ExportError(f"{source} lacks {', '.join(missing)}: not an OpenVINO IR the appliance can serve")
    info = inspect_source(src)  # a causal LM of a family the runtime is verified on
    for f in (MODEL_FILE, WEIGHTS_FILE):
        try:
            os.link(src / f, dst / f)
        except OSError:
            shutil.copyfile(src / f, dst / f)
    # read once: the default model's IR took 2.6 s read for each step, 1.4 s read once (a loaded 2-core box)
    model = ov.Core().read_model(dst / MODEL_FILE)
    fmt = weight_format(model)
    graph, dims = verify(model, info.config)
    metadata = write_metadata(src, dst, info.config)
    manifest = llm_manifest(
        graph,
        dims,
        metadata,
        name=name,
        backend="openvino",
        weight_format=fmt,
        model_file=MODEL_FILE,
        architecture=info.architecture,
        model_type=info.model_type,
        source=source,
        weight_compression={"method": "as published: an OpenVINO IR pulled from the hub, not re-quantized"},
    )
    manifest.save(dst)
    return manifest
