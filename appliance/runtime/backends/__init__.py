"""Backends behind one interface: OpenVINO (paged KV on CPU/GPU, static slots for NPU) and ONNX Runtime."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from appliance.manifest import VLM_PAGED_ONLY, Manifest
from appliance.runtime.backends.base import Backend, DeviceError, StepBatch

if TYPE_CHECKING:
    from appliance.config import EngineConfig

__all__ = ["Backend", "DeviceError", "StepBatch", "load_backend"]


def load_backend(model_dir: Path, manifest: Manifest, config: EngineConfig) -> Backend:
    """Pick the implementation from the manifest's backend and the config's device / static flag. A
    vision-language model runs on the paged backend only: the static ones feed no image rows."""
    static = config.static or config.device.upper().startswith("NPU")
    if manifest.is_vlm and (static or manifest.backend != "openvino"):
        raise ValueError(VLM_PAGED_ONLY)
    if manifest.backend == "onnx":
        from appliance.runtime.backends.onnx_static import OnnxBackend

        return OnnxBackend(model_dir, manifest, config)
    if manifest.backend != "openvino":
        raise ValueError(f"unknown backend {manifest.backend!r} in manifest")
    if static:
        from appliance.runtime.backends.openvino_static import OpenVINOStaticBackend

        return OpenVINOStaticBackend(model_dir, manifest, config)
    from appliance.runtime.backends.openvino_paged import OpenVINOPagedBackend

    return OpenVINOPagedBackend(model_dir, manifest, config)
