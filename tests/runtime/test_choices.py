"""n > 1 choices of one prompt (Engine.submit_choices): the prompt is computed once, the other choices start from
its KV (full blocks shared by reference, the partly filled last block copied) and sample their first token from
the same logits. Checked on the default model in f32: what the backend is fed, the blocks held at the peak,
outputs equal to independent requests, and the fallbacks (a cancelled leader, a full pool). Greedy choices run
batched, the independent request alone: they are compared up to a near-tie of f32 arithmetic
(helpers.greedy_divergence); a choice with wrong KV parts where the answer is not a near-tie."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import replace

import numpy as np
import pytest

from appliance.config import EngineConfig
from appliance.outputs import GenerationResult
from appliance.params import SamplingParams
from appliance.runtime.engine import Engine, QueueFull
from tests.helpers import NEAR_TIE_F32, greedy_divergence

NEW = 12
PROMPT_LEN = 70  # not a multiple of the 32-token block: the last prompt block is copied, not shared


@pytest.fixture(scope="module")
def engine(model_dir):
    e = Engine(model_dir, EngineConfig(precision="f32", prefix_caching=False, max_num_batched_tokens=128))
    yield e
    e.shutdown()


def prompt(engine, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, engine.manifest.vocab_size - 100, PROMPT_LEN).tolist()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, **kw)


def alone(engine, ids: list[int]) -> GenerationResult:
    """The prompt's greedy answer as a request of its own, with the candidates at each token."""
    return engine.submit(ids, greedy(logprobs=3)).results()[0]


def assert_same_greedy(reference: GenerationResult, others: list[list[int]]) -> None:
    candidates = [{i: lp for i, _, lp in e.top} | {e.token_id: e.logprob} for e in reference.logprobs]
    for j, tokens in enumerate(others):
        greedy_divergence(reference.token_ids, candidates, tokens, NEAR_TIE_F32, f"choice {j}")


@contextlib.contextmanager
def watch(engine):
    """Tokens fed per forward call and the most KV blocks held during one."""
    seen = {"fed": [], "peak": 0}
    forward = engine.backend.forward

    def counted(batch):
        seen["fed"].append(batch.num_tokens)
        seen["peak"] = max(seen["peak"], engine.pool.num_used)
        return forward(batch)

    engine.backend.forward = counted
    try:
        yield seen
    finally:
        del engine.backend.forward


def test_prompt_computed_once_blocks_shared_outputs_equal(engine):
    ids, n = prompt(engine, 1), 4
    reference = alone(engine, ids)
    before = engine.pool.num_used
    with watch(engine) as seen:
        results = [h.results()[0] for h in engine.submit_choices(ids, [greedy()] * n)]
    assert_same_greedy(reference, [r.token_ids for r in results])  # the copied tail block holds the right KV
    assert sum(seen["fed"]) == PROMPT_LEN + n * (NEW - 1)  # not n * PROMPT_LEN
    bs = engine.pool.block_size
    blocks, shared = engine.pool.blocks_for(PROMPT_LEN + NEW - 1), PROMPT_LEN // bs
    assert seen["peak"] == blocks + (n - 1) * (blocks - shared)
    assert engine.pool.num_used == before
    assert all(r.prompt_tokens == PROMPT_LEN and r.completion_tokens == NEW for r in results)


def test_seeded_choices_equal_independent_requests(engine):
    ids = prompt(engine, 2)
    params = [
        SamplingParams(max_tokens=NEW, temperature=1.0, top_k=50, seed=100 + j, ignore_eos=True) for j in range(3)
    ]
    independent = [engine.submit(ids, p).results()[0].token_ids for p in params]
    together = [h.results()[0].token_ids for h in engine.submit_choices(ids, params)]
    assert together == independent
    assert len({tuple(t) for t in together}) > 1  # the seeds differ, so do the choices


def test_prompt_logprobs_reach_every_choice(engine):
    ids = prompt(engine, 3)
    results = [h.results()[0] for h in engine.submit_choices(ids, [greedy(prompt_logprobs=1)] * 2)]
    first, second = (r.prompt_logprobs for r in results)
    assert len(first) == PROMPT_LEN and [e.token_id for e in first] == ids
    assert [(e.token_id, e.logprob) for e in second] == [(e.token_id, e.logprob) for e in first]


def test_cancelled_leader_leaves_the_others_whole(engine):
    ids = prompt(engine, 4)
    reference = alone(engine, ids)
    before = engine.pool.num_used
    handles = engine.submit_choices(ids, [greedy()] * 3)
    handles[0].cancel()  # before or after the fork: the others must not notice
    leader = list(handles[0])[-1]
    assert leader.finish_reason in ("abort", "length")
    assert_same_greedy(reference, [h.results()[0].token_ids for h in handles[1:]])
    assert engine.pool.num_used == before


def test_full_pool_falls_back_to_own_prefill(model_dir):
    """A pool of 4 blocks: the leader's prompt takes 3, one follower gets the last for its copy, the other two
    compute their own prompts once blocks are free again (recompute, not a failure), with the same output."""
    e = Engine(model_dir, EngineConfig(precision="f32", prefix_caching=False, kv_cache_tokens=4 * 32))
    try:
        ids = prompt(e, 5)
        reference = alone(e, ids)
        with watch(e) as seen:
            results = [h.results()[0].token_ids for h in e.submit_choices(ids, [greedy()] * 4)]
        assert_same_greedy(reference, results)
        assert e.pool.num_blocks == 4 and e.pool.blocks_for(PROMPT_LEN) == 3
        assert sum(seen["fed"]) >= 3 * PROMPT_LEN + 4 * (NEW - 1)  # two followers computed their own prompt
        assert e.pool.num_used == 0
    finally:
        e.shutdown()


def test_leader_failing_to_start_hands_over(engine, monkeypatch):
    ids = prompt(engine, 6)
    reference = alone(engine, ids)
    start = Engine._start

    def flaky(self, seq, scheduled=True):
        if seq.request_id == "lead":
            raise RuntimeError("boom")
        return start(self, seq, scheduled)

    monkeypatch.setattr(Engine, "_start", flaky)
    handles = engine.submit_choices(ids, [greedy()] * 3, ["lead", "b", "c"])
    with pytest.raises(RuntimeError, match="internal error"):
        handles[0].results()[0]
    assert_same_greedy(reference, [h.results()[0].token_ids for h in handles[1:]])
    assert engine.scheduler.running == [] and not engine.scheduler.waiting


def test_prompts_submitted_together_prefill_in_one_step(engine):
    """Engine.submit_prompts: several prompts with their choices reach the scheduler in the same step (their
    prompts fill the first forward call together), each answers as it would alone."""
    ids = [prompt(engine, 10 + i)[:40] for i in range(3)]
    references = [alone(engine, p) for p in ids]
    before = engine.stats()
    with watch(engine) as seen:
        handles = engine.submit_prompts([(p, [greedy()] * 2, None) for p in ids])
        results = [[h.results()[0].token_ids for h in hs] for hs in handles]
    for reference, tokens in zip(references, results):
        assert_same_greedy(reference, tokens)
    after = engine.stats()  # counted per prompt, not per choice
    assert (after["requests"] - before["requests"], after["prompt_tokens"] - before["prompt_tokens"]) == (3, 3 * 40)
    assert seen["fed"][0] == 3 * 40  # every prompt in the first step (128-token budget)
    assert sum(seen["fed"]) == 3 * 40 + 6 * (NEW - 1)


def test_prompts_queued_all_or_none(engine, monkeypatch):
    monkeypatch.setattr(engine, "config", replace(engine.config, max_queued=3))
    before = engine.stats()["requests"]
    with pytest.raises(QueueFull):
        engine.submit_prompts([(prompt(engine, 20), [greedy()] * 2, None), (prompt(engine, 21), [greedy()] * 2, None)])
    engine.submit(prompt(engine, 22), greedy()).results()[0]  # the engine goes on; nothing of the refused one ran
    assert engine.stats()["requests"] == before + 1


def test_queue_limit_counts_sequences(engine, monkeypatch):
    """max_queued counts queued sequences, whether still in the inbox or in the scheduler (a choice waiting for
    its prompt included), not submissions: with the engine thread held, a 2-choice request and one waiting
    sequence fill a queue of 3, so one more sequence is refused."""
    monkeypatch.setattr(engine, "config", replace(engine.config, max_queued=3))
    entered, gate, step = threading.Event(), threading.Event(), engine.step

    def held():
        entered.set()
        assert gate.wait(60)
        step()

    monkeypatch.setattr(engine, "step", held)
    try:
        first = engine.submit(prompt(engine, 30), greedy())
        assert entered.wait(60)  # taken into the scheduler's waiting list
        pair = engine.submit_choices(prompt(engine, 31), [greedy()] * 2)
        assert engine.stats()["queued"] == 3
        with pytest.raises(QueueFull):
            engine.submit(prompt(engine, 32), greedy())
    finally:
        gate.set()
    assert [len(h.results()[0].token_ids) for h in [first, *pair]] == [NEW] * 3
    assert engine.stats()["queued"] == 0
