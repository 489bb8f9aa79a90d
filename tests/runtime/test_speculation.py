"""Speculative decoding (prompt lookup) changes the speed, never the output.

- The n-gram index and its draft rules (unit), the adaptive draft length.
- Greedy parity in f32: speculative tokens equal non-speculative tokens on the default model (input-grounded
  prompts, where most drafts are accepted) and on every tiny family (with a prediction that is all right, and one
  that is all wrong), all prompts at once so drafts of several sequences are verified in one step; with stop strings,
  max_tokens inside an accepted run, a grammar, and logprobs.
- Sampling: with a seed, the same tokens as without speculation (the verification draws each token with the
  sequence's own generator); without one, the same distribution (a chi-square homogeneity test on 800 + 800 draws).
- No KV block is left behind.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from appliance.config import EngineConfig
from appliance.params import Grammar, SamplingParams
from appliance.runtime.engine import Engine
from appliance.runtime.speculative.ngram import _Lookup
from appliance.runtime.speculative.state import MAX_PAUSE, SpecState
from tests import tiny_models

F32 = dict(precision="f32")


# ------------------------------------------------------------------ unit: the lookup and the draft length


def test_lookup_takes_the_longest_ngram_and_its_latest_occurrence():
    # "7 8" occurs twice before the end (followed by 1 then by 2); the 1-gram "8" also after 5: the 2-gram wins,
    # and of its occurrences the latest
    h = [7, 8, 1, 5, 8, 9, 7, 8, 2, 3, 7, 8]
    lookup = _Lookup([], h, max_ngram=2, prompt_len=len(h))
    assert lookup.propose(3) == [2, 3, 7]
    assert _Lookup([], [1, 2, 3], max_ngram=3, prompt_len=3).propose(2) == []  # nothing occurred before


def test_lookup_follows_its_source_while_the_model_agrees():
    h = [1, 2, 3, 4, 5, 6, 9, 1, 2]
    lookup = _Lookup([], h, max_ngram=2, prompt_len=len(h))
    assert lookup.propose(2) == [3, 4]
    lookup.sync(h + [3, 4, 5])  # both drafts accepted, and the model's own next token continued the source
    assert lookup.propose(3) == [6, 9, 1]
    lookup.sync(h + [3, 4, 5, 6, 0])  # the model parted from the source: look up again ("0" never occurred)
    assert lookup.propose(3) == []


def test_prediction_is_where_the_answer_starts():
    prompt = [50, 51, 52]
    lookup = _Lookup([10, 11, 12, 13], prompt, max_ngram=3, prompt_len=3)
    lookup.sync(prompt + [10])  # the first token (sampled from the prompt's logits) is the prediction's first
    assert lookup.propose(2) == [11, 12]


def test_a_long_history_is_indexed_a_slice_per_lookup_and_then_drafts_as_if_indexed_at_once():
    """An 8,000-token prediction is not indexed in one lookup (that was ~0.15 s of one step per sequence): each
    lookup indexes INDEX_SLICE positions at most; once caught up, it drafts what a complete index drafts."""
    import random

    from appliance.runtime.speculative import ngram

    rng = random.Random(3)
    prediction = [rng.randrange(50) for _ in range(8000)]
    prompt = [rng.randrange(50) for _ in range(40)]
    sliced = _Lookup(list(prediction), prompt, 16, len(prompt))
    whole = _Lookup(list(prediction), prompt, 16, len(prompt))
    monkey = ngram.INDEX_SLICE
    try:
        ngram.INDEX_SLICE = 10**9  # the reference: everything at the first lookup, as before
        tokens = prompt + [999]  # the answer parts from the prediction at once: a lookup
        whole.sync(tokens)
        whole.propose(3)
    finally:
        ngram.INDEX_SLICE = monkey
    sliced.sync(tokens)
    sliced.propose(3)
    assert sliced.indexed == ngram.INDEX_SLICE and whole.indexed == len(prediction) + len(prompt)
    for _ in range(len(prediction) // ngram.INDEX_SLICE + 2):
        tokens.append(rng.randrange(50))
        sliced.sync(tokens)
        whole.sync(tokens)
        sliced.propose(3)
        whole.propose(3)
    tokens.append(prediction[100])  # caught up: both find the same latest occurrences
    sliced.sync(tokens)
    whole.sync(tokens)
    assert sliced.indexed == whole.indexed and sliced.propose(3) == whole.propose(3)


def test_draft_length_adapts_and_failing_sequences_pause():
    spec = SpecState("prompt_lookup", max_k=5)
    assert spec.k == 5 and spec.ready()
    spec.adapt(5, 2)
    assert spec.k == 4 and spec.pause == 0
    spec.adapt(4, 4)
    assert spec.k == 5
    pauses = []
    for _ in range(8):
        spec.adapt(spec.k, 0)
        pauses.append(spec.pause)
    assert pauses == [2, 4, 8, 16, 32, 64, 64, 64] and MAX_PAUSE == 64
    assert [spec.ready() for _ in range(65)] == [False] * 64 + [True]
    spec.adapt(1, 1)
    assert spec.misses == 0 and spec.pause == 0


# ------------------------------------------------------------------ engines


def _run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], at_once: int = 200):
    """All at once (up to the queue's bound): their drafts are verified in the same steps."""
    results = []
    for i in range(0, len(prompts), at_once):
        handles = [engine.submit(p, q) for p, q in zip(prompts[i : i + at_once], params[i : i + at_once])]
        results += [h.results()[0] for h in handles]
    return results


def _every_step(engine: Engine) -> Engine:
    """Without the step-cost policy: every speculating sequence drafts k on every step, so the verification runs
    whatever the box's step costs (the policy's own decisions: test_speculative_policy.py)."""
    engine.speculation.policy = None
    return engine


def _drafts(engine: Engine) -> tuple[int, int]:
    return engine.counters["draft_tokens"], engine.counters["accepted_draft_tokens"]


@pytest.fixture(scope="module")
def default_f32():
    from export.default_model import ensure_export

    return ensure_export("openvino", "fp32")


GROUNDED = [
    "Repeat the following text exactly, word for word:\n\nPaged attention keeps the key and value cache in fixed "
    "size blocks, so a sequence grows one block at a time and no memory is reserved for tokens it never writes.",
    "Add a docstring to this function and return the whole function:\n\ndef add(a, b):\n    total = a + b\n"
    "    return total\n",
    "Extract every number from this sentence as a list: The box has 2 cores, 24 GB of memory and 1 disk of 512 GB.",
]


def test_default_model_greedy_is_unchanged(default_f32):
    base = Engine(default_f32, EngineConfig(**F32))
    spec = Engine(default_f32, EngineConfig(**F32, prompt_lookup=True, speculation_max_batch=8))
    try:
        prompts = [base.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in GROUNDED]
        params = [SamplingParams(max_tokens=48)] * len(prompts)
        want = _run(base, prompts, params)
        assert spec.speculation.policy is not None  # measured at load: the model speculates
        got = _run(spec, prompts, params)  # as the policy decides
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        got = _run(_every_step(spec), prompts, params)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert [r.text for r in got] == [r.text for r in want]
        drafted, accepted = _drafts(spec)
        assert accepted >= 20 and drafted >= accepted  # grounded prompts: many drafts, most of them kept
        assert _drafts(base) == (0, 0)
        assert spec.pool.num_used == 0
        _run(base, prompts[:1], [SamplingParams(max_tokens=8, max_ngram_size=3)])  # a request asks for lookup
        assert base.speculation.policy is None  # step costs are never timed after load (it would stall streams)
    finally:
        base.shutdown()
        spec.shutdown()


@pytest.mark.parametrize("family", list(tiny_models.FAMILIES))
def test_tiny_families_greedy_is_unchanged(family, exported):
    out, _ = exported(family, "openvino", "fp32")
    base = Engine(out, EngineConfig(**F32, max_num_batched_tokens=64))
    spec = _every_step(Engine(out, EngineConfig(**F32, max_num_batched_tokens=64, speculation_max_batch=8)))
    try:
        prompts = [base.tokenizer.encode(t) for t in tiny_models.CORPUS[:4]]
        plain = SamplingParams(max_tokens=40, ignore_eos=True)
        want = _run(base, prompts, [plain] * 4)
        right = [SamplingParams(max_tokens=40, ignore_eos=True, prediction=r.text) for r in want]
        # the answer's first token, then nonsense: the prediction is followed, and its drafts rejected
        wrong = [
            SamplingParams(
                max_tokens=40, ignore_eos=True, prediction=base.tokenizer.decode(r.token_ids[:1]) + " zq" * 30
            )
            for r in want
        ]
        counts = []
        for params in (right, wrong):
            before = _drafts(spec)
            got = _run(spec, prompts, params)
            assert [r.token_ids for r in got] == [r.token_ids for r in want]
            counts.append([x - y for x, y in zip(_drafts(spec), before)])
        # random weights emit stray UTF-8 bytes whose text does not tokenize back to them, so a right prediction is
        # not always followed to the end: what counts is that drafts were kept and drafts were rejected
        assert counts[0][1] > 0 and counts[1][0] > counts[1][1], counts
        assert spec.pool.num_used == 0
    finally:
        base.shutdown()
        spec.shutdown()


@pytest.fixture(scope="module")
def tiny_llama(exported):
    out, _ = exported("llama", "openvino", "fp32")
    base = Engine(out, EngineConfig(**F32))
    spec = _every_step(Engine(out, EngineConfig(**F32, speculation_max_batch=64)))
    yield base, spec
    base.shutdown()
    spec.shutdown()


def test_stops_inside_an_accepted_run_are_where_they_would_be(tiny_llama):
    base, spec = tiny_llama
    prompt = base.tokenizer.encode(tiny_models.CORPUS[1])
    full = base.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True))[0]
    words = full.text.split()
    stop = words[len(words) // 2]
    cases = [
        dict(max_tokens=17, ignore_eos=True),  # a length stop in the middle of a run of drafts
        dict(max_tokens=40, ignore_eos=True, stop=[stop]),
        dict(max_tokens=40, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        dict(max_tokens=40, ignore_eos=True, logprobs=3),
        dict(max_tokens=30, grammar=Grammar("regex", "[a-z ]{5,60}")),
        dict(max_tokens=40, ignore_eos=True, repetition_penalty=1.3, no_repeat_ngram=3),
    ]
    for case in cases:
        want = base.generate(prompt, SamplingParams(**case))[0]
        before = _drafts(spec)[1]
        got = spec.generate(prompt, SamplingParams(**case, prediction=want.text + " " + full.text))[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason), case
        assert _drafts(spec)[1] > before, case  # the prediction was used
        if want.logprobs:
            assert got.logprobs is not None
            for a, b in zip(got.logprobs, want.logprobs):
                assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t for t, _, _ in a.top] == [t for t, _, _ in b.top]
    assert spec.pool.num_used == 0


def test_seeded_sampling_draws_the_same_tokens(tiny_llama):
    base, spec = tiny_llama
    prompt = base.tokenizer.encode(tiny_models.CORPUS[0])
    greedy = base.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True))[0].text
    for seed in range(12):
        params = dict(max_tokens=24, ignore_eos=True, temperature=0.7, top_k=4, seed=seed)
        want = base.generate(prompt, SamplingParams(**params))[0]
        got = spec.generate(prompt, SamplingParams(**params, prediction=greedy))[0]
        assert got.token_ids == want.token_ids, seed
    assert _drafts(spec)[1] > 0


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty: the chi-square quantile for a standard-normal quantile z (3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampling_keeps_the_distribution(tiny_llama):
    """(first, second) token pairs drawn with and without speculation: the second token is verified against a
    draft (the greedy continuation), accepted or resampled; the pair counts must be one distribution."""
    base, spec = tiny_llama
    prompt = base.tokenizer.encode(tiny_models.CORPUS[2])
    greedy = base.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True))[0].text
    draws = 800
    params = dict(max_tokens=3, ignore_eos=True, temperature=1.0, top_k=3)
    rng = random.Random(7)

    def pairs(engine: Engine, **extra) -> Counter:
        ps = [SamplingParams(**params, seed=rng.randrange(2**31), **extra) for _ in range(draws)]
        return Counter(tuple(r.token_ids[:2]) for r in _run(engine, [prompt] * draws, ps))

    before = _drafts(spec)
    a, b = pairs(base), pairs(spec, prediction=greedy)
    drafted, accepted = (x - y for x, y in zip(_drafts(spec), before))
    assert 0 < accepted < drafted  # both paths taken: drafts accepted and rejected
    cells = [k for k in a.keys() | b.keys() if a[k] + b[k] >= 10]  # rare pairs pooled
    rest = (draws - sum(a[k] for k in cells), draws - sum(b[k] for k in cells))
    table = [(a[k], b[k]) for k in cells] + ([rest] if sum(rest) else [])
    stat = sum((x - y) ** 2 / (x + y) for x, y in table)  # equal sample sizes: the homogeneity statistic
    assert len(table) >= 3
    assert stat < _chi_square_critical(len(table) - 1), (stat, table)
