"""Beam search (`best_of` > 1, OVMS semantics: num_beams = best_of, the n best hypotheses are returned).

The selection rule is transformers' `generate(num_beams=B, do_sample=False, length_penalty=lp, early_stopping=es)`
for es True or False (its default), step for step:

  1. every running beam's next-token log-probabilities (log-softmax, then the logits processors) plus the beam's
     running sum give B x V candidates; the best K = max(2, 1 + #stop tokens) * B are kept, best first
     (#stop tokens capped at WIDTH_STOP_TOKENS, see BeamSearch);
  2. a candidate that ends its sequence (a stop token, a stop string, max_tokens) becomes a finished hypothesis
     with score sum / generated_len ** length_penalty, but only if it ranks among the first B of the K (the
     others are only there so that B candidates can keep running); the pool keeps the B best hypotheses;
  3. the best B candidates that did not end are the next running beams;
  4. the search stops when every candidate ended (max_tokens: all beams have the same length), or when the pool
     is full and either early_stopping is True (Friendli's `early_stopping`: B finished hypotheses are enough,
     whatever the running beams could still reach), or the best running beam, scored as if it ended now, cannot
     beat the worst hypothesis in the pool (transformers' heuristic for early_stopping=False). True therefore
     never runs more steps than False on the same logits, and may return worse-scored hypotheses.

`BeamSearch` is that state machine on plain arrays; the engine owns the sequences, their KV blocks (a fork shares
the parent's full blocks and copies its partly filled last block) and the text.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

P = TypeVar("P")  # what a finished hypothesis carries (the engine: its tokens, logprobs, finish reason)


@dataclass
class Candidate:
    beam: int  # index of the parent among the running beams passed in
    token: int
    score: float  # the parent's running sum plus this token's (processed) log-probability
    rank: int  # position among the kept candidates, 0 = best


@dataclass(order=True)
class Hypothesis(Generic[P]):
    score: float  # length-penalised: sum / generated_len ** length_penalty
    seq: int = field(compare=False, default=0)  # insertion order (older first among equal scores)
    payload: P | None = field(compare=False, default=None)  # None when update() was given no payloads


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float32 [R, V] log-probabilities (sums in float64)."""
    x = np.asarray(logits, dtype=np.float32)
    mx = x.max(axis=1, keepdims=True)
    lse = mx + np.log(np.exp(x - mx).sum(axis=1, keepdims=True, dtype=np.float64)).astype(np.float32)
    return x - lse


def top_continuations(logprobs: np.ndarray, scores: np.ndarray, k: int) -> list[Candidate]:
    """The k best (beam, token) continuations of logprobs[R, V] + scores[R], best first; ties: lower flat index
    (beam-major), as a stable sort would. Non-finite totals (masked tokens) are never returned."""
    R, V = logprobs.shape
    total = (logprobs + np.asarray(scores, np.float32)[:, None]).reshape(-1)
    k = min(k, total.size)
    part = np.argpartition(-total, k - 1)[:k] if k < total.size else np.arange(total.size)
    order = np.lexsort((part, -total[part]))
    out = []
    for rank, flat in enumerate(part[order]):
        if not np.isfinite(total[flat]):
            break
        out.append(Candidate(int(flat // V), int(flat % V), float(total[flat]), rank))
    return out


# Stop tokens counted in the candidate width. transformers sizes it for a model's handful of EOS ids; a client's
# stop_token_ids list must not widen it (each kept candidate costs a Python object and a stop check per step).
WIDTH_STOP_TOKENS = 8


class BeamSearch(Generic[P]):
    """The search state. Candidate width: max(2, 1 + min(num_stop_tokens, WIDTH_STOP_TOKENS)) * num_beams.

    Why a capped width stays correct: the kept candidates only have to hold num_beams continuations that do not
    end (the next running beams) plus the ending ones that rank in the first num_beams. Each beam has at most
    #stop-token ending continuations, so with #stop tokens <= WIDTH_STOP_TOKENS (every model's EOS set, plus a
    few stop_token_ids) the width is transformers' own and the steps are identical. With more, a step in which
    more than WIDTH_STOP_TOKENS * num_beams of the best candidates end runs with fewer beams for that step (the
    finished hypotheses are still the best ones among those ranked first); nothing is wrong, the search is just
    narrower than transformers' there. Stop strings and max_tokens can end any candidate, so the width never
    covered them anyway.
    """

    def __init__(
        self, num_beams: int, length_penalty: float = 1.0, num_stop_tokens: int = 1, early_stopping: bool = False
    ):
        if num_beams < 1:
            raise ValueError("num_beams must be >= 1")
        self.num_beams = num_beams
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.width = max(2, 1 + min(num_stop_tokens, WIDTH_STOP_TOKENS)) * num_beams  # candidates kept per step
        self.finished: list[Hypothesis[P]] = []  # best first, at most num_beams
        self.done = False
        self._count = 0

    def candidates(self, logprobs: np.ndarray, scores) -> list[Candidate]:
        """Step 1. `logprobs` [R, V]: the running beams' processed log-probabilities, `scores` their sums."""
        return top_continuations(logprobs, np.asarray(scores, np.float32), self.width)

    def normalized(self, score: float, generated_len: int) -> float:
        """score / generated_len ** length_penalty (transformers), for any length_penalty: never raises. Sane
        values take transformers' own expression (bit for bit); where the power overflows (2 ** 2000) or
        underflows to 0 (2 ** -2000), the quotient is taken in logs and saturates to +-inf or 0."""
        try:
            return score / generated_len**self.length_penalty
        except (OverflowError, ZeroDivisionError):
            if score == 0.0:
                return 0.0
            exponent = math.log(abs(score)) - self.length_penalty * math.log(generated_len)
            return math.copysign(math.exp(exponent) if exponent < 709.0 else math.inf, score)

    def update(
        self, cands: list[Candidate], ended: list[bool], generated_len: int, payloads: list[P | None] | None = None
    ) -> list[Candidate]:
        """Steps 2-4. `ended[i]`: candidate i ends its sequence; `generated_len`: tokens generated by every
        candidate (this one included); `payloads[i]` is kept with a finished hypothesis. Returns the next running
        beams, best first (empty when the search is done)."""
        for i, (c, end) in enumerate(zip(cands, ended)):
            if end and c.rank < self.num_beams:
                self._add(self.normalized(c.score, generated_len), payloads[i] if payloads else None)
        running = [c for c, end in zip(cands, ended) if not end][: self.num_beams]
        if not running:
            self.done = True
        elif len(self.finished) >= self.num_beams and (
            self.early_stopping or self.normalized(running[0].score, generated_len) <= self.finished[-1].score
        ):
            self.done = True
        return [] if self.done else running

    def _add(self, score: float, payload: P | None) -> None:
        self._count += 1
        hyp = Hypothesis(score, self._count, payload)
        # after every hypothesis with a score >= this one (older first on ties)
        at = next((i for i, h in enumerate(self.finished) if h.score < score), len(self.finished))
        self.finished.insert(at, hyp)
        del self.finished[self.num_beams :]

    def best(self, n: int) -> list[Hypothesis[P]]:
        return self.finished[:n]


def fork_sampler(sampler):
    """A copy of a SequenceSampler whose token history (penalties, min_tokens, bans) evolves separately."""
    new = copy.copy(sampler)
    new.output_ids = list(sampler.output_ids)
    new.seen = copy.deepcopy(sampler.seen)
    new.generated = copy.deepcopy(sampler.generated)
    new.bans = copy.copy(sampler.bans)  # Bans.__copy__: the generated n-gram index is the beam's own
    return new
