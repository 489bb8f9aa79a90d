"""What the CPU can run fast: the vector extensions the CPU plugin's kernels dispatch on, as one `CpuIsa` the
compile properties and the benchmarks read (`appliance devices` shows the same flags).

The flags come from /proc/cpuinfo, capped by `ONEDNN_MAX_CPU_ISA` when it is set: oneDNN's own knob, which the CPU
plugin's oneDNN kernels obey (its FullyConnected picks avx2 kernels under `ONEDNN_MAX_CPU_ISA=AVX2` on an AVX-512
box) while the plugin's own capability checks read CPUID and still see bf16 and VNNI. Left to itself the plugin
then asks oneDNN for kernels the cap forbids ("could not create a primitive descriptor": a bf16 inner product, or
the VNNI dynamic quantization of int8/int4 weights), so the properties derived here name what the capped CPU can
do. Without the variable nothing changes: the properties equal the plugin's own defaults for that CPU. The cap
is how the benchmarks approximate an AVX2 box on an AVX-512 one (docs/performance.md says what it does not
emulate)."""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

CAP_ENV = "ONEDNN_MAX_CPU_ISA"
# oneDNN's ISA names in increasing order, and the /proc/cpuinfo flags each one adds (a cap keeps a flag only when
# the named level includes it; "ALL" and unknown names cap nothing).
_LEVELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("SSE41", ()),
    ("AVX", ()),
    ("AVX2", ("avx2", "fma", "f16c")),
    ("AVX2_VNNI", ("avx_vnni",)),
    ("AVX2_VNNI_2", ()),
    ("AVX512_CORE", ("avx512f",)),
    ("AVX512_CORE_VNNI", ("avx512_vnni",)),
    ("AVX512_CORE_BF16", ("avx512_bf16",)),
    ("AVX10_1_512", ("avx512_fp16",)),
    ("AVX10_1_512_AMX", ("amx_bf16", "amx_int8")),
)
FLAGS = tuple(flag for _, flags in _LEVELS for flag in flags)
LEVELS = tuple(name for name, _ in _LEVELS)  # the cap's accepted names, lowest first


@dataclass(frozen=True)
class CpuIsa:
    flags: tuple[str, ...]  # of FLAGS, present and allowed by the cap
    cap: str | None = None  # ONEDNN_MAX_CPU_ISA as set, or None

    @property
    def vnni(self) -> bool:
        """int8 dot products (AVX-VNNI or AVX512-VNNI): what the CPU plugin's dynamic quantization needs."""
        return any(f in self.flags for f in ("avx_vnni", "avx512_vnni", "amx_int8"))

    @property
    def bf16(self) -> bool:
        """bf16 compute, the CPU plugin's default inference precision where present."""
        return any(f in self.flags for f in ("avx512_bf16", "amx_bf16"))

    @property
    def name(self) -> str:
        """A short label for tables: the widest vector extension and what it adds."""
        base = "avx512" if "avx512f" in self.flags else "avx2" if "avx2" in self.flags else "sse"
        extras = [x for x, on in (("vnni", self.vnni), ("bf16", self.bf16), ("amx", "amx_int8" in self.flags)) if on]
        return "+".join([base, *extras]) + (f" (capped: {CAP_ENV}={self.cap})" if self.cap else "")


def detect(cpuinfo: str = "/proc/cpuinfo", environ: Mapping[str, str] | None = None) -> CpuIsa:
    env = os.environ if environ is None else environ
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        text = ""
    present = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    cap = env.get(CAP_ENV, "").strip().upper() or None
    allowed = set(FLAGS)
    if cap in LEVELS:
        allowed = {flag for _, flags in _LEVELS[: LEVELS.index(cap) + 1] for flag in flags}
    return CpuIsa(tuple(f for f in FLAGS if f in present and f in allowed), cap)


def plugin_properties(isa: CpuIsa, precision: str | None) -> dict[str, object]:
    """CPU compile properties the (capped) ISA and the precision need stated. Without a cap, on the plugin's own
    defaults, only `--precision f32` adds one: no dynamic quantization, whose int8 activations are a lossy shortcut
    that f32 (transformers parity) excludes."""
    props: dict[str, object] = {}
    if precision is None and not isa.bf16:
        props["INFERENCE_PRECISION_HINT"] = "f32"
    if precision == "f32" or not isa.vnni:
        props["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = 0
    return props


# OpenVINO 2026.4.1's CPU plugin dies of a divide error (SIGFPE, no message) while compiling an LLM in bf16 on an AMX
# CPU with INFERENCE_NUM_THREADS=1: measured on a 2-core Sapphire Rapids VM with the default model (2 threads, f32,
# or this cap: it compiles). oneDNN reads the cap once, when the plugin first asks for the ISA, so it has to be in
# the environment before anything loads the plugin; the engine process then runs every model without AMX (bf16 on
# AVX512-BF16 instead), which only a one-thread model asks for.
SINGLE_THREAD_AMX_CAP = "AVX512_CORE_BF16"


def single_thread_amx_cap(
    engines, environ: MutableMapping[str, str] | None = None, cpuinfo: str = "/proc/cpuinfo"
) -> bool:
    """Set SINGLE_THREAD_AMX_CAP in `environ` (the process's own by default) when one of `engines` (EngineConfig)
    would compile in bf16 on AMX with one thread and no cap is set; True when it did."""
    env = os.environ if environ is None else environ
    isa = detect(cpuinfo, env)
    if env.get(CAP_ENV) or "amx_bf16" not in isa.flags:
        return False
    if not any(e.device.upper() == "CPU" and e.num_threads == 1 and e.precision != "f32" for e in engines):
        return False
    env[CAP_ENV] = SINGLE_THREAD_AMX_CAP
    return True
