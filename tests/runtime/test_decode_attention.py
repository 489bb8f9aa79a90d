"""Our decode attention (kernels/decode_attention.cpp, kernels/attention.py): the op against a numpy reference over
the u8 cache quantized by token, its writes in the plugin's own layout, and the rewrite of the single-token graph,
whose logits must match the plugin's paged attention over the same cache.

The library is built by `make venv`; when it is missing these tests skip, except under CI=true, where they fail."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import openvino as ov
import pytest
from openvino import opset13 as ops
from openvino._offline_transformations import paged_attention_transformation

from appliance.runtime.kernels import attention
from tests.helpers import logits_tvd

BY_TOKEN = {"KV_CACHE_PRECISION": "u8", "KEY_CACHE_QUANT_MODE": "BY_TOKEN", "INFERENCE_PRECISION_HINT": "f32"}


def _quantize(x: np.ndarray, group: int) -> np.ndarray:
    """Rows of x as the cache holds them: per group of `group` values an f32 scale, an f32 zero point and the u8
    values (the plugin's formula and layout)."""
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    scale = ((hi - lo) / np.float32(255)).astype(np.float32)
    scale[~(scale > 0)] = np.float32(1e-4)
    zp = (-lo / scale).astype(np.float32)
    u = np.clip(np.rint(g / scale + zp), 0, 255).astype(np.uint8)
    rows = np.concatenate([scale.view(np.uint8), zp.view(np.uint8), u], -1)
    return rows.reshape(*x.shape[:-1], rows.shape[-2] * (8 + group))


def _dequantize(rows: np.ndarray, group: int) -> np.ndarray:
    g = rows.reshape(*rows.shape[:-1], rows.shape[-1] // (8 + group), 8 + group)
    scale = g[..., 0:4].copy().view(np.float32)
    zp = g[..., 4:8].copy().view(np.float32)
    values = (g[..., 8:].astype(np.float32) - zp) * scale
    return values.reshape(*rows.shape[:-1], values.shape[-2] * group)


def _op(
    factory,
    heads: int,
    kv_heads: int,
    head: int,
    block: int,
    scale: float,
    groups=(0, 0),
    wide: int = 1,
    rope: int = 0,
) -> ov.Model:
    key_group, value_group = (g or head for g in groups)
    params = [
        ops.parameter([-1, heads * head], ov.Type.f32),
        ops.parameter([-1, kv_heads * head], ov.Type.f32),
        ops.parameter([-1, kv_heads * head], ov.Type.f32),
        ops.parameter([3], ov.Type.i32),  # the key pool: its address, its blocks (attention.pool_input)
        ops.parameter([3], ov.Type.i32),
        ops.parameter([-1], ov.Type.i32),
        ops.parameter([-1], ov.Type.i32),
        ops.parameter([-1], ov.Type.i32),
    ]
    params += [ops.parameter([-1, head], ov.Type.f32) for _ in range(2 * rope)]  # cos, sin
    attrs = {"heads": heads, "kv_heads": kv_heads, "head_size": head, "block_size": block, "scale": scale}
    attrs |= {"key_group": key_group, "value_group": value_group, "wide": wide, "rope": rope}
    node = factory.create(attention.OP, [p.output(0) for p in params], attrs)
    return ov.Model([node.output(0)], params)


def _pools(*caches: np.ndarray) -> list[np.ndarray]:
    """The op's pool inputs for cache arrays (which must stay alive while it runs): address and blocks each."""
    return [attention.pool_input(c.ctypes.data, c.shape[0]) for c in caches]


def _reference(q, keys, values, scale, heads, kv_heads, head):
    """One sequence: q [heads * head], keys / values [tokens, kv_heads, head] -> [heads * head]."""
    group = heads // kv_heads
    out = np.empty((heads, head), np.float64)
    for h in range(heads):
        k, v = keys[:, h // group].astype(np.float64), values[:, h // group].astype(np.float64)
        s = k @ q[h * head : (h + 1) * head].astype(np.float64) * scale
        p = np.exp(s - s.max())
        out[h] = p @ v / p.sum()
    return out.ravel()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head", "lens", "groups"),
    [
        (9, 3, 64, [0, 31, 32, 700], (32, 0)),  # the default model's heads, keys in groups of 32 as served
        (9, 3, 64, [40], (0, 0)),  # one group a row
        (12, 2, 128, [511, 5], (32, 0)),  # Qwen2.5-1.5B's
        (12, 2, 128, [77], (16, 8)),  # groups under a 512-bit vector: the 256-bit kernels
        (4, 4, 8, [33], (0, 0)),  # no sharing, a tiny head
        (24, 8, 128, [1500], (32, 32)),  # Llama-3.2-3B's, a long context
        (2, 1, 64, [5000], (32, 0)),  # parts of the longest run
    ],
)
@pytest.mark.parametrize("wide", [1, 0])  # 0: the 256-bit kernels, which an AVX2 box runs, on any CPU
def test_op_matches_numpy_and_writes_the_new_token(loaded, heads, kv_heads, head, lens, groups, wide):
    core, got = loaded
    rng = np.random.default_rng(heads * 1000 + sum(lens))
    block, scale = 32, 1 / np.sqrt(head)
    key_group, value_group = (g or head for g in groups)
    seqs = len(lens)
    used = [(n + 1 + block - 1) // block for n in lens]
    pool = sum(used) + 3
    order = rng.permutation(pool).astype(np.int32)  # each sequence's blocks scattered over the pool
    tables = np.split(order[: sum(used)], np.cumsum(used)[:-1])
    caches = [np.zeros((pool, kv_heads, block, head // g * (8 + g)), np.uint8) for g in (key_group, value_group)]
    past = []
    for n, table in zip(lens, tables):
        x = [rng.standard_normal((n, kv_heads, head), np.float32) * 3 for _ in range(2)]
        x[0][..., 5] *= 20  # an outlier channel in the keys, as models have
        rows = [_quantize(v, g) for v, g in zip(x, (key_group, value_group))]
        for cache, r in zip(caches, rows):
            for i in range(n):
                cache[table[i // block], :, i % block] = r[i]
        past.append(rows)
    q = rng.standard_normal((seqs, heads * head), np.float32)
    k = rng.standard_normal((seqs, kv_heads * head), np.float32) * 2
    v = rng.standard_normal((seqs, kv_heads * head), np.float32)
    begins = np.concatenate([[0], np.cumsum(used)]).astype(np.int32)
    model = _op(got.factory, heads, kv_heads, head, block, float(scale), groups, wide)
    request = core.compile_model(model, "CPU", BY_TOKEN).create_infer_request()
    out = request.infer(
        [q, k, v, *_pools(*caches), np.asarray(lens, np.int32), np.concatenate(tables).astype(np.int32), begins]
    )[0]
    for s, (n, table) in enumerate(zip(lens, tables)):
        at = table[n // block], slice(None), n % block
        cached = []
        for cache, x, g, old in zip(caches, (k, v), (key_group, value_group), past[s]):
            want = _quantize(x[s].reshape(kv_heads, head), g).reshape(kv_heads, -1, 8 + g)
            written = cache[at].reshape(kv_heads, -1, 8 + g)
            assert np.array_equal(written[..., :8], want[..., :8])  # scales and zero points bit for bit
            assert np.abs(written[..., 8:].astype(int) - want[..., 8:]).max() <= 1  # a tie may round either way
            cached.append(_dequantize(np.concatenate([old, cache[at][None]]), g))
        want = _reference(q[s], *cached, scale, heads, kv_heads, head)
        np.testing.assert_allclose(out[s], want, rtol=0, atol=2e-5 * max(1.0, np.abs(want).max()))


def test_a_block_table_too_short_or_outside_the_pool_is_refused(loaded):
    core, got = loaded
    compiled = core.compile_model(_op(got.factory, 2, 1, 8, 4, 1.0), "CPU", BY_TOKEN)
    caches = np.zeros((2, 1, 4, 16), np.uint8), np.zeros((2, 1, 4, 16), np.uint8)
    x = np.ones((1, 16), np.float32), np.ones((1, 8), np.float32), np.ones((1, 8), np.float32)
    good = _pools(*caches)
    # the pools of unlike sizes; a null address
    bad = ([good[0], attention.pool_input(caches[1].ctypes.data, 3)], [attention.pool_input(0, 2), good[1]])
    for past, table, pools in (
        ([4], [0], good),
        ([1], [2], good),
        ([1], [-1], good),
        ([1], [0], bad[0]),
        ([1], [0], bad[1]),
    ):
        with pytest.raises(RuntimeError, match="DecodeAttention"):
            compiled.create_infer_request().infer(
                [*x, *pools, np.asarray(past, np.int32), np.asarray(table, np.int32), np.array([0, 1], np.int32)]
            )


def _rotated(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, head: int) -> np.ndarray:
    """HF's apply_rotary_pos_emb: x [T, heads * head] * cos + rotate_half(x) * sin, cos and sin [T, head]."""
    h = x.reshape(x.shape[0], -1, head)
    turned = np.concatenate([-h[..., head // 2 :], h[..., : head // 2]], -1)
    return (h * cos[:, None] + turned * sin[:, None]).reshape(x.shape)


@pytest.mark.parametrize(("heads", "kv_heads", "head"), [(9, 3, 64), (12, 2, 128), (4, 4, 8)])
def test_rope_rotates_q_and_k_as_the_graph_did(loaded, heads, kv_heads, head):
    """With `rope` the op takes q and k before their rotary embedding and cos / sin rows per sequence: its output and
    the key it writes are those of the op without it, fed q and k rotated in numpy."""
    core, got = loaded
    rng = np.random.default_rng(head)
    block, lens = 32, [45, 3]
    used = [(n + 1 + block - 1) // block for n in lens]
    tables = np.arange(sum(used), dtype=np.int32)
    begins = np.concatenate([[0], np.cumsum(used)]).astype(np.int32)
    group = 32 if head % 32 == 0 else head
    past = _quantize(rng.standard_normal((sum(used), kv_heads, block, head), np.float32), group)
    caches = {on: [past.copy(), past.copy()] for on in (0, 1)}
    q = rng.standard_normal((2, heads * head), np.float32)
    k = rng.standard_normal((2, kv_heads * head), np.float32)
    v = rng.standard_normal((2, kv_heads * head), np.float32)
    angles = rng.uniform(0, 50, (2, head // 2)).astype(np.float32)
    cos, sin = (np.concatenate([f(angles)] * 2, -1).astype(np.float32) for f in (np.cos, np.sin))
    out = {}
    for on in (0, 1):
        model = _op(got.factory, heads, kv_heads, head, block, 0.125, (group, group), rope=on)
        request = core.compile_model(model, "CPU", BY_TOKEN).create_infer_request()
        fed = [q, k] if on else [_rotated(q, cos, sin, head), _rotated(k, cos, sin, head)]
        extra = [cos, sin] if on else []
        out[on] = request.infer([*fed, v, *_pools(*caches[on]), np.asarray(lens, np.int32), tables, begins, *extra])[
            0
        ].copy()
    np.testing.assert_allclose(out[1], out[0], rtol=0, atol=1e-5 * np.abs(out[0]).max())
    written = [np.abs(a.astype(int) - b).max() for a, b in zip(caches[0], caches[1])]
    assert written[1] == 0 and written[0] <= 1, written  # values as given; a key's tie may round either way


def _backend(monkeypatch, on: bool, kv: str = "u8"):
    """The paged backend on the default int4 export, ours in its single-token graph, f32 but for the KV cache."""
    import appliance.runtime.backends.openvino_paged as paged
    from appliance.config import EngineConfig
    from appliance.manifest import Manifest
    from export.default_model import ensure_export

    monkeypatch.setenv(attention.ENV, "1" if on else "0")
    path = ensure_export("openvino", "int4")
    manifest = Manifest.load(path)
    config = EngineConfig(kernels="ours", precision="f32", kv_cache_precision=kv, kv_cache_tokens=512)
    return paged.OpenVINOPagedBackend(path, manifest, config), manifest.vocab_size


def _run(backend, vocab: int, feed: list[int] | None = None, steps: int = 6):
    """Prefill of a fixed 40-token prompt (the plugin's attention), `steps` single-token steps (the one-token graph),
    then one step of two tokens (the plugin's again, reading what the single-token steps wrote); each step's logits
    and the greedy tokens. `feed`: tokens to feed instead (teacher forcing, so two backends see one context)."""
    from appliance.runtime.backends.base import StepBatch

    prompt = np.random.default_rng(0).integers(100, vocab, 40).tolist()
    table = [4, 1, 6]  # scattered over the pool
    logits = [backend.forward(StepBatch([prompt], [0], [table]))[0].copy()]
    tokens = [int(logits[-1].argmax())]
    for i in range(steps + 1):
        fed = feed[i] if feed else tokens[-1]
        step = [fed, fed] if i == steps else [fed]
        logits.append(backend.forward(StepBatch([step], [len(prompt) + i], [table]))[0].copy())
        tokens.append(int(logits[-1].argmax()))
    return np.array(logits), tokens


def test_single_token_steps_run_ours_over_the_plugins_cache(loaded, monkeypatch, caplog):
    """The single-token graph runs DecodeAttention over the u8 cache by token (keys in groups of 32) with the pool's
    static shape, q's and k's rotary embedding inside it, and decodes as the plugin's attention over an f32 cache
    does, within the u8 cache's rounding; the step of the plugin's after ours reads the rows ours wrote."""
    base, vocab = _backend(monkeypatch, on=True, kv="f32")  # f32: the plugin's attention, no rounding of K/V
    try:
        assert not base.attention
        base_logits, base_tokens = _run(base, vocab)
    finally:
        base.close()
    with caplog.at_level(logging.INFO, logger=attention.__name__):
        ours, _ = _backend(monkeypatch, on=True)
    try:
        assert ours.attention
        assert "decode attention: ours on 30 layers, rotary embedding in the op on 30" in caplog.text
        runtime = ours._rows[1].get_compiled_model().get_runtime_model().get_ordered_ops()
        assert "RoPE" not in {op.get_rt_info()["layerType"].astype(str) for op in runtime}
        names = {p.get_any_name() for p in ours._rows[1].get_compiled_model().inputs}
        assert not {n for n in names if "_cache." in n}  # the op reads the pool by address: no input of its size
        reference = [n for n in runtime if n.get_rt_info()["layerType"].astype(str) == "Reference"]
        assert reference  # our ops run as the plugin's reference nodes
        logits, tokens = _run(ours, vocab, feed=base_tokens)
    finally:
        ours.close()
    tvd = logits_tvd(logits, base_logits)
    assert np.median(tvd) <= 0.02 and tvd.max() <= 0.05, tvd
    assert tokens == base_tokens, (tokens, base_tokens)


def test_cache_mode_groups_keys_by_32_where_the_head_splits():
    assert attention.cache_mode(128) == {"KEY_CACHE_QUANT_MODE": "BY_TOKEN", "KEY_CACHE_GROUP_SIZE": 32}
    assert attention.cache_mode(80) == {"KEY_CACHE_QUANT_MODE": "BY_TOKEN"}  # one group a row: ours take it
    assert attention.cache_mode(100) == {}


def test_a_cache_not_u8_keeps_the_plugins_attention(loaded, monkeypatch, caplog):
    caplog.set_level("INFO", logger="appliance.runtime.kernels.attention")
    backend, _ = _backend(monkeypatch, on=True, kv="f16")
    try:
        assert not backend.attention and list(backend._rows) == [1]  # no graphs of more rows for the plugin's
    finally:
        backend.close()
    assert "decode attention: openvino (the KV cache is not u8 by token)" in caplog.text


def test_rewrite_leaves_attention_it_does_not_compute(loaded):
    """A sliding window (or ALiBi, eviction, sinks) keeps the plugin's attention on every layer: none is rewritten."""
    core, got = loaded
    from export.default_model import ensure_export

    model = core.read_model(str(ensure_export("openvino", "int4") / "openvino_model.xml"))
    paged_attention_transformation(model)
    caches = {f"{kind}_cache.{i}": [3, 32, 72] for kind in ("key", "value") for i in range(30)}
    pools = {name: (4096, 8) for name in caches}  # never run: the graph is only rewritten
    nodes = [n for n in model.get_ordered_ops() if n.get_type_name() == attention.PAGED]
    window = nodes[3].input_value(attention.WINDOW).get_node()
    nodes[3].input(attention.WINDOW).replace_source_output(ops.constant(np.int32(64)).output(0))
    assert attention.rewrite(model, got.factory, caches, pools) == (0, 0)
    assert {p.get_friendly_name() for p in model.get_parameters()} >= set(caches)  # the plugin's attention reads them
    nodes[3].input(attention.WINDOW).replace_source_output(window.output(0))
    # a graph of dynamic shapes (tokens per step not fixed at one): the rotary embedding stays the graph's
    assert attention.rewrite(model, got.factory, caches, pools) == (len(nodes), 0) == (30, 0)
    assert {n.get_attributes()["wide"] for n in model.get_ordered_ops() if n.get_type_name() == attention.OP} == {1}
    assert not {p.get_friendly_name() for p in model.get_parameters()} & set(caches)  # ours read them by address


def test_a_forced_narrower_path_keeps_the_attention_to_256_bits(loaded):
    """APPLIANCE_KERNELS_ISA=avx2 (or avxvnni) on an AVX-512 CPU: the attention's ops are made narrow too."""
    _, got = loaded
    widest = replace(got, isa=got.supported[0])
    assert not attention.narrow_only(widest)
    assert [attention.narrow_only(replace(got, isa=isa)) for isa in widest.supported[1:]] == [True] * (
        len(widest.supported) - 1
    )
