"""Prompt lookup (n-gram speculation): draft the tokens that followed the latest n-gram where it occurred before.

Answers that summarize, rewrite, extract or edit a given text repeat long runs of it; the prompt (and the answer so
far) is then a free draft model. For each sequence the proposer keeps, per n-gram size n <= max_ngram_size, a dict
from each n-gram to the end of its latest earlier occurrence, updated as tokens arrive: O(max_ngram_size) dict
updates per token instead of a scan of the whole context per step (a 4000-token prompt scanned with numpy per step
costs ~0.2 ms; the index is ~5 us per new token). The longest n-gram that ends the sequence and occurred before
wins; the latest occurrence of it is taken (the run being copied is usually the most recent one).

While a copy goes well the proposer does not look up at all: if everything it drafted last time was accepted and
the model's own next token also continued the source, the draft simply carries on from there (`follow`). That keeps a
long copy aligned to its source even where a short n-gram also occurs elsewhere.

OpenAI's Predicted Outputs: a request's `prediction` text is tokenized once per request, on the caller's thread
(Engine.prepare; at most the model's context in tokens), and put in front of the prompt as more history to copy
from; its first tokens are where the copy starts (the answer is expected to begin like it). The index of that
history costs about 1 us and 150 bytes per position and n-gram size (65,536 tokens at n <= 16: 1.0 s, 160 MB), so
the request pays for it in the limits table's `setup_work`. It is built on the engine thread, lazily (a sequence
that never looks up, as in a batch too large to speculate, never pays for it) and a slice at a time: at most
INDEX_SLICE positions per lookup, so no step waits on a whole index. Built at once, the first lookups of four
requests with an 8,000-token prediction each put ~0.5 s of indexing into one step (a victim stream's median token
gap went from 116 to 511 ms). Until its index is complete a lookup finds only what is indexed (a shorter or no
draft: drafts are hints, the output is the same).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from appliance.runtime.speculative.base import Proposer

# Positions a lookup indexes at most (x the n-gram sizes: 256 x 16 = 4,096 dict updates, ~4 ms at the measured
# ~1 us each): a 65,536-token history is complete after 256 lookups, a prompt of a few hundred tokens at once.
INDEX_SLICE = 256

if TYPE_CHECKING:
    from appliance.runtime.sequence import Sequence
    from appliance.runtime.tokenizer import Tokenizer


class _Lookup:
    """One sequence's history (prediction + prompt + output) and its n-gram index."""

    def __init__(self, prediction: list[int], token_ids: list[int], max_ngram: int, prompt_len: int):
        self.offset = len(prediction)  # history[offset + i] == seq.token_ids[i]
        self.history = prediction + list(token_ids)
        self.max_ngram = max(1, max_ngram)
        self.index: list[dict[tuple[int, ...], int]] = [{} for _ in range(self.max_ngram + 1)]
        self.indexed = 0  # ends of n-grams indexed so far: [1, indexed]
        # where the next token is expected to come from in history (None: look up); a prediction is where the
        # answer starts
        self.follow: int | None = 0 if prediction else None
        self.mark = self.offset + prompt_len  # history length when `follow` was set

    def sync(self, token_ids: list[int]) -> None:
        """Take the tokens appended since the last call; keep following the source while they match it."""
        new = token_ids[len(self.history) - self.offset :]
        if self.follow is not None:
            src = self.history[self.follow : self.follow + len(self.history) + len(new) - self.mark]
            seen = self.history[self.mark :] + new
            self.follow = self.follow + len(seen) if src == seen else None
            self.mark = len(self.history) + len(new)
        self.history += new

    def _index_to(self, end: int) -> None:
        """Index every n-gram ending at or before `end` (exclusive of the sequence's own last n-grams)."""
        h, index = self.history, self.index
        for e in range(self.indexed + 1, end + 1):
            for n in range(1, min(self.max_ngram, e) + 1):
                index[n][tuple(h[e - n : e])] = e
        self.indexed = max(self.indexed, end)

    def propose(self, k: int) -> list[int]:
        h, end = self.history, len(self.history)
        if self.follow is not None and self.follow < end:
            draft = h[self.follow : self.follow + k]
            self.mark = end
            return draft
        # occurrences that end before the last token (the suffix itself is not one), a slice per lookup
        self._index_to(min(end - 1, self.indexed + INDEX_SLICE))
        for n in range(min(self.max_ngram, end - 1), 0, -1):
            e = self.index[n].get(tuple(h[end - n :]))
            if e is not None:
                self.follow, self.mark = e, end
                return h[e : e + k]
        return []


class PromptLookup(Proposer):
    """Prompt-lookup drafts (OVMS / openvino_genai's prompt_lookup, vLLM's ngram)."""

    name = "prompt_lookup"

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def start(self, seq: Sequence) -> None:
        assert seq.spec is not None
        p = seq.params
        if p.prediction_ids is not None:  # tokenized once per request, off the engine thread (Engine.prepare)
            prediction = p.prediction_ids
        else:
            prediction = self.tokenizer.encode(p.prediction, add_special_tokens=False) if p.prediction else []
        seq.spec.data = _Lookup(prediction, seq.token_ids, seq.spec.max_ngram, seq.prompt_len)

    def propose(self, batch: list[tuple[Sequence, int]]) -> list[list[int]]:
        drafts = []
        for seq, k in batch:
            assert seq.spec is not None
            lookup: _Lookup = seq.spec.data
            lookup.sync(seq.token_ids)
            drafts.append(lookup.propose(k))
        return drafts

    def release(self, seq: Sequence) -> None:
        if seq.spec is not None:
            seq.spec.data = None
