"""The Friendli / Cerebras parameters in the engine: bad words, no_repeat_ngram, max/min_total_tokens,
min_tokens -1, multi-token stop sequences, beam search's early_stopping, and cached_tokens from the prefix cache.

Selection-rule units first (check_token_stop, BeamSearch against transformers' early_stopping=True on a tiny random
model); then the default model through the Python API at its default precision. There no output is asserted
token for token: each test takes what it constrains (a word, a bigram, a stop sequence) from an unconstrained run
and checks the constraint on the constrained run. Raw prompts shorter than one KV block keep the prefix cache out
of the way (a cache hit changes the prefill's batch shape, and with it greedy at a near-tie)."""

from __future__ import annotations

import numpy as np
import pytest

from appliance.config import EngineConfig
from appliance.params import SamplingParams
from appliance.runtime.beam_search import BeamSearch
from appliance.runtime.engine import Engine
from appliance.runtime.stopping import check_token_stop
from tests.helpers import one_torch_thread
from tests.runtime.test_beam_search import _toy_model, drive_search, transformers_beams

# ---------------------------------------------------------------- units


def test_stop_token_sequence_ends_on_its_last_generated_token():
    p = SamplingParams(stop_token_sequences=[[5, 6, 7]])
    assert check_token_stop(7, 3, p, frozenset(), False, [1, 5, 6, 7]) == "stop"
    assert check_token_stop(7, 2, p, frozenset(), False, [5, 6, 7]) is None  # 5 is the prompt's
    assert check_token_stop(7, 3, p, frozenset(), False, [1, 5, 9, 7]) is None
    assert check_token_stop(6, 3, p, frozenset(), False, [1, 5, 6]) is None
    p = SamplingParams(stop_token_sequences=[[5, 6]], min_tokens=2)
    assert check_token_stop(6, 2, p, frozenset(), False, [0, 5, 6]) is None  # not after min_tokens tokens
    assert check_token_stop(6, 3, p, frozenset(), False, [0, 9, 5, 6]) == "stop"


def test_early_stopping_ends_once_the_pool_is_full():
    """Two finished hypotheses fill a 2-beam pool while a running beam, longer, still scores better per token
    (length_penalty 1): the heuristic (False) goes on, True stops there."""
    for early in (False, True):
        search = BeamSearch(2, 1.0, early_stopping=early)
        cands = search.candidates(np.log(np.array([[0.5, 0.3, 0.2]], np.float32)), [0.0])
        running = search.update(cands, [c.token == 1 for c in cands], 1, payloads=[[c.token] for c in cands])
        assert [c.token for c in running] == [0, 2] and len(search.finished) == 1
        rows = np.log(np.array([[0.9, 0.05, 0.05]] * 2, np.float32))
        cands = search.candidates(rows, [c.score for c in running])
        running = search.update(cands, [c.rank == 0 for c in cands], 2, payloads=[[c.beam] for c in cands])
        assert len(search.finished) == 2 and search.done is early
        assert running == [] if early else [c.beam for c in running][:1] == [1]


def test_early_stopping_matches_transformers_on_random_cases():
    model = _toy_model()
    rng = np.random.default_rng(1)
    shorter = 0
    with one_torch_thread():
        for _ in range(25):
            prompt = rng.integers(3, 40, size=rng.integers(2, 8)).tolist()
            beams = int(rng.choice([2, 3, 4]))
            n, steps = int(rng.integers(1, beams + 1)), int(rng.integers(4, 14))
            lp = float(rng.choice([1.0, 0.0, 2.0]))
            ours = {early: drive_search(model, prompt, beams, n, steps, lp, [2], early) for early in (True, False)}
            theirs = transformers_beams(model, prompt, beams, n, steps, lp, [2], early_stopping=True)
            assert ours[True][0] == theirs
            assert ours[True][1] <= ours[False][1]
            shorter += ours[True][1] < ours[False][1]
    assert shorter >= 3  # early_stopping changed something


# ---------------------------------------------------------------- the engine on the default model

NEW = 24


@pytest.fixture(scope="module")
def engine(model_dir):
    e = Engine(model_dir, EngineConfig(max_num_batched_tokens=128))
    yield e
    e.shutdown()


def raw(engine, text: str) -> list[int]:
    ids = engine.tokenizer.encode(text)
    assert len(ids) <= engine.pool.block_size, "a short prompt never meets the prefix cache"
    return ids


def run(engine, ids, **kw):
    kw.setdefault("max_tokens", NEW)
    return engine.submit(ids, SamplingParams(temperature=0.0, **kw)).results()[0]


def occurs(seq: list[int], history: list[int], start: int) -> bool:
    """seq occurs in history ending at or after position start (in the generated part)."""
    k = len(seq)
    return any(history[i - k : i] == seq for i in range(max(k, start + 1), len(history) + 1))


def test_bad_word_never_generated(engine):
    ids = raw(engine, "The capital of France is Paris. The capital of Germany is")
    free = run(engine, ids, ignore_eos=True)
    tok, history = engine.tokenizer, ids + free.token_ids
    word = next(
        w
        for w in free.text.split()
        if w.isalpha() and any(occurs(tok.encode(t), history, len(ids)) for t in (w, " " + w))
    )
    banned = run(engine, ids, ignore_eos=True, bad_words=[word])
    history = ids + banned.token_ids
    assert not any(occurs(tok.encode(t), history, len(ids)) for t in (word, " " + word)), (word, banned.text)


def test_bad_word_tokens_single_token(engine):
    ids = raw(engine, "One, two, three, four, five, six")
    free = run(engine, ids, ignore_eos=True)
    first = free.token_ids[0]
    banned = run(engine, ids, ignore_eos=True, bad_word_tokens=[[first]])
    assert first not in banned.token_ids


def test_no_repeat_ngram(engine):
    ids = raw(engine, "the cat the cat the cat the cat")

    def repeats(out: list[int]) -> int:
        h = ids + out
        return sum((h[i - 1], h[i]) in {tuple(h[j : j + 2]) for j in range(i - 1)} for i in range(len(ids), len(h)))

    assert repeats(run(engine, ids, ignore_eos=True).token_ids) > 0  # the test can fail
    assert repeats(run(engine, ids, ignore_eos=True, no_repeat_ngram=2).token_ids) == 0


def test_max_total_tokens(engine):
    ids = raw(engine, "Count slowly: one, two,")
    out = run(engine, ids, max_tokens=None, ignore_eos=True, max_total_tokens=len(ids) + 5)
    assert (out.completion_tokens, out.finish_reason) == (5, "length")
    with pytest.raises(ValueError, match="max_total_tokens"):
        engine.submit(ids, SamplingParams(max_total_tokens=len(ids)))


def test_min_tokens_to_limit(engine):
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Say hi."}])
    free = run(engine, ids, max_tokens=64)
    assert free.finish_reason == "stop"  # it ends on its own: the limit is what keeps it going
    limit = free.completion_tokens + 6
    out = run(engine, ids, max_tokens=limit, min_tokens_to_limit=True)
    assert out.completion_tokens == limit and out.finish_reason == "length"


def test_stop_token_sequence(engine):
    ids = raw(engine, "List the planets of the solar system:")
    free = run(engine, ids, ignore_eos=True).token_ids
    k = next(k for k in range(3, NEW - 1) if not occurs(free[k : k + 2], ids + free[: k + 1], len(ids)))
    stop = free[k : k + 2]
    out = run(engine, ids, ignore_eos=True, stop_token_sequences=[stop])
    assert out.finish_reason == "stop" and out.token_ids[-2:] == stop
    assert not occurs(stop, ids + out.token_ids[:-1], len(ids))  # it stopped at the first one


# (raw prompt, stop string, best_of, n): searches whose pool of finished hypotheses fills (a "." or a newline ends
# a hypothesis) before max_tokens, with running beams left that transformers' heuristic lets go on
EARLY_STOPPING_CASES = [
    ("My favourite colour is", ".", 2, 1),
    ("Q: What is 2+2?\nA:", ".", 2, 1),
    ("The best way to learn is", ".", 3, 1),
    ("The capital of France is", "\n", 3, 1),
]


def test_early_stopping_beams(engine):
    """early_stopping reaches the engine's searches: with True a search ends at the step its pool of finished
    hypotheses fills, with False (the heuristic) it goes on while a running beam may still beat the pool's worst.
    Each step is watched through the engine's own search state, so what is checked does not depend on which
    tokens the default precision picks on this CPU; that the cases exercise the difference (False goes on past a
    full pool) is asserted too."""
    step = engine.beams._step
    trace: list[tuple[bool, bool]] = []  # per step of the current search: (pool full, search done)

    def watched(group):
        step(group)
        trace.append((len(group.search.finished) >= group.search.num_beams, group.search.done))

    engine.beams._step = watched
    went_on, steps = 0, {True: 0, False: 0}
    try:
        for text, stop, best_of, n in EARLY_STOPPING_CASES:
            ids = raw(engine, text)
            for early in (True, False):
                trace.clear()
                params = SamplingParams(max_tokens=NEW, best_of=best_of, n=n, early_stopping=early, stop=[stop])
                results = engine.submit(ids, params).results()
                steps[early] += len(trace)
                assert len(results) == n and trace[-1][1], (text, early, trace)
                for r in results:
                    assert 0 < r.completion_tokens <= NEW and r.finish_reason in ("stop", "length")
                full = [i for i, (pool_full, _) in enumerate(trace) if pool_full]
                if early:  # the step that fills the pool is the search's last
                    assert not full or full[0] == len(trace) - 1, (text, "went on past a full pool", trace)
                else:
                    went_on += bool(full) and full[0] < len(trace) - 1
    finally:
        del engine.beams._step
    assert went_on >= 2, f"only {went_on} searches went on past a full pool with early_stopping=False"
    assert steps[True] < steps[False], steps


def test_cached_tokens(engine):
    text = " ".join(f"item {i} of a long list that nobody else prompts with;" for i in range(12))
    ids = engine.tokenizer.encode(text)
    assert len(ids) > 2 * engine.pool.block_size

    def cached() -> int:
        chunks = list(engine.submit(ids, SamplingParams(max_tokens=2)))
        assert len({c.cached_tokens for c in chunks}) == 1
        return chunks[-1].cached_tokens

    assert cached() == 0
    second = cached()
    assert 0 < second < len(ids) and second % engine.pool.block_size == 0


def test_seed_list_gives_each_choice_its_seed(engine, tmp_path):
    """Friendli's seed list (Job.seeds): choice j gets seeds[j]; without it, seed + j as before."""
    from appliance import protocol as p
    from appliance.server.engine_service import EngineService
    from appliance.server.metrics import ServerMetrics
    from appliance.settings import ServeSettings

    settings = ServeSettings(
        model_dir=str(engine.model_dir), served_model_name="m", model_created=0, runtime_dir=str(tmp_path)
    )
    service = EngineService(settings, ServerMetrics())
    service.attach(engine, "CPU")
    ids = raw(engine, "Once upon a time")
    for seeds, seed, want in (([11, 5, 11], None, [11, 5, 11]), ([3, 4, 5], 9, [3, 4, 5]), (None, 40, [40, 41, 42])):
        params = SamplingParams(max_tokens=3, temperature=1.0, seed=seed)
        handles, _ = service.jobs.submit(p.Job("r", [p.PromptSpec(token_ids=ids)], params, n=3, seeds=seeds))
        assert [h._seq.params.seed for _, h, _ in handles] == want
        assert all(h.results()[0].completion_tokens == 3 for _, h, _ in handles)
