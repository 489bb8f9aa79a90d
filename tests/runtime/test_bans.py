"""appliance.runtime.bans (bad words, no_repeat_ngram) and stopping.resolve_prompt_limits on their own: the banned sets
against a brute-force rescan of the history (transformers' semantics), forks that must not share state, and the
prompt-relative limits."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest

from appliance.params import SamplingParams
from appliance.runtime.bans import Bans
from appliance.runtime.beam_search import fork_sampler
from appliance.runtime.sampling import SequenceSampler, apply_processors
from appliance.runtime.stopping import resolve_prompt_limits


class WordTokenizer:
    """Each space-separated word is one token (a leading space makes a different token, as in BPE)."""

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        assert not add_special_tokens
        words = text.split(" ")
        pieces = [w for w in words[:1] if w] + [" " + w for w in words[1:] if w]
        return [self.vocab.setdefault(p, len(self.vocab)) for p in pieces]


def sampler(params: SamplingParams, prompt: list[int], tokenizer=None) -> SequenceSampler:
    s = SequenceSampler(params, prompt)
    s.bans = Bans.build(params, prompt, tokenizer or WordTokenizer())
    return s


def brute_ngram(history: list[int], n: int) -> set[int]:
    """transformers' NoRepeatNGramLogitsProcessor on one row."""
    if len(history) + 1 < n:
        return set()
    key = tuple(history[len(history) - n + 1 :])
    return {history[i + n - 1] for i in range(len(history) - n + 1) if tuple(history[i : i + n - 1]) == key}


def test_nothing_banned_builds_none():
    assert Bans.build(SamplingParams(), [1, 2, 3], WordTokenizer()) is None
    assert Bans.build(SamplingParams(no_repeat_ngram=1), [1, 2], WordTokenizer()) is None
    assert Bans.build(SamplingParams(bad_words=[""], bad_word_tokens=[[]]), [1], WordTokenizer()) is None


def test_bad_words_tokenized_with_and_without_leading_space():
    tok = WordTokenizer()
    s = sampler(SamplingParams(bad_words=["cat"]), [5, 6], tok)
    banned = set(s.bans.banned(s).tolist())
    assert banned == {tok.vocab["cat"], tok.vocab[" cat"]}


def test_multi_token_bad_word_bans_its_last_token_after_its_prefix_only():
    s = sampler(SamplingParams(bad_word_tokens=[[7, 8, 9], [4]]), [1, 7])
    assert s.bans.banned(s).tolist() == [4]  # single tokens: always
    s.append(8)  # history ... 7 8: the next 9 would complete [7, 8, 9]
    assert s.bans.banned(s).tolist() == [4, 9]
    s.append(3)
    assert s.bans.banned(s).tolist() == [4]
    s2 = sampler(SamplingParams(bad_word_tokens=[[7, 8, 9]]), [7, 8])  # the prefix may lie in the prompt
    assert s2.bans.banned(s2).tolist() == [9]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_no_repeat_ngram_matches_a_rescan(n):
    rng = random.Random(n)
    prompt = [rng.randrange(6) for _ in range(20)]
    s = sampler(SamplingParams(no_repeat_ngram=n), prompt)
    for _ in range(60):
        banned = set(s.bans.banned(s).tolist())
        assert banned == brute_ngram(prompt + s.output_ids, n)
        s.append(rng.choice([t for t in range(9) if t not in banned] or [99]))


def test_no_repeat_ngram_short_history():
    s = sampler(SamplingParams(no_repeat_ngram=3), [1])
    assert s.bans.banned(s).tolist() == []
    s.append(1)
    s.append(1)  # 1 1 1: the 3-gram (1, 1, 1) exists, so after (1, 1) comes no 1
    assert s.bans.banned(s).tolist() == [1]


def test_forks_do_not_share_generated_ngrams():
    prompt = [1, 2, 3]
    parent = sampler(SamplingParams(no_repeat_ngram=2, bad_word_tokens=[[5, 6]]), prompt)
    parent.append(4)
    parent.bans.banned(parent)  # indexes (3, 4)
    child = fork_sampler(parent)
    assert child.bans is not parent.bans
    parent.append(7)
    child.append(9)
    for s in (parent, child):
        s.append(4)
        assert set(s.bans.banned(s).tolist()) == brute_ngram(prompt + s.output_ids, 2)
    assert set(parent.bans.banned(parent).tolist()) == {7}  # (4, 7) is the parent's bigram only
    assert set(child.bans.banned(child).tolist()) == {9}
    assert copy.copy(child.bans).prompt_index is child.bans.prompt_index  # read-only parts are shared


def test_banned_tokens_get_no_probability():
    s = sampler(SamplingParams(bad_word_tokens=[[3]], no_repeat_ngram=2), [1, 2, 1])
    logits = np.zeros((1, 8), np.float32)
    out = apply_processors(logits, [s])
    assert np.isneginf(out[0, [2, 3]]).all() and np.isfinite(np.delete(out[0], [2, 3])).all()


def test_limits_unchanged_object_when_unset():
    p = SamplingParams(max_tokens=5, min_tokens=2)
    assert resolve_prompt_limits(p, 10, 100) is p


def test_max_total_tokens():
    assert resolve_prompt_limits(SamplingParams(max_total_tokens=30), 10, 100).max_tokens == 20
    assert resolve_prompt_limits(SamplingParams(max_total_tokens=30, max_tokens=5), 10, 100).max_tokens == 5
    with pytest.raises(ValueError, match="max_total_tokens"):
        resolve_prompt_limits(SamplingParams(max_total_tokens=10), 10, 100)


def test_min_total_tokens():
    assert resolve_prompt_limits(SamplingParams(min_total_tokens=30), 10, 100).min_tokens == 20
    assert resolve_prompt_limits(SamplingParams(min_total_tokens=30, min_tokens=25), 10, 100).min_tokens == 25
    assert resolve_prompt_limits(SamplingParams(min_total_tokens=5), 10, 100).min_tokens == 0


def test_min_tokens_to_limit():
    p = resolve_prompt_limits(SamplingParams(min_tokens_to_limit=True, max_tokens=7), 10, 100)
    assert (p.min_tokens, p.max_tokens) == (7, 7)
    p = resolve_prompt_limits(SamplingParams(min_tokens_to_limit=True), 10, 100)
    assert (p.min_tokens, p.max_tokens) == (90, None)
    p = resolve_prompt_limits(SamplingParams(min_tokens_to_limit=True, max_total_tokens=25), 10, 100)
    assert (p.min_tokens, p.max_tokens) == (15, 15)
