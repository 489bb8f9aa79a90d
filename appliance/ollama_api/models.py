"""What Ollama's model endpoints say of a served model (/api/tags, /api/show, /api/ps), best-effort from its export
manifest (appliance/manifest.py) and the engine's status; no weights are read.

`digest` is the SHA-256 of the manifest file: stable while the export is, new when it is re-exported. `size` is the
export directory's file sizes summed (one level: an export is flat). Names: Ollama clients send `name:tag`; a
served model `name` answers to `name` and `name:latest`, and is listed as `name:latest` (its own name if it has a
tag already).
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path

from appliance.manifest import MANIFEST_NAME, Manifest
from appliance.paths import pulled_model
from appliance.protocol import EngineStatus, ModelInfo
from appliance.settings import ServeSettings

FOREVER = "9999-12-31T23:59:59Z"  # expires_at of a model kept loaded (keep_alive negative)
QUANTIZATION = {"int4": "Q4_0", "int8": "Q8_0", "fp16": "F16", "fp32": "F32", "bf16": "BF16"}


def tagged(name: str) -> str:
    return name if ":" in name else f"{name}:latest"


def untagged(name: str) -> str:
    return name[: -len(":latest")] if name.endswith(":latest") else name


def _rfc3339(seconds: float) -> str:
    """A Unix time as RFC 3339; FOREVER for one no date can show (keep_alive.py bounds what reaches here, this
    keeps /api/ps answering whatever does)."""
    try:
        return datetime.fromtimestamp(seconds, timezone.utc).isoformat().replace("+00:00", "Z")
    except (OverflowError, ValueError, OSError):
        return FOREVER


def model_dir(settings: ServeSettings, name: str) -> Path | None:
    for spec in settings.models:
        if spec.name == name:
            return Path(spec.model_dir)
    if name == settings.served_model_name and settings.model_dir:
        return Path(settings.model_dir)
    return pulled_model(name)  # added by /api/pull since this worker read the settings


def _manifest(directory: Path | None) -> Manifest | None:
    if directory is None:
        return None
    try:
        return Manifest.load(directory)
    except (OSError, ValueError, TypeError):
        return None


def _size(directory: Path | None) -> int:
    if directory is None:
        return 0
    try:
        return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
    except OSError:
        return 0


def _digest(directory: Path | None) -> str:
    try:
        return hashlib.sha256((directory / MANIFEST_NAME).read_bytes()).hexdigest() if directory else ""
    except OSError:
        return ""


def _parameter_size(m: Manifest) -> str:
    """Llama-style parameter count from the shapes: embeddings + per layer attention and MLP (an estimate)."""
    h, layers = m.hidden_size, m.num_layers
    kv = m.num_kv_heads * m.head_dim
    attention = h * (m.num_attention_heads * m.head_dim) * 2 + h * kv * 2
    mlp = 3 * h * (8 * h // 3)  # the usual SwiGLU width; the manifest does not record it
    total = m.vocab_size * h + layers * (attention + mlp)
    return f"{total / 1e9:.1f}B" if total >= 1e9 else f"{total / 1e6:.0f}M"


def details(m: Manifest | None) -> dict:
    if m is None:
        return {
            "parent_model": "",
            "format": "",
            "family": "",
            "families": None,
            "parameter_size": "",
            "quantization_level": "",
        }
    return {
        "parent_model": "",
        "format": m.backend,
        "family": m.model_type,
        "families": [m.model_type],
        "parameter_size": _parameter_size(m),
        "quantization_level": QUANTIZATION.get(m.weight_format, m.weight_format.upper()),
    }


def tag_entry(settings: ServeSettings, info: ModelInfo) -> dict:
    directory = model_dir(settings, info.name)
    return {
        "name": tagged(info.name),
        "model": tagged(info.name),
        "modified_at": _rfc3339(info.created),
        "size": _size(directory),
        "digest": _digest(directory),
        "details": details(_manifest(directory)),
    }


def ps_entry(settings: ServeSettings, info: ModelInfo, status: EngineStatus) -> dict:
    """A loaded model: `size` the memory it takes (residency.estimate: weights + KV pool), `expires_at` when its
    keep_alive unloads it if it stays idle (far away: kept loaded)."""
    entry = tag_entry(settings, info)
    del entry["modified_at"]
    return {
        **entry,
        "size": info.size or entry["size"],
        "expires_at": _rfc3339(info.expires_at) if info.expires_at is not None else FOREVER,
        "size_vram": 0,  # CPU: nothing in a GPU's memory (a GPU device's share is not measured)
        "context_length": status.max_context,
    }


def show_body(settings: ServeSettings, info: ModelInfo, status: EngineStatus) -> dict:
    directory = model_dir(settings, info.name)
    m = _manifest(directory)
    template = ""
    if m is not None and m.chat_template_file and directory is not None:
        try:
            template = (directory / m.chat_template_file).read_text()
        except OSError:
            template = ""
    defaults = status.generation_defaults or {}
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "repetition_penalty": "repeat_penalty"}
    parameters = "\n".join(
        f"{ours:<16}{defaults[theirs]}" for theirs, ours in names.items() if defaults.get(theirs) is not None
    )
    model_info: dict = {}
    capabilities = ["completion"]
    if status.tool_parser:
        capabilities.append("tools")
    if status.reasoning_parser == "think":
        capabilities.append("thinking")
    if m is not None:
        arch = m.model_type
        model_info = {
            "general.architecture": arch,
            "general.basename": m.name,
            f"{arch}.context_length": m.max_context,
            f"{arch}.embedding_length": m.hidden_size,
            f"{arch}.block_count": m.num_layers,
            f"{arch}.attention.head_count": m.num_attention_heads,
            f"{arch}.attention.head_count_kv": m.num_kv_heads,
            "tokenizer.ggml.model": "bpe",
            "general.source": m.source,
            "general.weight_compression": json.dumps(m.weight_compression, sort_keys=True),
        }
    return {
        "modelfile": f"# Served by the appliance (an OpenVINO / ONNX export, not a GGUF)\nFROM {info.name}\n",
        "parameters": parameters,
        "template": template,
        "details": details(m),
        "model_info": model_info,
        "capabilities": capabilities,
        "modified_at": _rfc3339(info.created),
    }
