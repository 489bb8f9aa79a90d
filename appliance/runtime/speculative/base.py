"""What a proposer is, and the per-sequence state that decides how many tokens it drafts.

Speculative decoding reads the weights once for several tokens: a proposer drafts k tokens to follow a sequence, the
model computes all k + 1 positions in one step (the sequence's last token and the draft), and the engine keeps the
draft's prefix that the model itself would have produced, plus the model's own next token after it
(runtime/engine/speculation.py). At batch 1 a small model is bound by memory bandwidth, so the step costs about
what a one-token step does.

Every proposer here is deterministic given the context (prompt lookup copies tokens, a draft model drafts its
argmax), so the draft distribution q is a point mass at the drafted token c. Standard speculative sampling (Leviathan
et al. 2023) then accepts c with probability min(1, p(c) / q(c)) = p(c) and on rejection draws from the normalized
max(0, p - q) = p without c: that is exactly "draw from p and accept while the draw equals the draft". The engine does
that draw with the sequence's own sampler (penalties, bans, grammar, seed), so the output is the non-speculative one:
greedy token for token, sampling the same distribution, and with a seed the same tokens.

How many tokens to draft (SpecState). A draft model pays for every token it drafts, so its k adapts: transformers'
"heuristic" schedule (all accepted: k + 2, else k - 1, between 1 and the request's num_assistant_tokens), and a
back-off for sequences whose drafts keep failing: after m proposals in a row with nothing accepted, skip 2**m steps
(at most MAX_PAUSE) before drafting again. Prompt lookup costs nothing to draft, so it always drafts max_k
(`Proposer.adaptive` False): what its drafts cost is the verification, and that cost is set by the shape the step
feeds, not by how many of the fed tokens are drafts (the engine pads drafts to a constant length:
appliance/runtime/engine/speculation.py says why, with the measurement).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from appliance.runtime.sequence import Sequence

MAX_PAUSE = 64  # steps a failing sequence waits at most before it drafts again


@dataclass(eq=False)
class SpecState:
    """One sequence's speculation: its proposer, how many tokens to draft next, and what was accepted."""

    proposer: Proposer
    max_k: int  # num_assistant_tokens: the most tokens one step drafts
    max_ngram: int = 3  # prompt lookup: the longest n-gram matched
    confidence: float | None = None  # draft model: stop drafting below this probability of its argmax
    k: int = 0  # tokens to draft next (starts at max_k)
    real: int = 0  # of this step's draft, the proposer's tokens (the rest is padding: not counted as drafts)
    proposed: int = 0  # draft tokens verified so far
    accepted: int = 0  # of which the model accepted
    misses: int = 0  # proposals in a row with nothing accepted
    pause: int = 0  # steps left before drafting again
    data: Any = None  # the proposer's own per-sequence state (an n-gram index, a draft KV table)

    def __post_init__(self) -> None:
        self.k = self.k or self.max_k

    @property
    def rejected(self) -> int:
        return self.proposed - self.accepted

    def ready(self) -> bool:
        """Draft this step? (counts a paused step down)"""
        if self.pause:
            self.pause -= 1
            return False
        return self.max_k > 0

    def adapt(self, proposed: int, accepted: int) -> None:
        """After a verification of `proposed` draft tokens of which the first `accepted` were kept (the engine
        counts them in `proposed` / `accepted` as it goes)."""
        self.k = min(self.max_k, self.k + 2) if accepted == proposed else max(1, self.k - 1)
        self.misses = 0 if accepted else self.misses + 1
        self.pause = min(MAX_PAUSE, 2**self.misses) if self.misses else 0


class Proposer(ABC):
    """Drafts tokens for running sequences. Owned by one engine, called on its thread only.

    propose: for each (sequence, k), at most k tokens to follow seq.token_ids (fewer or none is fine: a sequence with
    an empty draft decodes one token as usual). accepted: after the verification, seq.token_ids and seq.num_computed
    are final for the step (a proposer with its own KV drops the positions past them). release: the sequence ended
    or was preempted; free what the proposer holds for it (called at least once per sequence that had a SpecState)."""

    name: str = ""
    adaptive: bool = False  # drafting costs (a model runs): adapt k and back off (SpecState.adapt)

    def start(self, seq: Sequence) -> None:  # noqa: B027 (optional: state set up when the sequence starts)
        """The sequence starts (its SpecState is set): set up seq.spec.data."""

    @abstractmethod
    def propose(self, batch: list[tuple[Sequence, int]]) -> list[list[int]]: ...

    def accepted(self, seq: Sequence) -> None:  # noqa: B027 (optional)
        """The step's verification of seq is done."""

    def release(self, seq: Sequence) -> None:  # noqa: B027 (optional)
        """seq ended or was preempted."""

    def stats(self) -> dict[str, int]:
        """Gauges for /metrics (e.g. a draft model's KV blocks in use)."""
        return {}

    def close(self) -> None:  # noqa: B027 (optional)
        """Release device memory; the proposer is unusable afterwards."""
