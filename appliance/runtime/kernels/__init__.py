"""Our own low-bit decode kernels inside OpenVINO: an extension library (LowBitMatMul, C++ in this directory) that
multiplies int8-quantized activations by u4 weights with integer dot products, where OpenVINO's CPU plugin expands
int4 to f32 (AVX2 boxes: brgemm_avx2_f32) or needs integer zero points to quantize activations (VNNI boxes).

This module finds and loads the library and says which path runs; rewrite.py swaps the MatMuls at load; build.py
compiles the library (what `make venv` and the Dockerfile run). Everything degrades to OpenVINO's own kernels: no
library (no compiler at install time, a failed build), a CPU without AVX2+FMA, a library that does not load, or
`--kernels openvino`; `appliance serve` never fails because of it.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LIBRARY = "libappliance_kernels.so"
LIBRARY_ENV = "APPLIANCE_KERNELS_LIB"  # another build of the library (tests, benchmarks)
ISA_ENV = "APPLIANCE_KERNELS_ISA"  # force one path: avx2, avxvnni, avx512vnni (tests, benchmarks)
ISAS = ("avx512vnni", "avxvnni", "avx2")  # widest first
CHOICES = ("auto", "ours", "openvino")
# Rows (tokens per step) up to which our kernels beat OpenVINO's, per path: bench.kernels at the Qwen2.5-1.5B MLP
# shapes, 2 threads, ratio ours / native time (loaded box, medians of interleaved reps). AVX2 (ONEDNN_MAX_CPU_ISA=AVX2
# on this AVX-512 box) 1.0 / 0.82 / 0.82 at M = 1 / 4 / 8; AVX512-VNNI against the plugin's dynamic quantization
# 0.93 / 0.84 / 1.12 at M = 1 / 4 / 8 and 2.6 / 5.2 at M = 32 / 128: longer steps (prefill) keep OpenVINO's.
KERNEL_ROWS = {
    "avx2": 8,
    "avxvnni": 4,
    "avx512vnni": 4,
}  # --kernels: auto = ours when they load, ours = the same, saying so louder


def library_path() -> Path:
    override = os.environ.get(LIBRARY_ENV)
    return Path(override) if override else Path(__file__).resolve().parent / LIBRARY


@dataclass(frozen=True)
class Kernels:
    """The loaded extension: `factory` makes LowBitMatMul nodes, `isa` is the path they run."""

    path: Path
    isa: str
    supported: tuple[str, ...]
    factory: Any

    @property
    def label(self) -> str:
        return f"appliance-{self.isa}"


def _isas(path: Path) -> tuple[str, ...]:
    lib = ctypes.CDLL(str(path))
    lib.appliance_kernels_isas.restype = ctypes.c_char_p
    return tuple(x for x in lib.appliance_kernels_isas().decode().split(",") if x)


def load(core: Any, choice: str = "auto") -> tuple[Kernels | None, str]:
    """(the loaded kernels or None, why not) for `core` (an ov.Core); never raises. `choice` from --kernels."""
    if choice == "openvino":
        return None, "--kernels openvino"
    path = library_path()
    if not path.is_file():
        return None, f"{path} is not built (python -m appliance.runtime.kernels.build)"
    try:
        from openvino.utils.node_factory import NodeFactory

        supported = _isas(path)  # loads openvino's own libraries first: openvino is imported by now
        if not supported:
            return None, "this CPU has no AVX2+FMA"
        isa = os.environ.get(ISA_ENV, "").strip().lower() or supported[0]
        if isa not in supported:
            return None, f"{ISA_ENV}={isa} is not one of this CPU's paths ({', '.join(supported)})"
        core.add_extension(str(path))
        factory = NodeFactory()
        factory.add_extension(str(path))
    except Exception as exc:  # a stale or foreign build: OpenVINO's kernels still serve
        return None, f"{path} did not load: {exc}"
    return Kernels(path, isa, supported, factory), ""


def apply(model: Any, core: Any, *, choice: str, device: str, precision: str | None, name: str = "") -> str:
    """Rewrites `model`'s u4 MatMuls to our op when that applies; logs one line saying which kernels run and
    returns it as a label: "appliance-<isa>" or "openvino". Never raises: any failure leaves `model` as read (the
    rewrite swaps nodes only after every match was made) and OpenVINO's kernels serve."""
    why = ""
    if device.upper() != "CPU":
        why = f"device {device}"
    elif choice == "auto" and precision == "f32":
        why = "--precision f32 (int8 activations are not f32; --kernels ours overrides)"
    loaded = None
    if not why:
        loaded, why = load(core, choice)
    count = 0
    if loaded is not None:
        from appliance.runtime.kernels.rewrite import rewrite

        try:
            count = rewrite(model, loaded.factory, loaded.isa)
        except Exception as exc:  # an IR shape we did not foresee: OpenVINO's kernels serve it
            why = f"rewrite failed: {exc}"
        else:
            why = "" if count else "no u4 group-quantized MatMul in this model"
    if loaded is None or not count:
        log.info("kernels: openvino (%s)", why, extra={"model": name, "kernels": "openvino", "reason": why})
        return "openvino"
    log.info(
        "kernels: %s on %d MatMuls", loaded.label, count, extra={"model": name, "kernels": loaded.label, "ops": count}
    )
    return loaded.label
