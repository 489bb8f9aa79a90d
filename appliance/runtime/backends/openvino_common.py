"""OpenVINO helpers shared by the paged and static backends: core, device checks, compile properties."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import openvino as ov

from appliance import cpu_isa, devices
from appliance.runtime import kernels
from appliance.runtime.backends.base import DeviceError
from appliance.runtime.kernels.rewrite import logits_op, prefill_fits

if TYPE_CHECKING:
    from appliance.config import EngineConfig

log = logging.getLogger(__name__)
_core: ov.Core | None = None


def core() -> ov.Core:
    global _core
    if _core is None:
        _core = ov.Core()
    return _core


def check_device(device: str) -> None:
    """Fail early and plainly when e.g. NPU or GPU is asked for on a machine without one."""
    available = core().available_devices
    absent = devices.missing(device, available)
    if absent:
        raise DeviceError(f"device {absent[0]} is not available on this machine (found: {', '.join(available)})")


def compile_properties(config: EngineConfig, *, kv_precision: bool = True) -> dict[str, Any]:
    props: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY"}
    if config.precision:
        props["INFERENCE_PRECISION_HINT"] = config.precision
    if kv_precision:
        kv = config.kv_precision()
        if kv:
            props["KV_CACHE_PRECISION"] = kv
    if config.device.upper() == "CPU":
        props.update(cpu_isa.plugin_properties(cpu_isa.detect(), config.precision))
        if config.num_threads:
            props["INFERENCE_NUM_THREADS"] = config.num_threads
    cache = config.compile_cache()
    cache = usable_cache_dir(cache) if cache else None
    if cache:
        props["CACHE_DIR"] = cache
    return props


def usable_cache_dir(path: str) -> str | None:
    """The compile cache directory, created if need be, or None (with a warning) when it cannot be written: a
    read-only box still serves, it only compiles at every start. OpenVINO itself would fail the compilation."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        log.warning(
            "compile cache disabled: its directory is not writable; every start compiles",
            extra={"cache_dir": path, "error": str(exc)},
        )
        return None
    return str(path)


def read_model(model_dir: Path, model_file: str) -> ov.Model:
    return core().read_model(str(Path(model_dir) / model_file))


def compile_with_kernels(model: ov.Model, device: str, props: dict[str, Any]) -> ov.CompiledModel | None:
    """`model` (rewritten to our kernels) compiled, or None with one log line when the plugin refuses it: the
    backend then serves OpenVINO's kernels alone rather than failing to load."""
    try:
        return core().compile_model(model, device, props)
    except Exception as exc:  # an op the plugin cannot take: our kernels are an optimisation, never a requirement
        log.warning("kernels: openvino (compiling our kernels failed: %s)", exc, extra={"kernels": "openvino"})
        return None


def kernel_rows(label: str, model: ov.Model) -> int:
    """Steps of up to this many tokens run our kernels: 0 none, kernels.EVERY_ROW all (prefill too: the rewritten
    `model` is the only graph the backend needs), 1 where ours took the model for single-token steps alone
    (kernels.ONE_TOKEN)."""
    if label.endswith(kernels.ONE_TOKEN):
        return 1
    return kernels.rows(label.removeprefix("appliance-"), prefill_fits(model))


def model_name(model_dir: Path) -> str:
    """How the kernels' log lines name a model: <model>/<format>."""
    return f"{Path(model_dir).parent.name}/{Path(model_dir).name}"


def apply_kernels(model: ov.Model, config: EngineConfig, model_dir: Path, *, one_token: bool = False) -> str:
    """Our low-bit kernels where they apply (appliance/runtime/kernels), after every rewrite that looks for the
    graph's MatMuls (the LM head's Gather) and before compiling; returns which kernels run, for the backend.
    `one_token`: the backend can run the rewritten model on single-token steps alone (kernels.ONE_TOKEN)."""
    return kernels.apply(
        model,
        core(),
        choice=config.kernels,
        device=config.device,
        precision=config.precision,
        name=model_name(model_dir),
        one_token=one_token,
    )


def logits_matmul(model: ov.Model) -> ov.Node:
    """The MatMul that produces the logits (the LM head), before our kernels' rewrite (rewrite.logits_op)."""
    node = logits_op(model)
    if node is None or node.get_type_name() != "MatMul":
        raise RuntimeError("could not find the LM head MatMul above the logits output")
    return node
