"""Fault isolation inside the engine: one request's failure ends that request alone, a failed backend call ends
its step's requests and the engine goes on, a dead engine thread says so (Engine.dead, on_death, alive) and ends
every request. On a tiny random llama exported in fp32 (fast steps); the failures are injected by wrapping one
engine function or with Engine.inject_fault."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import appliance.runtime.engine as engine_mod
import appliance.runtime.engine.core as engine_core  # the step's sampling and logprobs calls
from appliance.config import EngineConfig
from appliance.params import SamplingParams
from appliance.runtime.beam_search import WIDTH_STOP_TOKENS, BeamSearch
from appliance.runtime.engine import STOP_WINDOW_TOKENS, Engine, EngineDead

NEW = 24
BAD_SEED = 666  # marks the request whose part of the step is made to raise


def tiny_engine(exported) -> Engine:
    out, _ = exported("llama", "openvino", "fp32")
    return Engine(out, EngineConfig(precision="f32", max_num_batched_tokens=64, kv_cache_tokens=64 * 32))


@pytest.fixture(scope="module")
def engine(exported):
    e = tiny_engine(exported)
    yield e
    e.shutdown()


def prompt(seed: int, n: int = 20) -> list[int]:
    return np.random.default_rng(seed).integers(10, 900, n).tolist()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": NEW, "temperature": 0.0, "ignore_eos": True, **kw})


def finished_normally(results) -> None:
    for r in results:
        assert r.finish_reason == "length" and r.completion_tokens == NEW and len(r.token_ids) == NEW


def settled(engine: Engine) -> None:
    """Every request is over: nothing queued or running, no KV block held."""
    deadline = time.monotonic() + 10
    while engine.scheduler.has_work() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats()["queued"] == 0 and not engine.scheduler.running
    assert engine.pool.num_used == 0


def last_chunk(handle):
    chunks = list(handle)
    return chunks[-1]


def test_huge_length_penalty_among_live_sequences(engine):
    """The review's reproducer (length_penalty 2000, best_of 2), submitted past HTTP validation: it no longer
    raises in beam scoring, and the sequences beside it finish with their whole output."""
    others = [engine.submit(prompt(i), greedy()) for i in range(4)]
    for lp in (2000.0, -2000.0):
        beam = engine.submit(prompt(9), SamplingParams(max_tokens=5, best_of=2, n=2, length_penalty=lp))
        results = beam.results()
        assert len(results) == 2 and all(r.finish_reason in ("length", "stop") for r in results)
    finished_normally([h.results()[0] for h in others])
    settled(engine)


def test_a_failing_beam_step_fails_only_that_search(engine):
    """A beam search whose scoring raises (transformers' old expression: 2 ** 2000.0 overflows) ends with an
    error; the live sequences beside it finish normally."""
    others = [engine.submit(prompt(i), greedy()) for i in range(4)]
    for h in others:  # they are running when the search starts
        next(iter(h))
    beam = engine.submit(prompt(9), SamplingParams(max_tokens=3, best_of=2, length_penalty=2000.0))
    beam._seq.group.search.normalized = lambda score, n: score / (n**2000.0)
    with pytest.raises(RuntimeError, match="internal error: OverflowError"):
        beam.results()
    for h in others:
        rest = list(h)
        assert rest[-1].finish_reason == "length" and not rest[-1].error
        assert rest[-1].completion_tokens == NEW
    settled(engine)


@pytest.fixture
def bad_sampling(monkeypatch):
    """sample_batch raises whenever a row of the request with BAD_SEED is among its rows."""
    real = engine_core.sample_batch
    calls = {"batched": 0, "alone": 0}

    def sample(logits, samplers):
        calls["batched" if len(samplers) > 1 else "alone"] += 1
        if any(s.params.seed == BAD_SEED for s in samplers):
            raise ValueError("broken sampler")
        return real(logits, samplers)

    monkeypatch.setattr(engine_core, "sample_batch", sample)
    return calls


def test_a_failing_sampler_fails_only_its_sequence(engine, bad_sampling):
    handles = [engine.submit(prompt(i), greedy()) for i in range(3)]
    bad = engine.submit(prompt(7), greedy(seed=BAD_SEED))
    more = [engine.submit(prompt(i + 10), greedy()) for i in range(2)]
    end = last_chunk(bad)
    assert end.finish_reason == "abort" and end.error == "internal error: ValueError"
    finished_normally([h.results()[0] for h in handles + more])
    assert bad_sampling["alone"] > 0  # the batch raised: rows were sampled one by one to find the bad one
    settled(engine)


def test_a_failing_choice_fails_alone_and_its_siblings_finish(engine, monkeypatch):
    """n > 1: each choice is a sequence of its own. A choice whose logprobs raise ends with an error; the other
    choices of the same request (forked from its prompt KV) and other requests finish."""
    real = engine_core.sampled_logprobs

    def logprobs(tokenizer, seq, token, out, j):
        if seq.params.seed == BAD_SEED:
            raise KeyError("broken logprobs")
        return real(tokenizer, seq, token, out, j)

    monkeypatch.setattr(engine_core, "sampled_logprobs", logprobs)
    other = engine.submit(prompt(3), greedy(logprobs=1))
    choices = engine.submit_choices(prompt(4), [greedy(logprobs=1, seed=s) for s in (1, BAD_SEED, 2)])
    ends = [last_chunk(h) for h in choices]
    assert ends[1].finish_reason == "abort" and ends[1].error == "internal error: KeyError"
    assert [e.error for e in ends[::2]] == [None, None] and [e.finish_reason for e in ends[::2]] == ["length"] * 2
    finished_normally([other.results()[0]])
    settled(engine)


def test_a_failing_submission_fails_alone(engine, monkeypatch):
    """An exception while the engine thread takes a submission from its inbox ends that submission's requests;
    the queue count comes back to 0 and the next submission runs."""
    real = engine._start_all

    def start_all(seqs):
        if seqs[0].params.seed == BAD_SEED:
            raise RuntimeError("broken start")
        real(seqs)

    monkeypatch.setattr(engine, "_start_all", start_all)
    bad = engine.submit_choices(prompt(5), [greedy(seed=BAD_SEED)] * 2)
    assert [last_chunk(h).error for h in bad] == ["internal error: RuntimeError"] * 2
    finished_normally([engine.submit(prompt(6), greedy()).results()[0]])
    settled(engine)


def test_forward_fault_fails_the_step_and_the_engine_recovers(engine):
    streaming = engine.submit(prompt(1), greedy(max_tokens=200))
    it = iter(streaming)
    assert next(it).finish_reason is None  # running
    engine.inject_fault("forward")
    end = list(it)[-1]
    assert end.finish_reason == "abort" and end.error == "internal error: InjectedFault"
    # a fault before a submission's first step fails all of its choices
    engine.inject_fault("forward")
    together = engine.submit_choices(prompt(2), [greedy(seed=s) for s in range(3)])
    assert {last_chunk(h).error for h in together} == {"internal error: InjectedFault"}
    finished_normally([engine.submit(prompt(3), greedy()).results()[0]])
    assert engine.alive and engine.dead is None
    settled(engine)


def test_unknown_fault_kind_is_refused(engine):
    with pytest.raises(ValueError, match="unknown fault"):
        engine.inject_fault("disk")


def test_heartbeat_advances_when_idle(engine):
    settled(engine)
    before = engine.heartbeat
    time.sleep(1.2)  # two idle waits
    assert engine.heartbeat > before and time.monotonic() - engine.heartbeat < 2.0  # slack for a busy CPU
    assert engine.alive


def test_stop_token_ids_do_not_widen_the_beam(engine):
    assert BeamSearch(4, 1.0, 10_001).width == (1 + WIDTH_STOP_TOKENS) * 4
    assert BeamSearch(4, 1.0, 1).width == 2 * 4  # transformers' width for one EOS id
    vocab = engine.manifest.vocab_size
    params = SamplingParams(max_tokens=8, best_of=4, n=2, stop_token_ids=list(range(vocab, vocab + 10_000)))
    t = time.monotonic()
    handle = engine.submit(prompt(8), params)
    assert handle._seq.group.search.width == (1 + WIDTH_STOP_TOKENS) * 4
    results = handle.results()
    assert len(results) == 2 and all(len(r.token_ids) == 8 for r in results)
    assert time.monotonic() - t < 10  # list scans of 10,000 ids per candidate: far slower
    settled(engine)


def test_stop_string_window_is_bounded(engine):
    handle = engine.submit(prompt(8), SamplingParams(max_tokens=4, best_of=2, stop=["x" * 100_000, "zz"]))
    assert handle._seq.group.stop_window == STOP_WINDOW_TOKENS
    assert len(handle.results()) == 1
    settled(engine)


def test_loop_fault_kills_the_engine_loudly(exported):
    eng = tiny_engine(exported)
    died, seen = threading.Event(), []

    def on_death(exc: BaseException) -> None:
        seen.append((exc, threading.current_thread().name))
        died.set()

    eng.on_death = on_death
    try:
        running = [eng.submit(prompt(i), greedy(max_tokens=400)) for i in range(2)]
        its = [iter(h) for h in running]
        for it in its:
            assert next(it).finish_reason is None
        beam = eng.submit(prompt(5), SamplingParams(max_tokens=400, best_of=2))
        assert eng.alive
        eng.inject_fault("loop")
        assert died.wait(10)
        ((exc, thread),) = seen
        assert isinstance(exc, engine_mod.InjectedFault) and thread == "engine"
        assert eng.dead is exc and not eng.alive
        for it in its:
            end = list(it)[-1]
            assert end.finish_reason == "abort" and end.error == "the engine stopped: internal error: InjectedFault"
        with pytest.raises(RuntimeError, match="the engine stopped"):
            beam.results()
        with pytest.raises(EngineDead):
            eng.submit(prompt(6), greedy())
        assert eng.pool.num_used == 0
    finally:
        eng.shutdown()
