"""Banned token sequences: Friendli's bad_words / bad_word_tokens and no_repeat_ngram.

Both are "a token that would complete a forbidden sequence is never sampled", looked up against the tail of the
sequence's history (prompt + generated, as transformers' NoBadWordsLogitsProcessor and
NoRepeatNGramLogitsProcessor see input_ids):

- bad words: each string is tokenized without special tokens both as written and with a leading space (a word
  inside text is usually a different token than at the start, as vLLM does), plus bad_word_tokens as given. The
  server does this once per request on the caller's thread (Engine.prepare), so `build` on the engine thread only
  arranges token tuples; the request's `setup_work` (appliance/limits.py) counts their tokens per sequence. A
  one-token sequence is banned at every step; a longer one bans its last token wherever the history ends with
  the rest of it.
- no_repeat_ngram n > 1: a token is banned when the last n - 1 tokens followed by it form an n-gram already in the
  history (n at most the limits table's `no_repeat_ngram`; prompt tokens x (n - 1) count in `setup_work`). The
  (n-1)-gram -> next tokens index is built once from the prompt (shared, never changed afterwards)
  and extended with the tokens generated since the previous call, so a step costs O(new tokens + n), not a rescan.

Copies (beam search forks a beam's sampler, beam_search.fork_sampler) share the prompt's index and copy only
the generated part (`copy.copy(bans)`), so one beam's n-grams never ban another's tokens.
`Bans.build` returns None when nothing is banned: the sampler then skips bans entirely (no per-step cost).
Measured on the 2-core dev box (default model's tokenizer, 2000-token prompt, no_repeat_ngram=3 and three bad
words): `banned` about 4 us per step, `build` (engine thread, once per sequence) about 1.3 ms.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def _tail(prompt: Sequence[int], output: Sequence[int], k: int, end: int | None = None) -> tuple[int, ...]:
    """The last k tokens of prompt + output[:end] (fewer when the history is shorter), without concatenating."""
    end = len(output) if end is None else end
    if k <= end:
        return tuple(output[end - k : end])
    rest = k - end
    return tuple(prompt[max(0, len(prompt) - rest) :]) + tuple(output[:end])


class Bans:
    """One sequence's banned continuations (engine thread only)."""

    def __init__(self, sequences: list[tuple[int, ...]], ngram: int, prompt_ids: Sequence[int]):
        self.always = np.array(sorted({s[0] for s in sequences if len(s) == 1}), np.int64)
        # bad sequences of 2+ tokens: prefix -> last tokens, and the prefix lengths to look up each step
        self.by_prefix: dict[tuple[int, ...], set[int]] = {}
        for s in sequences:
            if len(s) > 1:
                self.by_prefix.setdefault(s[:-1], set()).add(s[-1])
        self.prefix_lens = sorted({len(k) for k in self.by_prefix})
        self.ngram = ngram if ngram > 1 else 0
        self.prompt_index: dict[tuple[int, ...], frozenset[int]] = {}
        self.output_index: dict[tuple[int, ...], set[int]] = {}  # n-grams that end in a generated token
        self.indexed = 0  # generated tokens already in output_index
        if self.ngram:
            k = self.ngram - 1
            idx: dict[tuple[int, ...], set[int]] = {}
            for i in range(k, len(prompt_ids)):
                idx.setdefault(tuple(prompt_ids[i - k : i]), set()).add(prompt_ids[i])
            self.prompt_index = {key: frozenset(v) for key, v in idx.items()}

    @classmethod
    def build(cls, params: Any, prompt_ids: Sequence[int], tokenizer: Any) -> Bans | None:
        """None when the request bans nothing (the common case: no per-step cost)."""
        seqs: set[tuple[int, ...]] = set()
        for word in params.bad_words:
            for text in (word, " " + word.lstrip()):
                seqs.add(tuple(tokenizer.encode(text, add_special_tokens=False)))
        # Engine.prepare already made them tuples of ints (and tokenized bad_words), once per request
        seqs.update(ids if isinstance(ids, tuple) else tuple(int(t) for t in ids) for ids in params.bad_word_tokens)
        seqs = {s for s in seqs if s and min(s) >= 0}
        ngram = params.no_repeat_ngram or 0
        if not seqs and ngram <= 1:
            return None
        return cls(sorted(seqs), ngram, prompt_ids)

    def __copy__(self) -> Bans:
        """A fork: everything read-only is shared, the generated n-gram index is copied."""
        new = object.__new__(Bans)
        new.__dict__.update(self.__dict__)
        new.output_index = {k: set(v) for k, v in self.output_index.items()}
        return new

    def banned(self, sampler: Any) -> np.ndarray:
        """int64 token ids that must not be sampled next, given sampler.prompt_ids + sampler.output_ids."""
        prompt, output = sampler.prompt_ids, sampler.output_ids
        found: set[int] = set()
        for k in self.prefix_lens:
            if k <= len(prompt) + len(output):
                found.update(self.by_prefix.get(_tail(prompt, output, k), ()))
        if self.ngram:
            self._index_new(prompt, output)
            key = _tail(prompt, output, self.ngram - 1)
            found.update(self.prompt_index.get(key, ()))
            found.update(self.output_index.get(key, ()))
        if not found:
            return self.always
        extra = np.fromiter(found, np.int64, len(found))
        return np.union1d(self.always, extra) if len(self.always) else extra

    def _index_new(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Add the n-grams that end in the generated tokens not indexed yet."""
        n = self.ngram
        if len(output) < self.indexed:  # history rewound (cannot happen in the engine): rebuild from scratch
            self.output_index, self.indexed = {}, 0
        for j in range(self.indexed, len(output)):
            head = _tail(prompt, output, n - 1, j)
            if len(head) == n - 1:
                self.output_index.setdefault(head, set()).add(output[j])
        self.indexed = len(output)
