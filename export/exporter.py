"""Export a local Hugging Face causal-LM folder for one backend and weight format.

The result is self-contained: model graph, tokenizer.json, chat template, generation config and the appliance
manifest, so the runtime serves it without transformers or torch. Everything is written into a hidden staging
folder beside OUT and renamed into place at the end, and the manifest is written last: a killed export never
leaves a folder that looks complete.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from appliance.manifest import Manifest
from export.graph import ExportBackend, WeightOptions
from export.metadata import llm_manifest, write_metadata
from export.source import Dims, ExportError, Source, check_destination, check_disk, inspect_source

__all__ = ["BACKENDS", "WEIGHT_FORMATS", "ExportError", "export_model"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # an export never downloads; from_pretrained also gets local_files_only

BACKENDS = {"openvino": "export.openvino_backend", "onnx": "export.onnx_backend"}  # imported when used (heavy)
if TYPE_CHECKING:  # both modules implement ExportBackend: mypy checks it here
    from export import onnx_backend, openvino_backend

    _IMPLEMENTATIONS: tuple[ExportBackend, ...] = (openvino_backend, onnx_backend)
WEIGHT_FORMATS = ("fp32", "fp16", "int8", "int4")
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")  # config.json's decoder layer count, by family
STAGES = ("load", "convert", "compress", "save tokenizer", "verify")
# Largest allowed max|exported - transformers fp32| over max|transformers| on the probe; None: finite is enough,
# since integer weights legitimately move logits and a random tiny model has no accuracy to keep.
TOLERANCE: dict[str, float | None] = {"fp32": 1e-3, "fp16": 0.1, "int8": None, "int4": None}
PROBE_LENGTH = 8
# "": the root logger. CRITICAL, not ERROR: OpenVINO's PyTorch frontend logs harmless fallbacks as errors.
QUIET_LOGGERS = ("transformers", "optimum", "nncf", "openvino", "onnxruntime", "torch", "")


def export_model(
    src: Path,
    out: Path,
    backend: str,
    weight_format: str,
    *,
    name: str | None = None,
    weights: WeightOptions | None = None,
    num_layers: int | None = None,
    force: bool = False,
    verbose: bool = False,
) -> Manifest:
    """Exports `src` to `out` and returns the manifest written there. Raises ExportError for anything the user
    can fix. `weights` says how int8/int4 weights are made (export/graph.py WeightOptions: the OpenVINO int4 group
    size, default 128, or the ONNX int4/int8 block size, default 32; NNCF's other knobs). `num_layers` keeps only
    the first N decoder layers (embeddings, final norm and LM head kept): a truncated copy, e.g. a draft model for
    speculative decoding with the source's tokenizer."""
    if backend not in BACKENDS:
        raise ExportError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    if weight_format not in WEIGHT_FORMATS:
        raise ExportError(f"unknown weight format {weight_format!r}; choose from {', '.join(WEIGHT_FORMATS)}")
    weights = weights or WeightOptions()
    _check_weight_options(backend, weight_format, weights)
    src, out = Path(src).expanduser().absolute(), Path(out).expanduser().absolute()
    source = inspect_source(src)
    if num_layers is not None:
        total = _num_layers(source.config)
        if not 1 <= num_layers <= total:
            raise ExportError(f"--num-layers must be between 1 and the model's {total} layers, got {num_layers}")
    check_destination(src, out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    check_disk(source, out)
    with staged(out) as staging, _Progress(f"export {backend} {weight_format}") as progress:
        return _export(
            source, staging, backend, weight_format, name or src.resolve().name, weights, num_layers, progress, verbose
        )


def _check_weight_options(backend: str, weight_format: str, weights: WeightOptions) -> None:
    size = weights.group_size
    if size is not None and not (size == -1 and backend == "openvino") and (size < 16 or size & (size - 1)):
        raise ExportError(f"group size must be a power of two >= 16 (or -1: per channel, OpenVINO), got {size}")
    if not 0 < weights.ratio <= 1:
        raise ExportError(f"ratio must be in (0, 1], got {weights.ratio}")
    if weights.lm_head not in ("int8", "int4"):
        raise ExportError(f"lm_head must be int8 or int4, got {weights.lm_head!r}")
    nncf_only = weights.sym or weights.ratio != 1 or weights.lm_head != "int8" or weights.requantize
    if nncf_only and not (backend == "openvino" and weight_format in ("int4", "int8")):
        raise ExportError("--sym, --ratio, --lm-head and --requantize apply to OpenVINO int8/int4 exports only")
    if weight_format == "int8" and (weights.ratio != 1 or weights.lm_head != "int8"):
        raise ExportError("--ratio and --lm-head apply to int4 exports only")


def _export(
    source: Source,
    staging: Path,
    backend: str,
    weight_format: str,
    name: str,
    weights: WeightOptions,
    num_layers: int | None,
    progress: _Progress,
    verbose: bool,
) -> Manifest:
    scratch = staging / ".convert"
    progress.stage("load")
    # Before _quiet: transformers, optimum and nncf set their loggers' levels when first imported.
    backend_module = cast(ExportBackend, importlib.import_module(BACKENDS[backend]))
    with _quiet(verbose):
        model, dims = _load(source.folder, num_layers)
        probe = _probe_ids(dims.vocab_size)
        reference = _logits(model, probe)
        progress.stage("convert")
        backend_module.convert(model, scratch, weight_format)
        del model
        gc.collect()
        progress.stage("compress")
        compression = backend_module.compress(scratch, staging, weight_format, weights)
        shutil.rmtree(scratch)
        progress.stage("save tokenizer")
        metadata = write_metadata(source.folder, staging, source.config)
        if num_layers is not None:
            compression = {**compression, "layers": f"the first {num_layers} of {_num_layers(source.config)}"}
            _truncate_config(staging / "config.json", num_layers)
        progress.stage("verify")
        graph = backend_module.describe(staging)
        graph.check_geometry(dims)
        backend_module.check(staging)
        _compare(backend_module.first_step(staging, probe), reference, weight_format)
    manifest = llm_manifest(
        graph,
        dims,
        metadata,
        name=name,
        backend=backend,
        weight_format=weight_format,
        model_file=backend_module.MODEL_FILE,
        architecture=source.architecture,
        model_type=source.model_type,
        source=str(source.folder),
        weight_compression=compression,
    )
    manifest.save(staging)
    return manifest


def _num_layers(config: dict[str, Any]) -> int:
    return int(next(config[k] for k in LAYER_KEYS if k in config))


def _truncate_config(path: Path, num_layers: int) -> None:
    """The exported config.json says what the graph has (openvino_genai and transformers read it)."""
    if path.is_file():
        config = json.loads(path.read_text())
        config.update({k: num_layers for k in LAYER_KEYS if k in config})
        if isinstance(config.get("layer_types"), list):
            config["layer_types"] = config["layer_types"][:num_layers]
        path.write_text(json.dumps(config, indent=2) + "\n")


def _load(folder: Path, num_layers: int | None = None) -> tuple[Any, Dims]:
    """Always fp32, whatever the checkpoint's dtype: the converters trace it, and fp16/int formats are derived
    from the fp32 graph, so bf16 checkpoints never leak bf16 into the graph. `num_layers`: build the model with
    that many layers; from_pretrained then loads the first ones' weights (layer i is named by its index) and
    leaves the rest of the checkpoint unread."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs: dict[str, Any] = {}
    try:
        if num_layers is not None:
            config = AutoConfig.from_pretrained(folder, local_files_only=True)
            config.num_hidden_layers = num_layers  # every family maps it (gpt2's n_layer, ...)
            if isinstance(getattr(config, "layer_types", None), list):
                config.layer_types = config.layer_types[:num_layers]
            kwargs["config"] = config
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True, **kwargs)
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot load {folder} with transformers: {str(exc).splitlines()[0]}") from None
    model.eval()
    config = model.config
    heads = config.num_attention_heads
    dims = Dims(
        num_layers=config.num_hidden_layers,
        num_attention_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        max_context=config.max_position_embeddings,
    )
    return model, dims


def _probe_ids(vocab_size: int) -> np.ndarray:
    """A fixed token sequence spread over the vocabulary: any valid ids exercise the whole graph."""
    return (np.arange(1, PROBE_LENGTH + 1, dtype=np.int64) * 7919 % vocab_size)[None, :]


def _logits(model: Any, input_ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(input_ids)).logits.float().numpy()


def _compare(logits: np.ndarray, reference: np.ndarray, weight_format: str) -> None:
    if logits.shape != reference.shape or not np.isfinite(logits).all():
        raise ExportError(
            f"the exported graph's logits are broken (shape {logits.shape}, finite: "
            f"{bool(np.isfinite(logits).all())}); expected shape {reference.shape}"
        )
    tolerance = TOLERANCE[weight_format]
    diff, scale = float(np.abs(logits - reference).max()), float(np.abs(reference).max())
    if tolerance is not None and diff > tolerance * scale:
        raise ExportError(
            f"the exported {weight_format} logits differ from transformers by {diff:.3g} "
            f"(allowed {tolerance * scale:.3g})"
        )


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A hidden staging folder beside `out` for an export (the LLM's here, an encoder's in export/encoder.py): renamed
    into place when the block ends without an exception, deleted in any case, so a killed or failed export never
    leaves a half-written `out`."""
    staging = _staging_dir(out)
    try:
        yield staging
        _replace(out, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _staging_dir(out: Path) -> Path:
    """mkdtemp makes the folder 0700; give it the umask's mode, since the server may run as another user."""
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)
    return staging


def _replace(out: Path, staging: Path) -> None:
    """Renames are atomic on one filesystem; a replaced export (--force, or an empty placeholder) is moved aside
    first and deleted only once the new one is in place."""
    if not out.exists():
        staging.rename(out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    out.rename(old)
    staging.rename(out)
    if old.is_dir():
        shutil.rmtree(old)
    else:
        old.unlink()


@contextlib.contextmanager
def _quiet(verbose: bool) -> Iterator[None]:
    """Unless verbose, silences library warnings, logs and stdout chatter (nncf's tables and rich bars print to
    stdout); our progress goes to stderr. Logger levels rather than logging.disable, which optimum-intel resets
    mid-export. The NullHandler stops onnxruntime's import-time logging.basicConfig(INFO) adding a root handler."""
    if verbose:
        yield
        return
    loggers = [logging.getLogger(name) for name in QUIET_LOGGERS]
    levels = [logger.level for logger in loggers]
    null = logging.NullHandler()
    with warnings.catch_warnings(), open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        warnings.simplefilter("ignore")
        logging.root.addHandler(null)
        for logger in loggers:
            logger.setLevel(logging.CRITICAL)
        try:
            yield
        finally:
            logging.root.removeHandler(null)
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)


class _Progress:
    """One tqdm bar on stderr over STAGES; `stage(name)` closes the previous stage and shows the new one."""

    def __init__(self, label: str) -> None:
        from tqdm import tqdm

        self._label = label
        self._started = False
        self._bar = tqdm(
            total=len(STAGES), desc=label, file=sys.stderr, bar_format="{desc} [{n_fmt}/{total_fmt}, {elapsed}]"
        )

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self._bar.update()
        self._bar.close()

    def stage(self, name: str) -> None:
        if self._started:
            self._bar.update()
        self._started = True
        self._bar.set_description_str(f"{self._label}: {name}")
