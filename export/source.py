"""Checks on the source folder and the destination, done from config.json alone before anything heavy loads.

A bad source or a full disk should fail in a second with one clear line, not after minutes of conversion.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# model_types verified on both backends with a tiny random model (tests/export/test_export.py): logits match
# transformers over two steps and the OpenVINO IR survives paged_attention_transformation. Left out on purpose:
# mixtral, starcoder2 (optimum-onnx cannot export them); gemma2, gemma3_text (per-layer sliding windows, untested
# in the runtime); qwen3_moe (optimum-intel's export fails); falcon, gpt_bigcode (multi-query KV that does not
# follow num_key_value_heads, which the exporter's KV-shape check rejects).
SUPPORTED = frozenset(
    {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "phi3",
        "gpt2",
        "gemma",
        "granite",
        "olmo2",
        "smollm3",
        "stablelm",
        "phi",
        "gpt_neox",
    }
)
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
BYTES_PER_PARAM = {"float32": 4, "float16": 2, "bfloat16": 2}
# Peak disk use: the fp32 graph written by the converter plus the final (<= fp32) copy, both beside OUT.
DISK_FACTOR = 2.0
DISK_MARGIN = 256 << 20


class ExportError(Exception):
    """A problem the user can fix; the CLI prints its message as one line, without a traceback."""


@dataclass(frozen=True)
class Dims:
    """The model geometry the runtime sizes its KV cache from: the exporter reads it from the transformers config
    it loads, a pulled OpenVINO IR (export/ir.py) from config.json (`from_config`)."""

    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_context: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Dims:
        """config.json's geometry, by its families' key names (gpt2's n_layer, n_head, n_embd, n_positions)."""

        def first(*keys: str) -> Any:
            return next((config[k] for k in keys if config.get(k) is not None), None)

        values = {
            "num_layers": first("num_hidden_layers", "n_layer", "num_layers"),
            "num_attention_heads": first("num_attention_heads", "n_head"),
            "hidden_size": first("hidden_size", "n_embd", "d_model"),
            "vocab_size": first("vocab_size"),
            "max_context": first("max_position_embeddings", "n_positions", "max_sequence_length"),
        }
        missing = [k for k, v in values.items() if not isinstance(v, int)]
        if missing:
            raise ExportError(f"config.json does not give the model's {', '.join(missing)}")
        heads = values["num_attention_heads"]
        return cls(
            **values,
            num_kv_heads=first("num_key_value_heads", "num_kv_heads") or heads,
            head_dim=first("head_dim") or values["hidden_size"] // heads,
        )


@dataclass(frozen=True)
class Source:
    folder: Path
    config: dict[str, Any]
    model_type: str
    architecture: str


def inspect_source(src: Path) -> Source:
    """Raises ExportError unless `src` is a local HF causal-LM folder of a supported family."""
    if not src.is_dir():
        raise ExportError(f"source folder not found: {src}")
    config_path = src / "config.json"
    if not config_path.is_file():
        raise ExportError(f"no config.json in {src}: not a Hugging Face model folder")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read {config_path}: {exc}") from None
    model_type = str(config.get("model_type", ""))
    architectures = [str(a) for a in config.get("architectures") or []]
    causal = [a for a in architectures if a.endswith(CAUSAL_LM_SUFFIXES)]
    if architectures and not causal:
        raise ExportError(
            f"{src} is not a causal language model "
            f"(architectures: {', '.join(architectures)}; model_type: {model_type or '?'})"
        )
    architecture = causal[0] if causal else f"{model_type}ForCausalLM"
    if model_type not in SUPPORTED:
        raise ExportError(
            f"unsupported architecture {architecture} (model_type {model_type or '?'}); "
            f"supported model types: {', '.join(sorted(SUPPORTED))}"
        )
    return Source(folder=src, config=config, model_type=model_type, architecture=architecture)


def output_in_use(out: Path) -> bool:
    """An empty directory counts as free: callers that stage exports hand us a fresh mkdtemp."""
    return out.exists() and not (out.is_dir() and not any(out.iterdir()))


def check_destination(src: Path, out: Path, force: bool) -> None:
    """--force replaces OUT wholesale, so OUT must not be the source or contain it."""
    if out.resolve() == src.resolve() or out.resolve() in src.resolve().parents:
        raise ExportError(f"output {out} would replace the source folder {src}")
    if output_in_use(out) and not force:
        raise ExportError(f"output exists: {out} (pass --force to replace it)")


def check_disk(source: Source, out: Path) -> None:
    """Estimates the fp32 size from the weight files and the dtype they are stored in."""
    weights = sum(p.stat().st_size for p in source.folder.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    dtype = str(source.config.get("torch_dtype") or source.config.get("dtype") or "")
    fp32_bytes = weights * 4 / BYTES_PER_PARAM.get(dtype, 2)
    need = int(fp32_bytes * DISK_FACTOR) + DISK_MARGIN
    parent = out.parent
    free = shutil.disk_usage(parent).free
    if free < need:
        raise ExportError(
            f"not enough free disk space in {parent}: need about {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free"
        )
