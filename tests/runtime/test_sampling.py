"""appliance.runtime.sampling: every processor against a hand computation, and sampling statistics with fixed seeds."""

from __future__ import annotations

import numpy as np
import pytest

from appliance.params import SamplingParams
from appliance.runtime.sampling import SequenceSampler, _top_p_full, apply_processors, ranked, sample_batch

EOS = [0]


def seq(prompt=(), **kw) -> SequenceSampler:
    return SequenceSampler(SamplingParams(**kw), prompt_ids=list(prompt), eos_ids=EOS)


def log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))


def draw_many(row, n=4000, **kw) -> np.ndarray:
    """n independent draws of one distribution: n sequences (seeds 0..n-1) in one batch."""
    row = np.asarray(row, np.float32)
    seqs = [seq(seed=i, **kw) for i in range(n)]
    return sample_batch(np.broadcast_to(row, (n, len(row))), seqs).token_ids


def support(row, n=3000, **kw) -> set[int]:
    return set(draw_many(row, n, **kw).tolist())


def assert_follows(tokens, probs, vocab):
    """Chi-square goodness of fit, generous bound: deterministic under the fixed seeds, yet a real bias fails."""
    probs = np.asarray(probs, np.float64)
    counts = np.bincount(tokens, minlength=vocab)
    assert counts[probs == 0].sum() == 0, "sampled a token with zero probability"
    exp = probs[probs > 0] * len(tokens)
    chi2 = (((counts[probs > 0] - exp) ** 2) / exp).sum()
    dof = max(int((probs > 0).sum()) - 1, 1)
    assert chi2 < dof + 6 * np.sqrt(2 * dof), (chi2, dof, counts, exp)


LOGITS = np.log(np.array([0.05, 0.4, 0.25, 0.15, 0.1, 0.05], np.float32))  # probs by id, distinct ranks


# -- ranking ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("V,m", [(10, 3), (5000, 5), (5000, 40), (5000, 300), (4099, 64), (300, 300)])
def test_ranked_matches_full_sort_with_ties(V, m):
    rng = np.random.default_rng(V + m)
    x = rng.integers(-20, 20, (6, V)).astype(np.float32)  # many ties
    x[1] = 3.0  # a row that is one big tie
    x[2, : V // 2] = -np.inf
    ref = np.lexsort((np.broadcast_to(np.arange(V), x.shape), -x), axis=1)[:, :m]  # value desc, then id asc
    np.testing.assert_array_equal(ranked(x, m), ref)


# -- greedy -----------------------------------------------------------------------------------------------------


def test_greedy_is_argmax_lowest_id_on_ties():
    logits = np.array([[1, 5, 5, 2], [9, 0, 9, 9], [0, 0, 0, 0]], np.float32)
    out = sample_batch(logits, [seq(), seq(), seq()])
    assert out.token_ids.tolist() == [1, 0, 0]
    assert out.token_ids.dtype == np.int64


def test_tiny_temperature_is_greedy_and_ignores_truncation():
    logits = np.array([[0.1, 0.3, 0.2]], np.float32)
    for t in (0.0, 1e-6):
        assert sample_batch(logits, [seq(temperature=t, top_k=1, top_p=0.1)]).token_ids[0] == 1


# -- temperature, top_k, top_p, min_p --------------------------------------------------------------------------


def test_temperature_one_follows_softmax():
    assert_follows(draw_many(LOGITS, temperature=1.0), np.exp(log_softmax(LOGITS)), len(LOGITS))


def test_temperature_scales_distribution():
    for t in (0.5, 2.0):
        p = np.exp(log_softmax(LOGITS / t))
        assert_follows(draw_many(LOGITS, temperature=t), p, len(LOGITS))


def test_temperature_limits():
    big = draw_many(LOGITS, temperature=1e4)  # flat
    assert_follows(big, np.full(len(LOGITS), 1 / len(LOGITS)), len(LOGITS))
    small = draw_many(LOGITS, n=500, temperature=1e-3)  # sharp but still sampling: the mode every time
    assert set(small.tolist()) == {1}


def test_top_k_keeps_exactly_k():
    assert support(LOGITS, temperature=1.0, top_k=1) == {1}
    assert support(LOGITS, temperature=1.0, top_k=3) == {1, 2, 3}
    assert support(LOGITS, temperature=1.0, top_k=-1) == set(range(6))
    assert support(LOGITS, temperature=1.0, top_k=100) == set(range(6))
    ties = np.array([0, 3, 3, 3, 3, -1], np.float32)
    assert support(ties, temperature=1.0, top_k=2) == {1, 2}  # exactly k, ties to the lowest ids


def test_top_k_renormalises():
    p = np.array([0, 0.4, 0.25, 0.15, 0, 0]) / 0.8
    assert_follows(draw_many(LOGITS, temperature=1.0, top_k=3), p, 6)


def test_top_p_minimal_nucleus():
    # sorted probs 0.4, 0.25, 0.15, 0.1, 0.05, 0.05 -> cumulative 0.4, 0.65, 0.8, 0.9, ...
    assert support(LOGITS, temperature=1.0, top_p=0.3) == {1}
    assert support(LOGITS, temperature=1.0, top_p=0.6) == {1, 2}
    assert support(LOGITS, temperature=1.0, top_p=0.7) == {1, 2, 3}
    assert support(LOGITS, temperature=1.0, top_p=0.85) == {1, 2, 3, 4}
    assert support(LOGITS, temperature=1.0, top_p=1.0) == set(range(6))
    p = np.array([0, 0.4, 0.25, 0.15, 0, 0]) / 0.8
    assert_follows(draw_many(LOGITS, temperature=1.0, top_p=0.7), p, 6)


def test_top_p_after_top_k_is_renormalised():
    # top_k=2 leaves 0.4/0.65, 0.25/0.65 = 0.615, 0.385: top_p=0.6 then keeps only the first
    assert support(LOGITS, temperature=1.0, top_k=2, top_p=0.6) == {1}
    assert support(LOGITS, temperature=1.0, top_k=2, top_p=0.62) == {1, 2}


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.99, 0.999])
def test_top_p_large_vocab_matches_full_sort(top_p):
    """Nuclei from one token to most of the vocabulary, far beyond the first 64 candidates: the staged search
    must keep exactly what a full sort keeps."""
    V = 20000
    rng = np.random.default_rng(3)
    x = np.stack([rng.standard_normal(V) * s for s in (0.3, 1.0, 3.0, 8.0)]).astype(np.float32)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    ids, w = _top_p_full(e.copy(), np.full(len(x), top_p))
    for r in range(len(x)):
        p = e[r] / e[r].sum(dtype=np.float64)
        order = np.lexsort((np.arange(V), -e[r]))
        excl = np.cumsum(p[order]) - p[order]
        ref = set(order[excl < top_p].tolist()) | {int(order[0])}
        got = set(ids[r][w[r] > 0].tolist())
        edge = {int(i) for i, c in zip(order, excl) if abs(c - top_p) < 1e-6}  # float-rounding ties only
        assert got ^ ref <= edge, (r, len(got), len(ref))
        assert 1 <= len(got) < V or top_p > 0.99


def test_top_p_sampling_large_vocab():
    rng = np.random.default_rng(4)
    row = (rng.standard_normal(3000) * 2).astype(np.float32)
    p = np.exp(log_softmax(row))
    order = np.argsort(-p, kind="stable")
    nucleus = order[np.cumsum(p[order]) - p[order] < 0.9]
    assert len(nucleus) > 64
    assert support(row, n=800, temperature=1.0, top_p=0.9) <= set(nucleus.tolist())


def test_min_p():
    # p / p_max: 0.125, 1, 0.625, 0.375, 0.25, 0.125
    assert support(LOGITS, temperature=1.0, min_p=0.5) == {1, 2}
    assert support(LOGITS, temperature=1.0, min_p=0.3) == {1, 2, 3}
    assert support(LOGITS, temperature=1.0, min_p=0.3, top_k=5, top_p=0.99) == {1, 2, 3}
    p = np.array([0, 0.4, 0.25, 0.15, 0, 0]) / 0.8
    assert_follows(draw_many(LOGITS, temperature=1.0, min_p=0.3), p, 6)


def test_full_vocab_draw_follows_distribution_odd_vocab():
    V = 1000  # not a multiple of the 64-id blocks
    rng = np.random.default_rng(5)
    row = (rng.standard_normal(V) * 1.5).astype(np.float32)
    row[-3:] = 6.0  # mass in the ragged last block
    tokens = draw_many(row, n=6000, temperature=1.0)
    p = np.exp(log_softmax(row))
    top = np.argsort(-p)[:8]  # test the heavy tokens individually, the tail as one bucket
    counts = np.bincount(tokens, minlength=V)
    merged_obs = np.append(counts[top], len(tokens) - counts[top].sum())
    merged_p = np.append(p[top], 1 - p[top].sum())
    assert_follows(np.repeat(np.arange(9), merged_obs), merged_p, 9)


# -- penalties and bias (processors, checked on the logits) ------------------------------------------------------


def test_repetition_penalty_matches_transformers_rule():
    logits = np.array([[2.0, -2.0, 1.0, -1.0, 0.5]], np.float32)
    s = seq(prompt=[0, 1], repetition_penalty=2.0)
    s.append(3)
    s.append(3)
    out = apply_processors(logits, [s])
    np.testing.assert_allclose(out, [[1.0, -4.0, 1.0, -2.0, 0.5]])  # positive / 2, negative * 2, once per token


def test_frequency_and_presence_penalties_generated_only():
    logits = np.zeros((1, 5), np.float32)
    s = seq(prompt=[4, 4, 4], frequency_penalty=0.5, presence_penalty=0.25)
    for t in (1, 1, 1, 2):
        s.append(t)
    out = apply_processors(logits, [s])
    np.testing.assert_allclose(out, [[0, -(3 * 0.5 + 0.25), -(0.5 + 0.25), 0, 0]])  # prompt token 4 untouched


def test_penalties_combine_in_order():
    logits = np.array([[4.0, 1.0]], np.float32)
    s = seq(prompt=[0], repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5)
    s.append(0)
    np.testing.assert_allclose(apply_processors(logits, [s]), [[4.0 / 2 - 1.0 - 0.5, 1.0]])


def test_logit_bias():
    logits = np.array([[1.0, 2.0, 3.0]], np.float32)
    s = seq(logit_bias={0: 5.0, 2: -100.0, 99: 1.0})  # ids outside the vocabulary are ignored
    np.testing.assert_allclose(apply_processors(logits, [s]), [[6.0, 2.0, -97.0]])
    assert sample_batch(logits, [s]).token_ids[0] == 0


def test_processors_leave_input_alone_and_skip_neutral_rows():
    logits = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    before = logits.copy()
    out = apply_processors(logits, [seq(logit_bias={0: 1.0}), seq()])
    np.testing.assert_array_equal(logits, before)
    np.testing.assert_array_equal(out, [[2.0, 2.0], [3.0, 4.0]])
    assert apply_processors(logits, [seq(), seq()]) is logits  # nothing to do: no copy


def test_min_tokens_masks_stop_tokens():
    logits = np.array([[9.0, 1.0, 2.0, 8.0]], np.float32)  # EOS (0) is the favourite
    s = seq(min_tokens=2, stop_token_ids=[3])
    assert sample_batch(logits, [s]).token_ids[0] == 2  # EOS and stop id 3 both masked
    s.append(2)
    assert sample_batch(logits, [s]).token_ids[0] == 2
    s.append(2)
    assert sample_batch(logits, [s]).token_ids[0] == 0  # min_tokens reached
    s2 = seq(min_tokens=2, stop_token_ids=[3], ignore_eos=True)  # EOS is no stop token then: not masked
    assert sample_batch(logits, [s2]).token_ids[0] == 0


def test_everything_masked_falls_back_to_raw_logits():
    logits = np.array([[1.0, 3.0]], np.float32)
    s = seq(logit_bias={0: -np.inf, 1: -np.inf})
    assert sample_batch(logits, [s]).token_ids[0] == 1


# -- seeds and batches ------------------------------------------------------------------------------------------


def generate(logit_steps, seqs, watch):
    """Run steps over a batch, appending every token; return the watched sequence's tokens."""
    toks = []
    for step in logit_steps:
        out = sample_batch(step[: len(seqs)], seqs)
        for s, t in zip(seqs, out.token_ids):
            s.append(t)
        toks.append(int(out.token_ids[watch]))
    return toks


def test_seed_reproducible_regardless_of_batch():
    rng = np.random.default_rng(0)
    V = 3000
    steps = [(rng.standard_normal((6, V)) * 3).astype(np.float32) for _ in range(25)]
    kw = dict(temperature=0.9, top_p=0.95, top_k=200, repetition_penalty=1.2, seed=1234)
    alone = generate([s[[3]] for s in steps], [seq(**kw)], 0)
    others = [seq(), seq(temperature=1.0), seq(temperature=0.7, top_p=0.5), seq(temperature=1.3, min_p=0.1)]
    mixed = generate(steps, others[:3] + [seq(**kw)] + others[3:], 3)  # same logits row, position 3
    assert alone == mixed
    again = generate([s[[3]] for s in steps], [seq(**kw)], 0)
    assert again == alone
    other_seed = generate([s[[3]] for s in steps], [seq(**{**kw, "seed": 99})], 0)
    assert other_seed != alone


@pytest.mark.parametrize("kw", [dict(), dict(top_k=20), dict(top_p=0.8)])
def test_seed_same_in_every_group(kw):
    """The same seeded row sampled alongside rows that take different code paths."""
    rng = np.random.default_rng(1)
    V = 5000
    row = (rng.standard_normal(V) * 2).astype(np.float32)
    a = sample_batch(row[None], [seq(temperature=1.0, seed=7, **kw)]).token_ids[0]
    batch = np.stack([row[::-1], row, row * 2])
    seqs = [seq(temperature=1.0, top_k=5, seed=1), seq(temperature=1.0, seed=7, **kw), seq(temperature=1.0, seed=3)]
    assert sample_batch(batch, seqs).token_ids[1] == a


def test_unseeded_sequences_differ_and_children_are_distinct():
    row = np.zeros(1000, np.float32)
    a = [int(sample_batch(row[None], [seq(temperature=1.0)]).token_ids[0]) for _ in range(5)]
    assert len(set(a)) > 1
    p = SamplingParams(temperature=1.0, seed=5)
    kids = [SequenceSampler(p, seq_index=i) for i in range(4)]
    toks = sample_batch(np.broadcast_to(row, (4, 1000)), kids).token_ids
    assert len(set(toks.tolist())) > 1
    assert toks[0] == sample_batch(row[None], [SequenceSampler(p)]).token_ids[0]  # child 0 == plain seed


# -- logprobs ---------------------------------------------------------------------------------------------------


def test_logprobs_are_raw_and_top_k_sorted():
    rng = np.random.default_rng(2)
    V = 5000
    logits = (rng.standard_normal((3, V)) * 4).astype(np.float32)
    logits[2, [10, 20, 30]] = 50.0  # ties at the top: lowest id first
    seqs = [seq(temperature=0.5, logit_bias={7: 100.0}, logprobs=5), seq(logprobs=2), seq(logprobs=1)]
    out = sample_batch(logits, seqs)
    ref = log_softmax(logits)
    assert out.token_ids[0] == 7  # the bias decided the token...
    np.testing.assert_allclose(out.logprobs, ref[np.arange(3), out.token_ids], rtol=1e-5, atol=1e-5)  # ...not logprob
    assert out.top_ids.shape == (3, 5) and out.top_logprobs.shape == (3, 5)
    assert out.top_logprobs.dtype == np.float32 and out.logprobs.dtype == np.float32
    for r in range(3):
        ref_ids = np.lexsort((np.arange(V), -ref[r]))[:5]
        np.testing.assert_array_equal(out.top_ids[r], ref_ids)
        np.testing.assert_allclose(out.top_logprobs[r], ref[r, ref_ids], rtol=1e-5, atol=1e-5)
        assert np.all(np.diff(out.top_logprobs[r]) <= 0)
    assert out.top_ids[2, :3].tolist() == [10, 20, 30]


def test_no_logprobs_requested():
    out = sample_batch(np.zeros((2, 10), np.float32), [seq(), seq(logprobs=0)])
    assert out.top_ids.shape == (2, 0) and out.top_logprobs.shape == (2, 0)
    assert np.isnan(out.logprobs[0])  # not asked: the log-softmax pass is skipped for that row
    np.testing.assert_allclose(out.logprobs[1], np.log(0.1), rtol=1e-6)


def test_logprobs_only_for_rows_that_ask():
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((4, 300)) * 3).astype(np.float32)
    out = sample_batch(logits, [seq(), seq(logprobs=3), seq(), seq(logprobs=1)])
    ref = log_softmax(logits)
    assert np.isnan(out.logprobs[[0, 2]]).all() and np.isnan(out.top_logprobs[[0, 2]]).all()
    np.testing.assert_allclose(out.logprobs[[1, 3]], ref[[1, 3], out.token_ids[[1, 3]]], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.top_logprobs[1], np.sort(ref[1])[::-1][:3], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.top_logprobs[3, 0], ref[3].max(), rtol=1e-5, atol=1e-5)


def test_batch_size_mismatch_raises():
    with pytest.raises(ValueError):
        sample_batch(np.zeros((2, 10), np.float32), [seq()])


def test_stop_set_is_eos_and_stop_token_ids_as_a_frozenset():
    s = SequenceSampler(SamplingParams(stop_token_ids=[9, 9, 4]), eos_ids=[2])
    assert s.stop_set == frozenset({2, 4, 9}) and s.stop_ids.tolist() == [2, 4, 9]
    kept = SequenceSampler(SamplingParams(stop_token_ids=[9], ignore_eos=True), eos_ids=[2])
    assert kept.stop_set == frozenset({9})
