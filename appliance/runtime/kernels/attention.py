"""At load: the PagedAttentionExtension nodes of the graphs of rows (steps of up to 8 tokens: backends/row_graphs.py)
become our DecodeAttention op (decode_attention.cpp). It reads and writes the same u8 cache, quantized by token, that
the plugin's paged attention uses in the graph of dynamic shapes (prefill, longer steps).

Why: at Qwen2.5-1.5B batch-1 decode on a 2-vCPU Zen 5 EPYC, the plugin's paged attention over its u8 cache took
0.95 / 2.96 / 5.04 ms of a 19-28 ms step at 64 / 512 / 1500-token contexts (bench.profile), ~120-200 ns per token and
layer, bound by its per-token work, not by memory. A bf16 cache made it faster there but the step was not. Ours
dequantizes each cached key in registers once per group of up to 4 query heads and keeps the values' weighted sums
in registers across a run of tokens. In that step (bench.profile --steps 32 --reps 3, runs alternated with ENV=0) it
took 1.34 / 1.32 ms against 2.26 / 2.09 at 512 tokens, and 2.36 / 2.64 against 4.99 / 5.70 at 1500. The graph's
static shapes matter: with the pool's dimension dynamic the plugin infers the op's shape at every call, and it took
1.6-1.9 ms at 512 (row_graphs.graph). The whole step, one backend holding the single-token graph compiled
twice (ours, the plugin's attention; the same weights and cache), interleaved, medians of 10-12 pairs: the plugin's
step took 1.090 / 1.170x ours at 512 / 1500 tokens at Qwen2.5-1.5B and 1.158 / 1.137x at 128 / 512 at the default
model; with the box capped to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2, APPLIANCE_KERNELS_ISA=avx2: our 256-bit kernels,
narrow_only) 1.064 / 1.073x and 1.047 / 1.106x.

The layout: KEY_CACHE_QUANT_MODE=BY_TOKEN with KEY_CACHE_GROUP_SIZE=32 (cache_mode, set by the backend on every
graph it compiles when ours run) makes each token's key row head / 32 groups of (f32 scale, f32 zero point, 32 u8).
The value cache is by token already, one group a row. The plugin's default keeps keys by channel, with scales in
extra rows of each block. Groups of 32 cost what those rows do (8 bytes per 32 values), and they were as accurate:
next-token TVD against an f32 cache, over the default model's prefill, 6 single-token steps and a 2-token step
(tests/runtime/test_decode_attention.py's steps), averaged 0.0147 by channel, 0.0188 by token in one group a row,
0.0121 in groups of 32 on the plugin's attention, and 0.0145 with ours in the single-token steps.

The op reads the pool by address (pool_input, set when the graph is built; the backend allocates the pool first and
frees it last), so the cache tensors are not inputs of the graphs of rows. As inputs of the pool's static shape
they cost memory twice: compiling the graph allocated and wrote a buffer of the pool's size, and binding the
backend's pool to it wrote every page of that calloc'ed memory, which otherwise stays unmapped until blocks are used.
The default model's engine after load (KV budget 213 MB, the auto size on a 24 GB box): 948 MB RSS with the cache
inputs, 559 MB by address; with a 476 MB pool 1447 MB against 549 (2-vCPU Xeon with AMX; `--kernels openvino`:
431 MB). Qwen2.5-1.5B's engine: 2630 MB with them, 2626 by address at a 953 MB pool (2626 at 476 too).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from appliance.runtime import kernels
from appliance.runtime.kernels import rope
from appliance.runtime.kernels.rewrite import constant_value

log = logging.getLogger(__name__)

OP = "DecodeAttention"
# 0: single-token steps keep the plugin's paged attention (and the plugin's default key cache layout), for
# side-by-side measurements.
ENV = "APPLIANCE_KERNELS_ATTENTION"
PAGED = "PagedAttentionExtension"
KEY_GROUP = 32
# PagedAttentionExtension's inputs: 0-2 q, k, v; 3-4 the caches; 5 past_lens; 6 subsequence_begins; 7 block_indices;
# 8 block_indices_begins; 9 scale; 10 sliding_window; 11 alibi_slopes; 12 max_context_len; the rest serve cache
# eviction, rotation, sparse attention and sinks. Ours takes a model that uses none of those (every one empty),
# no sliding window and no ALiBi.
SCALE, WINDOW, ALIBI, FIRST_EXTRA = 9, 10, 11, 13


def _plain(node: ov.Node) -> bool:
    """Attention our op computes the same: a constant scale, no window, no ALiBi, no eviction scores read, and
    every optional input past max_context_len empty or a scalar."""
    scale, window, alibi = (constant_value(node.input_value(i)) for i in (SCALE, WINDOW, ALIBI))
    if scale is None or scale.size != 1 or window is None or int(window.ravel()[0]) != 0:
        return False
    if alibi is None or alibi.size:
        return False
    for i in range(FIRST_EXTRA, node.get_input_size()):
        shape = node.input_value(i).get_partial_shape()
        if shape.rank.is_dynamic or (shape.rank.get_length() and not (shape.is_static and shape[0].get_length() == 0)):
            return False
    return all(not node.output(i).get_target_inputs() for i in range(1, node.get_output_size()))


def _group(head: int, row: int) -> int:
    """The group size whose rows of `head` values take `row` bytes (head / group groups of 8 + group), or 0."""
    extra = row - head
    if extra <= 0 or extra % 8 or head % (extra // 8):
        return 0
    group = head // (extra // 8)
    return group if group % 8 == 0 else 0


def rewrite(
    model: ov.Model,
    factory: Any,
    caches: dict[str, list[int]],
    pools: dict[str, tuple[int, int]],
    wide: bool = True,
    rotate: bool = True,
) -> tuple[int, int]:
    """Replaces `model`'s paged attention nodes with DecodeAttention where every one of them fits (else none: one
    layer on each would still read one cache); returns how many, and on how many of them the op applies q's and k's
    rotary embedding itself (rope.py; `rotate` False: none). `caches`: per cache input name (key_cache.N,
    value_cache.N) the compiled graphs' block dims [kv heads, block size, row bytes], all u8 by token; `pools`: per
    name the address of that cache tensor's memory and its blocks, which the op reads and writes (the module
    docstring: the cache inputs leave the graph). `wide`: the op may run its 512-bit kernels where the CPU has them
    (narrow_only)."""
    nodes = [n for n in model.get_ordered_ops() if n.get_type_name() == PAGED]
    swaps = []
    for node in nodes:
        if not _plain(node):
            return 0, 0
        ports = [node.input_value(i).get_node() for i in (3, 4)]
        names = [p.get_friendly_name() for p in ports]
        key_dims, value_dims = (caches.get(n) for n in names)
        if key_dims is None or value_dims is None or any(p.get_type_name() != "Parameter" for p in ports):
            return 0, 0
        if any(n not in pools for n in names) or pools[names[0]][1] != pools[names[1]][1]:
            return 0, 0
        (kv_heads, block, key_row), (kv_heads_v, block_v, value_row) = key_dims, value_dims
        q, k = (node.input_value(i).get_partial_shape() for i in (0, 1))
        if (kv_heads, block) != (kv_heads_v, block_v) or q[1].is_dynamic or k[1].is_dynamic:
            return 0, 0
        head, rest = divmod(k[1].get_length(), kv_heads)
        groups = [_group(head, row) for row in (key_row, value_row)]
        heads, rest_q = divmod(q[1].get_length(), head) if head else (0, 1)
        if rest or rest_q or not all(groups) or heads % kv_heads or heads // kv_heads > 64:
            return 0, 0
        attrs: dict[str, Any] = {"heads": heads, "kv_heads": kv_heads, "head_size": head, "block_size": block}
        attrs |= {"key_group": groups[0], "value_group": groups[1]}
        attrs["scale"] = float(np.asarray(constant_value(node.input_value(SCALE))).ravel()[0])  # _plain: a constant
        attrs["wide"] = int(wide)
        swaps.append((node, names, attrs))
    made, rotated = [], 0
    for node, names, attrs in swaps:
        pool = [ops.constant(pool_input(*pools[n])).output(0) for n in names]
        inputs = [*(node.input_value(i) for i in (0, 1, 2)), *pool, *(node.input_value(i) for i in (5, 7, 8))]
        rows = node.input_value(0).get_partial_shape()[0]  # static in the graphs of rows
        tokens = rows.get_length() if rows.is_static else 0
        geometry = (attrs["heads"], attrs["kv_heads"], attrs["head_size"], tokens)
        rotation = rope.inputs(inputs[0], inputs[1], *geometry) if rotate and tokens else None
        if rotation is not None:
            inputs = [*rotation[:2], *inputs[2:], *rotation[2:]]
            rotated += 1
        made.append((node, factory.create(OP, inputs, {**attrs, "rope": int(rotation is not None)})))
    for node, new in made:
        new.set_friendly_name(node.get_friendly_name())
        for target in list(node.output(0).get_target_inputs()):
            target.replace_source_output(new.output(0))
    if made:
        used = {n for _, names, _ in swaps for n in names}
        for param in list(model.get_parameters()):
            if param.get_friendly_name() in used:
                model.remove_parameter(param)
        model.validate_nodes_and_infer_types()
    return len(made), rotated


def pool_input(address: int, blocks: int) -> np.ndarray:
    """DecodeAttention's pool input: the address in its low and high 32 bits, the blocks (i32: the CPU plugin runs
    i64 as i32)."""
    return np.array([address & 0xFFFFFFFF, address >> 32, blocks], np.uint32).view(np.int32)


def by_token(ports: list[ov.Output]) -> dict[str, list[int]]:
    """The compiled model's cache inputs as rewrite's `caches`, or {} unless every one is u8 [?, kv heads, block
    size, row] (by token: the key caches alike, the value caches alike)."""
    caches = {}
    for port in ports:
        shape = port.get_partial_shape()
        if (
            port.get_element_type() != ov.Type.u8
            or shape.rank.get_length() != 4
            or any(shape[d].is_dynamic for d in (1, 2, 3))
        ):
            return {}
        caches[port.get_any_name()] = [shape[d].get_length() for d in (1, 2, 3)]
    kinds: dict[str, set[tuple[int, ...]]] = {}
    for name, dims in caches.items():
        kinds.setdefault(name.split(".")[0], set()).add(tuple(dims))
    return caches if all(len(d) == 1 for d in kinds.values()) else {}


def wanted(label: str) -> bool:
    """Whether a backend whose MatMuls run `label` ("openvino" or ours) should lay its cache out for our attention
    (cache_mode) and try it: ours are loaded and ENV does not say 0."""
    return label != "openvino" and os.environ.get(ENV, "1").strip() != "0"


def cache_mode(head_dim: int) -> dict[str, Any]:
    """The compile properties that lay the KV cache out for our attention (the module's docstring): keys by token
    in groups of KEY_GROUP, or in one group a row where the head does not split into them; {} where ours cannot
    take the head at all (a multiple of 8 values, the kernels' narrowest vector)."""
    if head_dim % 8:
        return {}
    mode: dict[str, Any] = {"KEY_CACHE_QUANT_MODE": "BY_TOKEN"}
    if head_dim % KEY_GROUP == 0:
        mode["KEY_CACHE_GROUP_SIZE"] = KEY_GROUP
    return mode


def narrow_only(loaded: kernels.Kernels) -> bool:
    """Whether APPLIANCE_KERNELS_ISA chose a narrower path than the CPU's widest (kernels.ISA_ENV): the attention
    then keeps to 256-bit vectors too, so that one variable measures a box without AVX-512 on one with it."""
    return loaded.isa != loaded.supported[0]


def apply(
    model: ov.Model,
    core: Any,
    choice: str,
    ports: list[ov.Output],
    pools: dict[str, tuple[int, int]],
    name: str = "",
    quiet: bool = False,
) -> bool:
    """Our attention in `model` (a graph of rows, before compiling: row_graphs) where the compiled cache inputs
    `ports` are u8 by token and every attention node fits, over the cache tensors at `pools` (rewrite); one log
    line says which attention runs (`quiet`: at debug level, for the graphs after the first). Never raises."""
    caches = by_token(ports)
    why, count, rotated = "", 0, 0
    if not caches:
        why = "the KV cache is not u8 by token"
    else:
        loaded, why = kernels.load(core, choice)
        if loaded is not None:
            try:
                rotate = os.environ.get(rope.ENV, "1").strip() != "0"
                wide = not narrow_only(loaded)
                count, rotated = rewrite(model, loaded.factory, caches, pools, wide=wide, rotate=rotate)
            except Exception as exc:  # a graph we did not foresee: the plugin's attention serves it
                why = f"rewrite failed: {exc}"
            else:
                why = "" if count else "an attention node uses what ours does not (window, ALiBi, eviction)"
    say = log.debug if quiet else log.info
    if not count:
        say("decode attention: openvino (%s)", why, extra={"model": name, "attention": "openvino", "reason": why})
        return False
    say(
        "decode attention: ours on %d layers, rotary embedding in the op on %d",
        count,
        rotated,
        extra={"model": name, "attention": "appliance", "ops": count, "rope": rotated},
    )
    return True
