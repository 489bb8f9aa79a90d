"""appliance/cpu_isa.py: the CPU's flags, the ONEDNN_MAX_CPU_ISA cap, the compile properties and the served default
export they lead to (appliance/paths.py). Pure functions over a cpuinfo file and an environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance import cpu_isa
from appliance.paths import served_weight_format

EPYC = "avx2 fma f16c avx512f avx512dq avx512_vnni avx512_bf16"  # this project's CI box
SKYLAKE = "avx2 fma f16c"  # an AVX2 edge box: no VNNI, no bf16
ALDER_LAKE_N = "avx2 fma f16c avx_vnni"


def cpuinfo(folder: Path, flags: str) -> str:
    info = folder / f"cpuinfo-{abs(hash(flags))}"
    info.write_text(f"processor\t: 0\nmodel name\t: X\nflags\t\t: fpu sse2 {flags}\n")
    return str(info)


def isa(tmp_path: Path, flags: str, cap: str | None = None) -> cpu_isa.CpuIsa:
    return cpu_isa.detect(cpuinfo(tmp_path, flags), {cpu_isa.CAP_ENV: cap} if cap else {})


def test_flags_and_levels(tmp_path: Path) -> None:
    epyc = isa(tmp_path, EPYC)
    assert (epyc.vnni, epyc.bf16, epyc.name) == (True, True, "avx512+vnni+bf16")
    assert (isa(tmp_path, SKYLAKE).vnni, isa(tmp_path, SKYLAKE).name) == (False, "avx2")
    assert isa(tmp_path, ALDER_LAKE_N).name == "avx2+vnni"
    assert isa(tmp_path, "").name == "sse"  # unreadable or bare: nothing assumed


def test_the_cap_removes_what_its_level_lacks(tmp_path: Path) -> None:
    capped = isa(tmp_path, EPYC, "avx2")
    assert capped.flags == ("avx2", "fma", "f16c")
    assert capped.name == f"avx2 (capped: {cpu_isa.CAP_ENV}=AVX2)"
    assert isa(tmp_path, EPYC, "AVX512_CORE_VNNI").flags == ("avx2", "fma", "f16c", "avx512f", "avx512_vnni")
    assert isa(tmp_path, EPYC, "ALL").flags == isa(tmp_path, EPYC).flags


@pytest.mark.parametrize(
    "flags,cap,precision,expected",
    [
        (EPYC, None, None, {}),  # the plugin's own defaults: bf16, dynamic quantization on
        (EPYC, None, "f32", {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}),  # f32 parity: no int8 activations
        (EPYC, "AVX2", None, {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}),
        (SKYLAKE, None, None, {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}),
        (ALDER_LAKE_N, None, None, {"INFERENCE_PRECISION_HINT": "f32"}),
    ],
)
def test_plugin_properties(tmp_path: Path, flags: str, cap: str | None, precision: str | None, expected) -> None:
    assert cpu_isa.plugin_properties(isa(tmp_path, flags, cap), precision) == expected


def test_served_default_export_by_cpu(tmp_path: Path) -> None:
    """int8 only where it was measured faster within the quality tolerance (no VNNI, no bf16); int4 elsewhere."""
    assert served_weight_format(isa(tmp_path, EPYC)) == "int4"
    assert served_weight_format(isa(tmp_path, ALDER_LAKE_N)) == "int4"
    assert served_weight_format(isa(tmp_path, SKYLAKE)) == "int8"
    assert served_weight_format(isa(tmp_path, EPYC, "AVX2")) == "int8"


def test_one_thread_in_bf16_on_amx_caps_the_isa_before_the_plugin_loads(tmp_path: Path) -> None:
    from appliance.config import EngineConfig

    amx = cpuinfo(tmp_path, "avx2 fma avx512f avx512_vnni avx512_bf16 amx_bf16 amx_int8")
    one = EngineConfig(num_threads=1)
    env: dict[str, str] = {}
    assert cpu_isa.single_thread_amx_cap([EngineConfig(), one], env, amx)
    assert env == {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    assert cpu_isa.detect(amx, env).bf16 and "amx_bf16" not in cpu_isa.detect(amx, env).flags
    for engines, environ, info in (
        ([EngineConfig(num_threads=1, precision="f32")], {}, amx),  # f32: no bf16 kernel
        ([EngineConfig(num_threads=2)], {}, amx),
        ([EngineConfig(num_threads=1, device="GPU")], {}, amx),
        ([one], {"ONEDNN_MAX_CPU_ISA": "AVX2"}, amx),  # the operator's own cap stays
        ([one], {}, cpuinfo(tmp_path, "avx2 fma avx512f avx512_bf16")),  # no AMX
    ):
        before = dict(environ)
        assert not cpu_isa.single_thread_amx_cap(engines, environ, info)
        assert environ == before
