"""Export a local encoder folder (embeddings or rerank) for one backend and weight format.

Sources: a sentence-transformers folder (a BERT/RoBERTa/XLM-R transformer at its root, `modules.json`,
`1_Pooling/config.json`, `sentence_bert_config.json`), a plain Hugging Face encoder (AutoModel: mean pooling, no
normalize, unless told), or a cross-encoder (AutoModelForSequenceClassification with one label: task `rerank`).

The graph on disk is the plain transformer, as optimum exports it (input_ids, attention_mask[, token_type_ids] ->
last_hidden_state, or -> logits for a cross-encoder): the same IR openvino_genai's TextEmbeddingPipeline reads.
Pooling and normalize are facts of the model, written to the manifest (appliance/manifest.py), and applied by the
runtime (appliance/runtime/encoder.py). Weight formats reuse the LLM backends' compression: OpenVINO fp16 from the
converter, int8 by NNCF weight-only per channel; ONNX fp16/int8 by onnxruntime's tools (export/onnx_backend.py).
The export is verified by loading it in the runtime's own Encoder and comparing with transformers on a padded batch.
"""

from __future__ import annotations

import gc
import importlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from appliance.manifest import POOLINGS, Manifest
from export.exporter import _quiet, staged  # the LLM exporter's staging and quieting, shared
from export.graph import WeightOptions
from export.metadata import write_metadata
from export.source import WEIGHT_SUFFIXES, ExportError, check_destination

__all__ = ["ENCODER_TYPES", "EncoderSource", "export_encoder", "inspect_encoder", "torch_reference"]

# model_types exported and checked against transformers by tests/runtime/test_encoder.py (tiny random models).
ENCODER_TYPES = frozenset({"bert", "roberta", "xlm-roberta"})
# RoBERTa-family position tables carry padding_idx + 1 extra rows that no token can use.
POSITION_OFFSET = {"roberta": 2, "xlm-roberta": 2}
WEIGHT_FORMATS = ("fp32", "fp16", "int8")
# The probe texts the export is verified on: different lengths, so the batch is padded.
PROBE_TEXTS = (
    "The appliance serves models on small machines.",
    "Short.",
    "A longer sentence with several words, numbers like 1234 and punctuation; it makes the batch padded.",
)
# cosine(exported, transformers) floor per weight format on the probe (embed), or max |logit diff| relative to
# the largest logit (rerank). int8 keeps a random tiny model's vectors within ~0.99 (measured: 0.995-0.999).
MIN_COSINE = {"fp32": 0.99999, "fp16": 0.999, "int8": 0.98}
MAX_SCORE_ERROR = {"fp32": 1e-4, "fp16": 1e-2, "int8": 0.1}
TASKS = {"embed": "feature-extraction", "rerank": "text-classification"}  # optimum's task names


@dataclass(frozen=True)
class EncoderSource:
    folder: Path
    config: dict[str, Any]
    model_type: str
    architecture: str
    task: str  # embed | rerank
    pooling: str | None  # embed only
    normalize: bool
    max_length: int


def inspect_encoder(src: Path, task: str | None = None, pooling: str | None = None) -> EncoderSource:
    """Reads what the runtime needs from the folder's json files alone; raises ExportError with one clear line."""
    if not src.is_dir():
        raise ExportError(f"source folder not found: {src}")
    config = _read_json(src / "config.json", required=True)
    model_type = str(config.get("model_type", ""))
    if model_type not in ENCODER_TYPES:
        raise ExportError(
            f"unsupported encoder model_type {model_type or '?'}; supported: {', '.join(sorted(ENCODER_TYPES))}"
        )
    if not any(p.suffix in WEIGHT_SUFFIXES for p in src.iterdir() if p.is_file()):
        raise ExportError(f"no weights in {src} ({', '.join('*' + s for s in WEIGHT_SUFFIXES)})")
    architectures = [str(a) for a in config.get("architectures") or []]
    classifier = any(a.endswith("ForSequenceClassification") for a in architectures)
    task = task or ("rerank" if classifier else "embed")
    if task not in TASKS:
        raise ExportError(f"unknown encoder task {task!r}; choose embed or rerank")
    if task == "rerank":
        labels = len(config.get("id2label") or {}) or int(config.get("num_labels", 1))
        if not classifier or labels != 1:
            raise ExportError(
                f"{src}: rerank needs a cross-encoder (ForSequenceClassification with one label), got "
                f"{', '.join(architectures) or model_type} with {labels} labels"
            )
    modules = _read_json(src / "modules.json") or []
    normalize = task == "embed" and any(str(m.get("type", "")).endswith(".Normalize") for m in modules)
    pooling = pooling or (_pooling(src, modules) if task == "embed" else None)
    if pooling is not None and pooling not in POOLINGS:
        raise ExportError(f"unknown pooling {pooling!r}; choose from {', '.join(POOLINGS)}")
    positions = int(config.get("max_position_embeddings", 512)) - POSITION_OFFSET.get(model_type, 0)
    max_seq = (_read_json(src / "sentence_bert_config.json") or {}).get("max_seq_length")
    max_length = min(int(max_seq), positions) if max_seq else positions
    architecture = architectures[0] if architectures else f"{model_type}Model"
    return EncoderSource(src, config, model_type, architecture, task, pooling, normalize, max_length)


def _read_json(path: Path, required: bool = False) -> Any:
    if not path.is_file():
        if required:
            raise ExportError(f"no {path.name} in {path.parent}: not a Hugging Face model folder")
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read {path}: {exc}") from None


def _pooling(src: Path, modules: list[dict[str, Any]]) -> str:
    """sentence-transformers' Pooling module config; a plain AutoModel folder gets mean pooling (what
    sentence-transformers itself gives a folder without one)."""
    folder = next((m.get("path") for m in modules if str(m.get("type", "")).endswith(".Pooling")), "1_Pooling")
    config = _read_json(src / str(folder) / "config.json")
    if config is None:
        return "mean"
    modes = {
        "mean": config.get("pooling_mode_mean_tokens"),
        "cls": config.get("pooling_mode_cls_token"),
        "last": config.get("pooling_mode_lasttoken"),
    }
    other = [k for k, v in config.items() if k.startswith("pooling_mode_") and v and k[13:] not in _MODE_KEYS]
    chosen = [k for k, v in modes.items() if v]
    if other or len(chosen) != 1:
        raise ExportError(
            f"{src}: pooling {', '.join(chosen + other) or 'none'} is not supported; one of {', '.join(POOLINGS)}"
        )
    return chosen[0]


_MODE_KEYS = ("mean_tokens", "cls_token", "lasttoken")


def export_encoder(
    src: Path,
    out: Path,
    backend: str,
    weight_format: str,
    *,
    name: str | None = None,
    task: str | None = None,
    pooling: str | None = None,
    force: bool = False,
    verbose: bool = False,
) -> Manifest:
    """Exports the encoder in `src` to `out` (staged beside it, renamed into place, manifest written last)."""
    if backend not in ("openvino", "onnx"):
        raise ExportError(f"unknown backend {backend!r}; choose from openvino, onnx")
    if weight_format not in WEIGHT_FORMATS:
        raise ExportError(f"encoders export as {', '.join(WEIGHT_FORMATS)}, not {weight_format!r}")
    src, out = Path(src).expanduser().absolute(), Path(out).expanduser().absolute()
    source = inspect_encoder(src, task, pooling)
    check_destination(src, out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    with staged(out) as staging:
        return _export(source, staging, backend, weight_format, name or src.name, verbose)


def _export(source: EncoderSource, staging: Path, backend: str, weight_format: str, name: str, verbose: bool):
    backend_module = importlib.import_module(f"export.{backend}_backend")
    scratch = staging / ".convert"
    with _quiet(verbose):
        model = _load(source)
        _convert(model, scratch, backend, weight_format, TASKS[source.task])
        compression = backend_module.compress(scratch, staging, weight_format, WeightOptions())
        shutil.rmtree(scratch)
        metadata = write_metadata(source.folder, staging, source.config)
        (staging / "chat_template.jinja").unlink(missing_ok=True)
        config = source.config
        heads = int(config["num_attention_heads"])
        manifest = Manifest(
            name=name,
            backend=backend,
            weight_format=weight_format,
            model_file=backend_module.MODEL_FILE,
            architecture=source.architecture,
            model_type=source.model_type,
            num_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_kv_heads=heads,
            head_dim=int(config["hidden_size"]) // heads,
            hidden_size=int(config["hidden_size"]),
            vocab_size=int(config["vocab_size"]),
            max_context=source.max_length,
            kv_dtype="",
            stateful=False,
            inputs=_graph_inputs(staging / backend_module.MODEL_FILE, backend),
            outputs=["logits" if source.task == "rerank" else "last_hidden_state"],
            eos_token_ids=[],
            bos_token_id=None,
            pad_token_id=metadata.pad_token_id if metadata.pad_token_id is not None else 0,
            chat_template_file=None,
            source=str(source.folder),
            weight_compression=compression,
            task=source.task,
            pooling=source.pooling,
            normalize=source.normalize,
            max_length=source.max_length,
            dimensions=int(config["hidden_size"]) if source.task == "embed" else 1,
        )
        manifest.save(staging)
        _verify(model, staging, manifest)
    del model
    gc.collect()
    return manifest


def _load(source: EncoderSource) -> Any:
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification

    cls = AutoModelForSequenceClassification if source.task == "rerank" else AutoModel
    try:
        model = cls.from_pretrained(source.folder, dtype=torch.float32, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot load {source.folder} with transformers: {str(exc).splitlines()[0]}") from None
    return model.eval()


def _convert(model: Any, scratch: Path, backend: str, weight_format: str, task: str) -> None:
    """The fp32 graph (OpenVINO fp16: the converter's own f16 weights), which `compress` then rewrites."""
    if backend == "openvino":
        from optimum.exporters.openvino import export_from_model
        from optimum.intel import OVConfig

        from export.openvino_backend import _decline_telemetry

        _decline_telemetry()
        dtype = "fp16" if weight_format == "fp16" else "fp32"
        export_from_model(model, scratch, task=task, ov_config=OVConfig(dtype=dtype), stateful=False)
    else:
        from optimum.exporters.onnx import onnx_export_from_model

        onnx_export_from_model(model, scratch, task=task, do_validation=False)


def _graph_inputs(path: Path, backend: str) -> list[str]:
    if backend == "openvino":
        import openvino as ov

        return [i.get_any_name() for i in ov.Core().read_model(path).inputs]
    import onnx

    return [i.name for i in onnx.load(str(path), load_external_data=False).graph.input]


def _verify(model: Any, staging: Path, manifest: Manifest) -> None:
    """The runtime's Encoder on the staged export against transformers on a padded batch, f32 compute."""
    import torch

    from appliance.runtime.encoder import Encoder

    encoder = Encoder(staging, precision="f32")
    if manifest.task == "embed":
        batch = [encoder.truncate(ids) for ids in encoder.tokenize(PROBE_TEXTS)]
        got = encoder.embed(batch)
        with torch.no_grad():
            want = torch_reference(model, batch, manifest)
        cosine = float(np.min(np.sum(got * want, 1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))))
        if not np.isfinite(got).all() or cosine < MIN_COSINE[manifest.weight_format]:
            raise ExportError(
                f"the exported {manifest.weight_format} embeddings differ from transformers (min cosine {cosine:.6f})"
            )
    else:
        pairs = encoder.tokenize_pairs(PROBE_TEXTS[0], PROBE_TEXTS)
        got = encoder.score(pairs)
        with torch.no_grad():
            want = torch_reference(model, pairs, manifest)
        error = float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-6))
        if not np.isfinite(got).all() or error > MAX_SCORE_ERROR[manifest.weight_format]:
            raise ExportError(f"the exported {manifest.weight_format} scores differ from transformers by {error:.3g}")


def torch_reference(model: Any, batch: Any, manifest: Manifest) -> np.ndarray:
    """What sentence-transformers computes, by hand in torch: the transformer on the padded batch, then its Pooling
    (mean over the mask, CLS or last token) and Normalize; for a cross-encoder, the first logit. `batch`: token id
    lists (embed) or (ids, token_type_ids) pairs (rerank). The same arithmetic as sentence-transformers' modules
    (clamp 1e-9 on the count, F.normalize's eps), so it stands in for it without the package."""
    import torch

    rows = [list(b[0]) if manifest.task == "rerank" else list(b) for b in batch]
    longest = max(len(r) for r in rows)
    pad = manifest.pad_token_id or 0
    ids = torch.full((len(rows), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    types = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
        if manifest.task == "rerank":
            types[i, : len(row)] = torch.tensor(list(batch[i][1]))
    kwargs = {"token_type_ids": types} if "token_type_ids" in manifest.inputs else {}
    out = model(input_ids=ids, attention_mask=mask, **kwargs)
    if manifest.task == "rerank":
        return out.logits[:, 0].float().numpy()
    hidden = out.last_hidden_state.float()
    if manifest.pooling == "cls":
        vectors = hidden[:, 0]
    elif manifest.pooling == "last":
        vectors = hidden[torch.arange(len(rows)), mask.sum(1) - 1]
    else:
        weights = mask.unsqueeze(-1).float()
        vectors = (hidden * weights).sum(1) / torch.clamp(weights.sum(1), min=1e-9)
    if manifest.normalize:
        vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
    return vectors.numpy()
