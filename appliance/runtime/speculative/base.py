"""What a proposer is, and why verifying its drafts keeps the output exact.

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

How many tokens to draft, per sequence: SpecState (speculative/state.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from appliance.runtime.sequence import Sequence


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
