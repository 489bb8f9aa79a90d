"""Our own low-bit decode kernels inside OpenVINO: an extension library (LowBitMatMul, C++ in this directory) that
multiplies int8-quantized activations by u4 weights with integer dot products, where OpenVINO's CPU plugin expands
int4 to f32 (AVX2 boxes: brgemm_avx2_f32) or needs integer zero points to quantize activations (VNNI boxes); and
the single-token steps' paged attention over the u8 KV cache (DecodeAttention, attention.py says why).

This module finds and loads the library and says which path runs; rewrite.py swaps the MatMuls at load; build.py
compiles the library (what `make venv` and the Dockerfile run). Everything degrades to OpenVINO's own kernels: no
library (no compiler at install time, a failed build), a library built for another ABI (a stale build beside newer
Python code), a CPU without AVX2+FMA, a library that does not load, or `--kernels openvino`; `appliance serve` never
fails because of it.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance import cpu_isa

log = logging.getLogger(__name__)

LIBRARY = "libappliance_kernels.so"
# What rewrite.py, attention.py and the library agree on (the ops' inputs, attributes and their layouts, the exported
# symbols): build.py compiles this number into the library and load() refuses a library that reports another one. A
# library built from older sources once asserted at its first call ("sz must hold ceil(K / group_size)") instead of
# falling back. Bump it with any change to that contract (5: the backends run prefill on ours where PREFILL_ISAS says
# the library has a prefill tile; an older one would run it on the slower general tile. 6: KERNEL_ROWS 8 on AVX512-VNNI,
# where an older library runs 3-8 rows slower than OpenVINO's. 7: activations scaled per 8 values, not per 32, which the
# tests' error bound assumes, and the op's `residual` attribute. 8: the op's `slot_pairs` attribute, AVX512-VNNI's
# grouped rows. 9: the op's optional fourth input, the next op's weights to read ahead. 10: the DecodeAttention op,
# attention.py. 11: its `wide` attribute. 12: appliance_kernels_zmm_cost. 13: AVX512-VNNI's u4 in
# lanes of 16 rows (slot_pairs 0) instead of rows grouped by 8 in 2-pair slots, and no zmm_cost. 14: u8 in lanes too,
# which an older library refuses. 15: the op's `gated` attribute, a SwiGLU's gate and up in one op: rewrite.swiglu.
# 16: DecodeAttention's `rope` attribute and its cos and sin inputs: rope.py. 17: `residual` 2, x's second int8 digit
# at one row of u4 in lanes, which an older library refuses. 18: DecodeAttention's pools as addresses, not as the cache
# tensors. 19: i8 symmetric weights in lanes as u8 about 128, x to two int8 digits for u8 at one row. 20: the op's
# `down` attribute, a gated op's down projection in the same op: rewrite.mlp).
ABI = 20
LIBRARY_ENV = "APPLIANCE_KERNELS_LIB"  # another build of the library (tests, benchmarks)
ISA_ENV = "APPLIANCE_KERNELS_ISA"  # force a path: avx2, avxvnni, avx512vnni (tests, benchmarks; attention.narrow_only)
ISAS = ("avx512vnni", "avxvnni", "avx2")  # widest first
CHOICES = ("auto", "ours", "openvino")  # --kernels: auto = ours unless --precision f32; ours = also then
# Rows (tokens per step) up to which our kernels beat OpenVINO's, per path: bench.kernels at the Qwen2.5-1.5B MLP
# shapes (8960 x 1536, 1536 x 8960; NNCF u4 g128 and the Q4_1 grid), 2 threads, ratio ours / native time (loaded
# box, medians of interleaved reps). AVX2 against OpenVINO under ONEDNN_MAX_CPU_ISA=AVX2 (brgemm f32): 0.50-0.93 at
# M = 2..16, 0.56-1.07 at M = 1. AVX512-VNNI against the plugin's dynamic quantization (VNNI int8 GEMM): 0.65-0.98 at
# M = 1..4, 1.08 at 8, 2.6 / 5.2 at 32 / 128 (an earlier build): longer steps (prefill) keep OpenVINO's. With
# several weight rows per pass, against OpenVINO's AMX bf16 (40 layers, load 6.6): 0.54-0.95 at M = 4, 0.60-1.22 at
# 8 (1536 x 8960 u4 g128 slower), 1.00-1.49 at 16: VNNI stays at 4. AVX2 again on a quiet box whose memory read
# 27-31 GB/s (the loaded one above: 11-19), where OpenVINO's compute-bound f32 kernels catch up sooner (8 layers,
# 7 reps; 8960x1536 / 1536x8960 / 1536x1536): M = 4 0.70 / 0.58 / 0.83, M = 8 1.09 / 0.81 / 1.11 (the MLP's three
# together 1.00), M = 12 1.20 / 0.90 / 1.24, M = 16 1.23 / 0.98; M = 64 and 256 1.10-1.57. With four rows of x per
# pass from M = 4 (lowbit_kernel.hpp GEMM_ROWS): M = 8 0.84 / 0.80 / 0.87, M = 12 0.99 / 0.89 / 0.97, M = 16 1.06 /
# 0.94 / 1.04. So AVX2 stops at 12. AVX512-VNNI with rows of x on 512-bit registers (lowbit_kernel.hpp rows_zmm) on
# a 2-vCPU Zen 5 EPYC, against the plugin's brgemm_avx512_bf16: the MLP shapes 0.55-0.77 at M = 3-6 and 0.76 / 0.85
# at 8, q/k/v together (2048 x 1536) and o (1536 x 1536) 1.13 / 1.12 at 8, the u8 head 1.04; the Qwen2.5-1.5B
# decode step of 4 / 8 sequences took 40 / 74 ms against 66 / 85 on OpenVINO's kernels alone (engines side by
# side, interleaved). So it stops at 8 (a model on the lanes tile beside AMX: LANES_ROWS_BESIDE_AMX). On a
# Zen 4 EPYC, whose 512-bit units are split in two, that tile lost from M = 4-6 (1.27 / 1.13 at M = 8); with u4 in
# lanes of 16 rows (lowbit_kernel.hpp lanes_tile) ours took 0.49-0.56 of the plugin's time at M = 8 and 0.67-0.84
# at 32 there, so 8 holds on both.
KERNEL_ROWS = {"avx2": 12, "avxvnni": 4, "avx512vnni": 8}
# Paths with a prefill tile (lowbit_kernel.hpp prefill_tile): where it takes every op of a model (rewrite.prefill_fits),
# ours win at every row count and the model runs ours alone, prefill included: one compiled model, no copy of the
# weights in the plugin's layout beside ours. Quiet AVX2 EPYC, 2 threads (bench.kernels --formats u4a:128 --layers 8
# --reps 7; ours / OpenVINO's time at 8960x1536 / 1536x8960 / 1536x1536): M = 16 0.73 / 0.68 / 0.77, M = 64 0.88 /
# 0.78 / 0.90, M = 256 0.83 / 0.75 / 0.87; the general tile there: 1.09 / 0.93 / 1.05 and 1.24 / 1.14 / 1.28.
# AVX512-VNNI's lanes tile (lowbit_kernel.hpp lanes_tile) against the plugin's brgemm_avx512_bf16 on the 2-vCPU Zen 4
# EPYC (8 layers): M = 64 0.86 / 0.77 / 0.80, M = 128 0.85 / 0.77 / 0.80, M = 512 0.86 / 0.77 / 0.86; not where the
# CPU has AMX (prefills), whose bf16 tiles win from ~44 rows (LANES_ROWS_BESIDE_AMX).
PREFILL_ISAS = ("avx2", "avx512vnni")
EVERY_ROW = 1 << 30  # kernel rows of a model on ours alone
# Beside AMX, a model whose ops all run the lanes tile (rewrite.prefill_fits) keeps ours up to this many tokens a
# step and OpenVINO's AMX bf16 GEMM above. 2-vCPU Intel Xeon with AMX (Sapphire Rapids class), ours / OpenVINO's
# time, bench.kernels --formats u4a:128 --layers 80 --reps 7 at 8960x1536 / 1536x8960 / 1536x1536: M = 8 0.30 / 0.29
# / 0.28, M = 16 0.51 / 0.48 / 0.48, M = 24 0.66 / 0.65 / 0.62, M = 32 0.84 / 0.82 / 0.76, M = 48 1.03 / 1.05 /
# 1.01, M = 64 1.16 / 1.18 / 1.23. A prompt of P tokens prefilled in one step, one engine switching between the two
# every request (9-15 interleaved reps, medians): Qwen2.5-1.5B P = 9 0.49, 16 0.60, 24 0.74, 32 0.87, 40 0.96, 48 1.10;
# Llama-3.2-3B P = 16 0.59, 32 0.86, 40 0.95. Such steps: short prompts, a prompt's uncached tail after a prefix hit,
# up to 32 sequences decoding, speculative verification. The next token after such prefills (bench.quality --prompts
# 16 at Qwen2.5-1.5B, prompts of 16-300 tokens): TVD from OpenVINO's kernels median 0.0119, max 0.0225 (at 8 rows:
# 0.0117 / 0.0137), from fp32 0.2333 as OpenVINO's 0.2332.
LANES_ROWS_BESIDE_AMX = 32

# Smaller weights keep OpenVINO's kernels: our op costs ~6 us more per call than a native FullyConnected (the CPU
# plugin's reference-node path, and Converts around it under bf16), more than it saves on a small matrix. The default
# 135M model (every layer under 1M weights) decoded 1.24x slower at batch 1 with all 210 of its u4 MatMuls on ours
# (bf16 default precision, VNNI box, 15 interleaved reps); with this floor it keeps OpenVINO's kernels (but in
# single-token steps: ONE_TOKEN), while
# Qwen2.5-1.5B's MLP (13.8M) and u8 LM head (233M) take ours. Its q/o projections (1536 x 1536, 2.4M) were slower
# on ours at M = 1 on the AVX512-VNNI box: 1.14x OpenVINO's time (CPU time 1.05x; bench.kernels --shapes 1536x1536
# --layers 200 --reps 7, load 4.4), and the decode step with them kept native (floor 2^22 instead of 2^21) took
# 0.94x the wall and 0.99x the CPU time (bench.profile, 24 steps x 5 interleaved reps, load 4-5.5). Llama-3.2-1B's
# q/o (2048 x 2048 = 2^22) still take ours: not measured. On AVX2 (against brgemm_avx2_f32, rows grouped by
# rewrite.ROW_GROUPS) the q/o shape is well ahead per op at M = 1: 0.54 of OpenVINO's time (CPU time 0.53; 2-vCPU
# EPYC Zen 3, bench.kernels --shapes 1536x1536 --layers 60 --reps 9, load 12), so there the floor is 2^21 and they
# take ours; k/v (256 x 1536) measured 0.82 (CPU 0.86) but would bring the default model's layers along, not measured
# end to end. With the 512-bit decode tile (lowbit_kernel.hpp tile_zmm) on a 2-vCPU AVX-512 Zen 5 EPYC the q/o shape
# took 0.54 of OpenVINO's time at M = 1 (bench.kernels --layers 8 --reps 9), and the Qwen2.5-1.5B decode step's
# attention projections 5.3 / 5.0 ms with them on ours against 8.6 / 6.7 with them native (bench.profile, two
# interleaved pairs): the AVX512-VNNI floor is 2^21 as AVX2's (the AMX box's 1.14 was the 256-bit tile; not
# measured there since). APPLIANCE_KERNELS_MIN_WEIGHTS overrides (tests).
MIN_WEIGHTS = {"avx2": 1 << 21, "avxvnni": 1 << 22, "avx512vnni": 1 << 21}
MIN_WEIGHTS_ENV = "APPLIANCE_KERNELS_MIN_WEIGHTS"
# Where a backend runs steps of a few tokens on graphs of static shapes (backends/row_graphs.py), the plugin no
# longer infers our op's shape per call, and the floor's cost is mostly gone there: a model with no MatMul at the
# floor (the default 135M model, every layer under 1M weights) takes ours on all of them in those graphs alone
# (apply's `one_token`), its label ending in ONE_TOKEN; longer steps keep OpenVINO's. The default model's
# batch-1 decode step, ours in that graph / OpenVINO's: 0.674 on AVX512-VNNI, 0.613 on AVX-VNNI, 0.570 on AVX2
# (2-vCPU Zen 5 EPYC, the plugin capped to AVX2_VNNI / AVX2 for the last two; two engines interleaved, medians of
# 12-16 reps of 32 steps); the same graph with OpenVINO's kernels 0.942. Ours on every layer in the dynamic graph
# instead: 1.05 / 1.08 of OpenVINO's time at steps of 2 / 8 tokens (AVX512-VNNI), hence the graphs of static shapes
# only (row_graphs says what they take).
ONE_TOKEN = "/one-token"
# 1: the attention projections' ops also run their activations' int8 rounding error (rewrite.ATTENTION_PROJ, the
# op's `residual`). Off by default: at Qwen2.5-1.5B on the AVX2 Zen 1 box it took the next-token TVD from OpenVINO's
# kernels 0.0137 -> 0.0079 (median, bench.quality --prompts 8), under the 0.01 goal, but cost batch-1 decode 7% and
# time to first token 12% (bench.deployed --native-side, 512-token prompt, interleaved runs): every projection then
# runs twice the rows. Where the 512-bit lanes tile runs decode (AVX512-VNNI), at one row of x every u4 op's x gets a
# second int8 digit instead (rewrite.residual_of): on the AMX Xeon at 1.5B TVD 0.0113 -> 0.0081 for 1.069 of the
# decode step's time, while OpenVINO's own default (bf16) is 0.0120 from its f32 there (lowbit_kernel.hpp lanes_tile).
# A quality-first box sets it in the service's environment file.
RESIDUAL_ENV = "APPLIANCE_KERNELS_RESIDUAL"
# 0: the ops do not read the next op's weights ahead (rewrite.link_ahead; lowbit_matmul.cpp read_ahead says why and
# what it measured). For side-by-side measurements; outputs are the same either way.
READ_AHEAD_ENV = "APPLIANCE_KERNELS_READ_AHEAD"


def prefills(isa: str) -> bool:
    """Whether `isa`'s path wins at every row count on this CPU (PREFILL_ISAS; AVX512-VNNI's not beside AMX)."""
    return isa in PREFILL_ISAS and not (isa == "avx512vnni" and "amx_bf16" in cpu_isa.detect().flags)


def rows(isa: str, fits: bool) -> int:
    """Steps of up to this many tokens run `isa`'s kernels on a model whose every op does (`fits`) or does not run
    the prefill tile (rewrite.prefill_fits): 0 none, EVERY_ROW all where the path prefills."""
    most = KERNEL_ROWS.get(isa, 0)
    if not most or not fits:
        return most
    if prefills(isa):
        return EVERY_ROW
    return LANES_ROWS_BESIDE_AMX if isa == "avx512vnni" else most


def row_graph_properties(model: Any, precision: str | None) -> dict[str, Any]:
    """Compile properties of the graphs of rows (backends/row_graphs.py) over the plugin's defaults: f32
    inference where our ops take every MatMul but the LM head and no precision was asked for. Our ops compute in f32;
    under the plugin's default bf16 (CPUs with AVX512-BF16 or AMX) each sat between Reorders to and from bf16 and the
    RoPE nodes ran the plugin's reference bf16 path: 113 of the 431 nodes a step ran at Qwen2.5-1.5B. Measured as two
    compiled models of one rewritten graph in one backend (the same weights' memory: two engines' steps differed by up
    to 13% whatever they ran), interleaved, medians of 4-12 pairs of 32 steps, 2-vCPU Zen 5 EPYC
    (AVX512-BF16, no AMX): the bf16 step took 1.021-1.045x the f32 one at Qwen2.5-1.5B (five processes, 128- and
    512-token contexts, every pair above 1), 1.011-1.015x with the plugin's attention in the graph, 1.105 / 1.072x at
    the default 135M model (64 / 512 tokens), whose LM head stays OpenVINO's. Logits come nearer f32's. The graphs
    of more rows too: at the default model on a 2-vCPU Xeon with AMX, one sequence feeding 2 / 4 / 6 tokens took
    8.2-8.4 / 10.4-10.7 / 13.6-14.2 ms in f32 against 9.6-10.1 / 12.2-12.4 / 15.7 in bf16 (bench.speculative --only
    shapes, two runs each). The graph of dynamic shapes keeps the plugin's precision: f32 took 0.96x bf16's time
    there at 4 sequences, 1.00x at 8, 1.01x verifying 5 tokens. Boxes without bf16 infer in f32 already
    (cpu_isa.plugin_properties)."""
    from appliance.runtime.kernels.rewrite import native_matmuls

    if precision is None and not native_matmuls(model):
        return {"INFERENCE_PRECISION_HINT": "f32"}
    return {}


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


def _abi(lib: ctypes.CDLL) -> int | None:
    """The ABI the library was built for; None for a library from before it said so."""
    try:
        fn = lib.appliance_kernels_abi
    except AttributeError:
        return None
    fn.restype = ctypes.c_int
    return int(fn())


def _isas(lib: ctypes.CDLL) -> tuple[str, ...]:
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

        lib = ctypes.CDLL(str(path))  # loads openvino's own libraries first: openvino is imported by now
        abi = _abi(lib)
        if abi != ABI:
            built = "an older ABI (no version)" if abi is None else f"ABI {abi}"
            rebuild = "python -m appliance.runtime.kernels.build"
            return None, f"{path} was built for {built}, this code needs ABI {ABI} (rebuild: {rebuild})"
        supported = _isas(lib)
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


def apply(
    model: Any, core: Any, *, choice: str, device: str, precision: str | None, name: str = "", one_token: bool = False
) -> str:
    """Rewrites `model`'s u4 MatMuls to our op when that applies; logs one line saying which kernels run and
    returns it as a label: "appliance-<isa>" or "openvino". Never raises: any failure leaves `model` as read (the
    rewrite swaps nodes only after every match was made) and OpenVINO's kernels serve. `one_token`: the caller can
    run the rewritten model on single-token steps alone; where no MatMul reaches the floor, every one takes ours
    and the label ends in ONE_TOKEN (above)."""
    why = ""
    if device.upper() != "CPU":
        why = f"device {device}"
    elif choice == "auto" and precision == "f32":
        why = "--precision f32 (int8 activations are not f32; --kernels ours overrides)"
    loaded = None
    if not why:
        loaded, why = load(core, choice)
    count, scope = 0, ""
    if loaded is not None:
        from appliance.runtime.kernels.rewrite import rewrite

        try:
            floor = int(os.environ.get(MIN_WEIGHTS_ENV, MIN_WEIGHTS[loaded.isa]))
            residual = os.environ.get(RESIDUAL_ENV, "0").strip() == "1"
            ahead = os.environ.get(READ_AHEAD_ENV, "1").strip() != "0"
            count = rewrite(model, loaded.factory, loaded.isa, min_weights=floor, residual=residual, ahead=ahead)
            if not count and one_token:
                scope = ONE_TOKEN
                count = rewrite(model, loaded.factory, loaded.isa, min_weights=0, residual=residual, ahead=ahead)
        except Exception as exc:  # an IR shape we did not foresee: OpenVINO's kernels serve it
            why = f"rewrite failed: {exc}"
        else:
            why = "" if count else f"no u4 group-quantized MatMul of {floor} weights or more in this model"
    if loaded is None or not count:
        log.info("kernels: openvino (%s)", why, extra={"model": name, "kernels": "openvino", "reason": why})
        return "openvino"
    label = loaded.label + scope
    log.info("kernels: %s on %d MatMuls", label, count, extra={"model": name, "kernels": label, "ops": count})
    return label
