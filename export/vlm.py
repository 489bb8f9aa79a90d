"""Export a local Hugging Face vision-language model (VLM) folder to OpenVINO IR parts plus the appliance manifest.

optimum-intel splits a VLM the way openvino_genai's VLMPipeline reads it, and we keep its split (`PARTS`):
- openvino_language_model.xml: the decoder, stateful (KV cache as graph state) like a text export, taking
  `inputs_embeds` (not input_ids), attention_mask, position_ids ([3, batch, length] for M-RoPE) and beam_idx;
- openvino_text_embeddings_model.xml: token ids -> embeddings (`input` -> `inputs_embeds`);
- openvino_vision_embeddings_model.xml: pixels -> image features. Qwen2-VL: flattened patches [patches, 3 * t * p * p]
  -> patch embeddings; Idefics3: pixel_values [tiles, 3, H, W], patch_attention_mask, patch_position_ids -> the
  projected features [tiles, tokens_per_tile, hidden];
- openvino_vision_embeddings_merger_model.xml (Qwen2-VL only): the vision transformer and 2x2 merger: hidden_states,
  attention_mask [1, n, n] (0 within an image, -inf across), rotary_pos_emb -> one row per image token;
- openvino_tokenizer.xml / openvino_detokenizer.xml: only for openvino_genai (the runtime reads tokenizer.json).
The manifest's LLM fields describe the language model; `vision` (appliance/manifest.py Vision) is the image-token
scheme and preprocessing, read from config.json and preprocessor_config.json, so the runtime needs neither
transformers nor the processor. Weight formats: fp32/fp16 for every part; int8/int4 compress the language model as a
text export does (NNCF weight-only), the smaller parts keep fp16 weights. Verified as a text export is: the same
probe's logits (text only, through the text embeddings and the language model) against transformers within the
weight format's tolerance; the image path is checked by the tests.
"""

from __future__ import annotations

import contextlib
import gc
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from appliance.manifest import Manifest, Vision
from export.exporter import _check_weight_options, _compare, _probe_ids, _Progress, _quiet, staged
from export.graph import WeightOptions
from export.metadata import llm_manifest, write_metadata
from export.source import ExportError, Source, check_destination, check_disk

__all__ = ["PARTS", "VLM_TYPES", "export_vlm", "is_vlm"]

VLM_TYPES = frozenset({"qwen2_vl", "idefics3"})  # verified against transformers by tests/export/test_vlm.py
LANGUAGE_MODEL = "openvino_language_model.xml"
PARTS = {  # manifest role -> optimum-intel's file name
    "text_embeddings": "openvino_text_embeddings_model.xml",
    "vision_embeddings": "openvino_vision_embeddings_model.xml",
    "vision_merger": "openvino_vision_embeddings_merger_model.xml",
}
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
TASK = "image-text-to-text"
GENAI_TOKENIZER, GENAI_DETOKENIZER = "openvino_tokenizer.xml", "openvino_detokenizer.xml"  # for openvino_genai


def is_vlm(src: Path) -> bool:
    try:
        return json.loads((src / "config.json").read_text()).get("model_type") in VLM_TYPES
    except (OSError, ValueError):
        return False


def export_vlm(
    src: Path,
    out: Path,
    backend: str,
    weight_format: str,
    *,
    name: str | None = None,
    weights: WeightOptions | None = None,
    force: bool = False,
    verbose: bool = False,
) -> Manifest:
    """Exports the VLM in `src` to `out` (OpenVINO only: the parts are optimum-intel's) and returns the manifest."""
    if backend != "openvino":
        raise ExportError("vision-language models export to the openvino backend only")
    weights = weights or WeightOptions()
    _check_weight_options(backend, weight_format, weights)
    src, out = Path(src).expanduser().absolute(), Path(out).expanduser().absolute()
    source = _inspect(src)
    check_destination(src, out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    check_disk(source, out)
    with staged(out) as staging, _Progress(f"export vlm {weight_format}") as progress:
        return _export(source, staging, weight_format, name or src.resolve().name, weights, progress, verbose)


def _inspect(src: Path) -> Source:
    if not (src / "config.json").is_file():
        raise ExportError(f"no config.json in {src}: not a Hugging Face model folder")
    config = json.loads((src / "config.json").read_text())
    model_type = str(config.get("model_type", ""))
    if model_type not in VLM_TYPES:
        raise ExportError(f"unsupported vision-language model type {model_type or '?'}; supported: {sorted(VLM_TYPES)}")
    if not (src / PROCESSOR_FILES[0]).is_file():
        raise ExportError(f"no {PROCESSOR_FILES[0]} in {src}: the image preprocessing is unknown")
    return Source(folder=src, config=config, model_type=model_type, architecture="")  # known once loaded


def _export(
    source: Source,
    staging: Path,
    weight_format: str,
    name: str,
    weights: WeightOptions,
    progress: _Progress,
    verbose: bool,
) -> Manifest:
    import openvino as ov
    from optimum.exporters.openvino import export_from_model
    from optimum.intel import OVConfig

    from export import ir, openvino_backend

    scratch = staging / ".convert"
    progress.stage("load")
    with _quiet(verbose):
        model = _load(source.folder)
        architecture = type(model).__name__  # config.json may lack `architectures` (a model saved from its config)
        probe = _probe_ids(int(_text_config(source.config)["vocab_size"]))
        reference = _text_logits(model, probe)
        progress.stage("convert")
        openvino_backend._decline_telemetry()
        dtype = "fp16" if weight_format == "fp16" else "fp32"
        with _no_trace_check():
            export_from_model(model, scratch, task=TASK, ov_config=OVConfig(dtype=dtype), stateful=True)
        del model
        gc.collect()
        progress.stage("compress")
        compression = openvino_backend.compress(scratch, staging, weight_format, weights, LANGUAGE_MODEL)
        parts, inputs = {}, {}
        for role, file in PARTS.items():
            if (scratch / file).is_file():
                part = ov.Core().read_model(scratch / file)
                ov.save_model(part, staging / file, compress_to_fp16=weight_format in ("int8", "int4"))
                parts[role], inputs[role] = file, [i.get_any_name() for i in part.inputs]
        shutil.rmtree(scratch)
        if weight_format in ("int8", "int4"):
            compression = {**compression, "vision and text embeddings": "fp16 weights"}
        progress.stage("save tokenizer")
        text = _text_config(source.config)
        metadata = write_metadata(source.folder, staging, {**text, **source.config})
        for file in PROCESSOR_FILES:
            if (source.folder / file).is_file():
                shutil.copyfile(source.folder / file, staging / file)
        genai_tokenizers(source.folder, staging, metadata.chat_template_file)
        progress.stage("verify")
        language_model = ov.Core().read_model(staging / LANGUAGE_MODEL)
        graph, dims = ir.verify(language_model, text)
        _compare(_first_step(staging, parts["text_embeddings"], probe, source.model_type), reference, weight_format)
    manifest = llm_manifest(
        graph,
        dims,
        metadata,
        name=name,
        backend="openvino",
        weight_format=weight_format,
        model_file=LANGUAGE_MODEL,
        architecture=architecture,
        model_type=source.model_type,
        source=str(source.folder),
        weight_compression=compression,
    )
    manifest.vision = image_scheme(source.folder, source.config, parts, inputs)
    manifest.save(staging)
    return manifest


@contextlib.contextmanager
def _no_trace_check() -> Iterator[None]:
    """Converts without torch.jit.trace's check_trace, which traces each part a second time and runs both traces to
    compare them. On Qwen2-VL's vision transformer (every layer's attention over optimum's 900-patch dummy image)
    that check held ~0.4 GiB more per vision layer (3.1 GiB for 8 layers, measured) and took most of the
    conversion's time: the 2B int4 export peaked at 19.5 GiB RSS with 15 of its 17.4 min in conversion; without
    it, 12.8 GiB and 3.4 min. The traced graph is the one returned either way (the check only compares), and the
    export still verifies itself: the text probe's logits here, the image path in tests/export/test_vlm.py.
    optimum-intel skips the check the same way for the model types it lists."""
    from optimum.exporters.openvino import convert

    allowed = convert.allow_skip_tracing_check
    convert.allow_skip_tracing_check = lambda library_name, model_type: True
    try:
        yield
    finally:
        convert.allow_skip_tracing_check = allowed


def genai_tokenizers(src: Path, dest: Path, chat_template_file: str | None) -> None:
    """openvino_tokenizer.xml and openvino_detokenizer.xml (openvino_tokenizers' conversion of the source's
    tokenizer, the chat template in their rt_info): openvino_genai's VLMPipeline will not load a folder without them,
    and it is what the benchmark compares us with on the same export. The appliance itself reads tokenizer.json."""
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src, local_files_only=True)
    if chat_template_file is not None:  # Idefics3 ships its template with the processor, not the tokenizer
        tokenizer.chat_template = (dest / chat_template_file).read_text()
    encoder, decoder = convert_tokenizer(tokenizer, with_detokenizer=True)
    ov.save_model(encoder, dest / GENAI_TOKENIZER)
    ov.save_model(decoder, dest / GENAI_DETOKENIZER)


def _load(folder: Path) -> Any:
    import torch
    from transformers import AutoModelForImageTextToText

    try:
        model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot load {folder} with transformers: {str(exc).splitlines()[0]}") from None
    return model.eval()


def _text_logits(model: Any, input_ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(input_ids=torch.from_numpy(input_ids)).logits.float().numpy()


def _first_step(dest: Path, text_embeddings: str, input_ids: np.ndarray, model_type: str) -> np.ndarray:
    """Logits of a text-only first step through the exported text embeddings and language model, in f32: the same
    probe as a text export's (export/exporter.py); the image path is checked by tests/export/test_vlm.py."""
    import openvino as ov

    from export.openvino_backend import F32_COMPUTE

    core, length = ov.Core(), input_ids.shape[1]
    embeddings = core.compile_model(dest / text_embeddings, "CPU", F32_COMPUTE)
    positions = np.arange(length, dtype=np.int64)[None]
    feed = {
        "inputs_embeds": embeddings({"input": input_ids})[0],
        "attention_mask": np.ones_like(input_ids),
        "position_ids": np.tile(positions, (3, 1, 1)) if model_type == "qwen2_vl" else positions,  # M-RoPE: t=h=w
        "beam_idx": np.zeros(len(input_ids), np.int32),
    }
    language_model = core.compile_model(dest / LANGUAGE_MODEL, "CPU", F32_COMPUTE)
    return np.array(language_model.create_infer_request().infer(feed)["logits"])


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: nested as text_config (Qwen2-VL also repeats it at the top level)."""
    return {**config, **(config.get("text_config") or {})}


def image_scheme(folder: Path, config: dict[str, Any], parts: dict[str, str], inputs: dict[str, list[str]]) -> Vision:
    """The manifest's `vision` record from the source's config.json, preprocessor_config.json and (Idefics3)
    processor_config.json."""
    pre = json.loads((folder / PROCESSOR_FILES[0]).read_text())
    common = dict(
        scheme=config["model_type"],
        parts=parts,
        part_inputs=inputs,
        image_token_id=int(config["image_token_id"]),
        image_mean=[float(x) for x in pre["image_mean"]],
        image_std=[float(x) for x in pre["image_std"]],
        rescale_factor=float(pre.get("rescale_factor", 1 / 255)),
        resample=int(pre.get("resample", 3)),
    )
    vision = config["vision_config"]
    if config["model_type"] == "qwen2_vl":
        rope = _text_config(config).get("rope_scaling") or {}
        return Vision(
            **common,
            patch_size=int(pre.get("patch_size", vision["patch_size"])),
            merge_size=int(pre.get("merge_size", vision["spatial_merge_size"])),
            temporal_patch_size=int(pre.get("temporal_patch_size", vision["temporal_patch_size"])),
            min_pixels=int(pre.get("min_pixels") or pre["size"]["shortest_edge"]),
            max_pixels=int(pre.get("max_pixels") or pre["size"]["longest_edge"]),
            image_start_token_id=int(config["vision_start_token_id"]),
            image_end_token_id=int(config["vision_end_token_id"]),
            mrope_section=list(rope["mrope_section"]),
            rotary_dim=int(vision["embed_dim"]) // int(vision["num_heads"]) // 2,
        )
    processor_file = folder / PROCESSOR_FILES[1]
    processor = json.loads(processor_file.read_text()) if processor_file.is_file() else {}
    tile, patch, scale = int(vision["image_size"]), int(vision["patch_size"]), int(config.get("scale_factor", 2))
    tokens = (tile // patch // scale) ** 2
    if processor.get("image_seq_len", tokens) != tokens:
        raise ExportError(f"processor_config.json's image_seq_len {processor['image_seq_len']} is not {tokens}")
    return Vision(
        **common,
        patch_size=patch,
        merge_size=scale,
        tile_size=int(pre.get("max_image_size", {}).get("longest_edge", tile)),
        resize_longest_edge=int(pre["size"]["longest_edge"]),
        image_splitting=bool(pre.get("do_image_splitting", False)),
        tokens_per_tile=tokens,
        image_wrap_token="<fake_token_around_image>",
        global_image_token="<global-img>",
    )
