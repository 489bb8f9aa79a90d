"""One sequence's speculation (SpecState): which proposer drafts for it, how many tokens, and what was accepted.

SpecState names its proposer (the engine's key for it) instead of holding it, so that this record, which
runtime/sequence.py holds, imports nothing (a proposer's interface names Sequence). How many tokens to draft: a
draft model pays for every token it drafts, so its k adapts: transformers'
"heuristic" schedule (all accepted: k + 2, else k - 1, between 1 and the request's num_assistant_tokens), and a
back-off for sequences whose drafts keep failing: after m proposals in a row with nothing accepted, skip 2**m steps
(at most MAX_PAUSE) before drafting again. Prompt lookup costs nothing to draft (`Proposer.adaptive` False): what
its drafts cost is the verification, set by the shape the step feeds (the engine pads drafts to a constant length:
appliance/runtime/engine/speculation.py says why, with the measurement), so its k is the policy's alone.

Whether a step speculates at all, and with which k, is the engine's SpeculationPolicy (speculative/policy.py): it
weighs each sequence's running acceptance (`rate`: decayed counts of the draft positions kept and of the first one
rejected, padding included, as that is what a step feeds) against the step costs measured at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_PAUSE = 64  # steps a failing sequence waits at most before it drafts again
DECAY = 0.7  # weight of the older observations at each new one: the rate follows the last ~3 steps
PRIOR = 0.3  # the rate of a sequence not observed yet: it starts plain unless steps are nearly free, and a shadow
# draft kept at every position (engine/speculation.py) takes it past 0.8


@dataclass(eq=False)
class SpecState:
    """One sequence's speculation: its proposer, how many tokens to draft next, and what was accepted."""

    proposer: str  # the proposer's name (Proposer.name: the engine's key for it, Speculation.proposers)
    max_k: int  # num_assistant_tokens: the most tokens one step drafts
    max_ngram: int = 3  # prompt lookup: the longest n-gram matched
    confidence: float | None = None  # draft model: stop drafting below this probability of its argmax
    k: int = 0  # tokens to draft next (starts at max_k)
    real: int = 0  # of this step's draft, the proposer's tokens (the rest is padding: not counted as drafts)
    proposed: int = 0  # draft tokens verified so far
    accepted: int = 0  # of which the model accepted
    pending: int = 0  # of the verification under way, the draft positions not yet kept or rejected
    misses: int = 0  # proposals in a row with nothing accepted
    pause: int = 0  # steps left before drafting again
    data: Any = None  # the proposer's own per-sequence state (an n-gram index, a draft KV table)
    kept: float = PRIOR  # decayed count of draft positions kept (padding included), for `rate`
    stopped: float = 1 - PRIOR  # decayed count of verifications that rejected a position
    shadow: tuple[int, tuple[int, ...]] | None = None  # (position, tokens) drafted, not fed: checked as they come

    def __post_init__(self) -> None:
        self.k = self.k or self.max_k

    @property
    def rejected(self) -> int:
        """Draft tokens verified and not kept. The positions a verification has not reached yet are left out, so a
        chunk emitted in the middle of one never counts a draft as rejected that the next position keeps."""
        return self.proposed - self.accepted - self.pending

    @property
    def rate(self) -> float:
        """The running probability that a draft position is kept, given the ones before it were."""
        return self.kept / (self.kept + self.stopped)

    def observe(self, kept: int, offered: int) -> None:
        """A verification kept `kept` of `offered` fed draft positions (or a shadow draft was checked against the
        tokens the steps produced: `settle`)."""
        self.kept = DECAY * self.kept + kept
        self.stopped = DECAY * self.stopped + (kept < offered)

    def settle(self, tokens: list[int]) -> None:
        """Checks the shadow draft against the sequence's tokens produced since it was made, and observes it once it
        is settled: a position missed, or every one kept. Until then it stays, and the sequence gets no other. Why a
        whole draft and not its first token: one kept first token (a common bigram in chat) took the rate from PRIOR
        to 0.71, enough for a 3-token verification at batch 1 even where it costs 1.6-1.8x a plain step (the default
        model on our kernels). On one chat prompt those drafts kept 0.20-0.23 of their positions and the request ran
        at 0.85x plain decoding (Zen 4, bench.speculative, two runs); settled whole, chat at batch 1 drafts nothing
        (1.01 / 1.05x) and grounded prompts keep their gain (1.11-1.16x at 2 and 4 clients)."""
        if self.shadow is None:
            return
        position, draft = self.shadow
        made = tokens[position : position + len(draft)]
        kept = 0
        while kept < len(made) and made[kept] == draft[kept]:
            kept += 1
        if kept < len(made) or kept == len(draft):
            self.observe(kept, len(draft))
            self.shadow = None

    def forget(self) -> None:
        """A step without an observation (the policy left this sequence out and nothing checked a draft of it):
        the rate drifts back toward PRIOR, so a sequence left out for a low rate is tried again later."""
        self.kept = DECAY * self.kept + (1 - DECAY) * PRIOR
        self.stopped = DECAY * self.stopped + (1 - DECAY) * (1 - PRIOR)

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
