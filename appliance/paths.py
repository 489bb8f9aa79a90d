"""Where models live. The runtime resolves `--model default` here without importing the export tools."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_SLUG = "smollm2-135m-instruct"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def data_dir() -> Path:
    return Path(os.environ.get("APPLIANCE_DATA_DIR", Path.home() / ".cache" / "appliance")).expanduser()


def compile_cache_dir() -> Path:
    """`appliance serve`'s default OpenVINO compile cache (EngineConfig.cache_dir, --cache-dir auto)."""
    return data_dir() / "cache" / "openvino"


def default_model_root() -> Path:
    """Holds `hf/` (the HF folder built from the GGUF) and one folder per export, e.g. `openvino-fp16/`."""
    return data_dir() / "models" / DEFAULT_MODEL_SLUG


def default_export_dir(backend: str = "openvino", weight_format: str = "fp16") -> Path:
    return default_model_root() / f"{backend}-{weight_format}"


def resolve_model(model: str) -> Path:
    """`default` -> the default model's served export; anything else is a path."""
    return default_export_dir() if model == "default" else Path(model).expanduser()
