"""Graphs of static shapes for steps of a few tokens (backends/row_graphs.py): a step's inputs laid out as rows, and
the paged backend running steps of up to 8 tokens on them (several sequences, or one sequence's verification) with
the logits those tokens get one step at a time.

The library is built by `make venv`; when it is missing the backend tests skip, except under CI=true, where they
fail."""

from __future__ import annotations

import numpy as np
import pytest

from appliance.runtime.backends import row_graphs
from tests.helpers import logits_tvd


def test_row_inputs_give_each_token_its_position_and_its_sequences_blocks():
    """Two sequences (2 tokens at past 5 over blocks [7, 3]; 1 token at past 0 over [9]) in a graph of 4 rows with
    tables of 3: rows at positions 5, 6, 0 and the last one repeated; each row's blocks packed, the rest zeros."""
    ids = np.array([11, 12, 13], np.int64)
    positions = np.array([5, 6, 0], np.int64)
    lens, used = np.array([2, 1]), np.array([2, 1])
    blocks, block_begins = np.array([7, 3, 9], np.int32), np.array([0, 2, 3], np.int32)
    got = row_graphs.row_inputs(4, 3, ids, positions, lens, used, blocks, block_begins)
    assert got["input_ids"].tolist() == [11, 12, 13, 13]
    assert got["position_ids"].tolist() == got["past_lens"].tolist() == [5, 6, 0, 0]
    assert got["past_lens"].dtype == np.int32
    assert got["subsequence_begins"].tolist() == [0, 1, 2, 3, 4]
    assert got["block_indices_begins"].tolist() == [0, 2, 4, 5, 6]
    assert got["block_indices"].tolist() == [7, 3, 7, 3, 9, 9] + [0] * 6


def test_rows_wanted_always_start_with_one(monkeypatch):
    monkeypatch.delenv(row_graphs.ROWS_ENV, raising=False)
    assert row_graphs.rows_wanted() == row_graphs.ROWS
    monkeypatch.setenv(row_graphs.ROWS_ENV, "4, 2")
    assert row_graphs.rows_wanted() == (1, 2, 4)


@pytest.fixture(scope="module")
def backend(loaded):
    """The paged backend on the default int4 export, ours and our attention in its graphs of rows."""
    import appliance.runtime.backends.openvino_paged as paged
    from appliance.config import EngineConfig
    from appliance.manifest import Manifest
    from export.default_model import ensure_export

    path = ensure_export("openvino", "int4")
    manifest = Manifest.load(path)
    backend = paged.OpenVINOPagedBackend(path, manifest, EngineConfig(kernels="ours", kv_cache_tokens=1024))
    yield backend, manifest.vocab_size
    backend.close()


PROMPT = 40
BOUND = 0.06, 0.1  # next-token TVD, median and max, between a step's rows and the same tokens one step at a time


def _prefilled(backend, vocab: int, table: list[int], seed: int) -> list[int]:
    from appliance.runtime.backends.base import StepBatch

    prompt = np.random.default_rng(seed).integers(100, vocab, PROMPT).tolist()
    backend.forward(StepBatch([prompt], [0], [table]))
    return prompt


def _one_at_a_time(backend, tokens: list[int], table: list[int]) -> np.ndarray:
    from appliance.runtime.backends.base import StepBatch

    return np.stack([backend.forward(StepBatch([[t]], [PROMPT + i], [table]))[0].copy() for i, t in enumerate(tokens)])


@pytest.mark.parametrize("fed", [2, 5, 7])  # 5 and 7: a step of fewer tokens than its graph's rows
def test_a_sequences_tokens_of_one_step_attend_causally_on_the_rows(backend, fed):
    """One sequence feeding `fed` tokens with every position's logits (speculative verification) runs the graph of
    the next rows up, and each position's logits are those of the tokens fed one step at a time (the same prompt
    in other blocks) up to the arithmetic's rounding: the rows attend causally over what the step wrote. (The
    kernels' paths for one row and for more round differently, which the int8 activations of the layers after carry:
    0.02-0.04 on these random prompts; rows attending to every token of the step were 0.25-0.64 from it.)"""
    from appliance.runtime.backends.base import StepBatch

    backend, vocab = backend
    tables = [[0, 1, 2], [3, 4, 5]]
    for table in tables:
        _prefilled(backend, vocab, table, seed=fed)
    tokens = np.random.default_rng(fed + 1).integers(100, vocab, fed).tolist()
    assert backend.request_for(fed) is backend._rows[min(r for r in backend._rows if r >= fed)]
    step = StepBatch([tokens], [PROMPT], tables[:1], all_logits=[True])
    backend.forward(step)
    together = step.position_logits[0]
    apart = _one_at_a_time(backend, tokens, tables[1])
    tvd = logits_tvd(together, apart)
    assert np.median(tvd) <= BOUND[0] and tvd.max() <= BOUND[1], tvd


def test_sequences_decoding_together_on_the_rows_get_their_own_logits(backend):
    """Three sequences, one token each, in a graph of rows: each gets the logits it gets decoding alone, over its
    own blocks."""
    from appliance.runtime.backends.base import StepBatch

    backend, vocab = backend
    tables = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    for i, table in enumerate(tables):
        _prefilled(backend, vocab, table, seed=100 + i % 3)  # sequences 3-5 repeat 0-2 in other blocks
    tokens = [[101], [202], [303]]
    together = backend.forward(StepBatch(tokens, [PROMPT] * 3, tables[:3])).copy()
    assert backend.request_for(3) is backend._rows[min(r for r in backend._rows if r >= 3)]
    alone = np.stack([_one_at_a_time(backend, t, table)[0] for t, table in zip(tokens, tables[3:])])
    tvd = logits_tvd(together, alone)
    assert np.median(tvd) <= BOUND[0] and tvd.max() <= BOUND[1], tvd


def test_a_step_past_the_largest_graph_runs_the_dynamic_one(backend):
    backend, _ = backend
    assert list(backend._rows) == list(row_graphs.ROWS) and backend.attention
    assert backend.request_for(max(row_graphs.ROWS) + 1) not in backend._rows.values()
    shapes = {p.get_any_name(): p.get_partial_shape() for p in backend._rows[8].model_inputs}
    assert shapes["input_ids"].is_static and shapes["input_ids"][0].get_length() == 8
    assert shapes["logits_indices"].is_dynamic  # a step needs its sequences' last tokens' logits, not every row's


def test_an_f16_cache_shares_one_pool_with_the_graph_of_one_row(loaded):
    """Asked for an f16 KV cache, the plugin lays it out in bf16 under its bf16 default (CPUs with AVX512-BF16 or
    AMX) and in f16 under f32 inference: the graph of one row then keeps the plugin's precision, so the pool binds
    to every graph (the engine failed to load before), and its single-token steps give the dynamic graph's
    logits up to the kernels' rounding."""
    import appliance.runtime.backends.openvino_paged as paged
    from appliance.config import EngineConfig
    from appliance.manifest import Manifest
    from appliance.runtime.backends.base import StepBatch
    from export.default_model import ensure_export

    path = ensure_export("openvino", "int4")
    manifest = Manifest.load(path)
    config = EngineConfig(kernels="ours", kv_cache_precision="f16", kv_cache_tokens=1024)
    backend = paged.OpenVINOPagedBackend(path, manifest, config)
    try:
        assert backend.kv_precision in ("f16", "bf16") and 1 in backend._rows
        prompt = np.random.default_rng(3).integers(100, manifest.vocab_size, PROMPT).tolist()
        backend.forward(StepBatch([prompt], [0], [[0, 1]]))
        backend.forward(StepBatch([prompt], [0], [[2, 3]]))
        rows = backend.forward(StepBatch([[101]], [PROMPT], [[0, 1]])).copy()
        backend._rows, rows_kept = {}, backend._rows  # the same step on the graph of dynamic shapes
        dynamic = backend.forward(StepBatch([[101]], [PROMPT], [[2, 3]])).copy()
        backend._rows = rows_kept
    finally:
        backend.close()
    assert logits_tvd(rows, dynamic).max() <= BOUND[1]


def test_every_graph_of_rows_rotates_q_and_k_in_our_attention(backend):
    """The rotary embedding of every graph of rows is our attention's (kernels/rope.py: one row of cos and sin per
    token): no rotation node is left in any compiled graph (the tests above: their steps still match one token at a
    time)."""
    backend, _ = backend
    assert len(backend._rows) > 1
    for rows, request in backend._rows.items():
        runtime = request.get_compiled_model().get_runtime_model().get_ordered_ops()
        kinds = {op.get_rt_info()["layerType"].astype(str) for op in runtime}
        assert "RoPE" not in kinds, (rows, kinds)
