"""Speculative decoding in the step: drafts before the schedule, verification in the postprocess.

A speculating sequence feeds its last token and its k draft tokens in one forward, with the logits of every fed
position (StepBatch.all_logits, the path prompt logprobs use), batched with everything else in the step. The
verification then goes position by position, all verifying sequences together (one sample_batch per position): the
token the sequence's own sampler draws from position j's logits is appended as a normal decode would append it (its
penalties, bans, grammar, stop rules, logprobs, a chunk), and while it equals draft token j the next position is
valid too. The first disagreement ends it: that drawn token is the model's own next token, so every step keeps at
least one token, and k accepted drafts give k + 1. appliance/runtime/speculative/base.py says why this keeps the output
exactly what non-speculative decoding gives.

The fed shape stays the same from step to step: a draft shorter than k (for prompt lookup also none) is padded to
k with filler (its last token repeated). OpenVINO's CPU plugin pays ~15-25 ms whenever the number of fed tokens
changes from one call to the next (+25-35% of a default-model step at batch 1), while 1 to 6 tokens fed at a
constant count cost the same (`python -m bench.speculative --only shapes`); with adaptive, often empty drafts 64% of
the steps fed one token and prompt lookup reached 1.44x the plain engine on grounded prompts, padded 2.3-2.4x
(docs/performance.md). Padding is verified like a draft (a filler token the model draws is kept) but not counted
as one.

Rollback costs nothing: KV written for rejected positions lies past num_computed and is overwritten by the next
step; blocks allocated only for them go back to the pool (Scheduler.rollback), and only blocks full of accepted
tokens are named for the prefix cache. Where it is off: static shapes (one-token decode graphs), beam search, and
steps with more than speculation_max_batch decoding sequences (compute-bound already).

Speculation is an object of the engine's (Engine.speculation), built with what it uses: the proposers, the
scheduler (its running sequences, rollback), the config (modes, k, speculation_max_batch) and the counters. The
engine's own per-token steps reach it as arguments of `verify` (sample, append, and `isolate`: an exception in one
sequence's verification fails that sequence alone, as everywhere in the step).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np

from appliance.config import EngineConfig
from appliance.params import SamplingParams
from appliance.runtime.sampling import SampleOutput
from appliance.runtime.scheduler import Scheduler
from appliance.runtime.sequence import Sequence, Status
from appliance.runtime.speculative.base import Proposer
from appliance.runtime.speculative.ngram import PromptLookup
from appliance.runtime.speculative.state import SpecState
from appliance.runtime.tokenizer import Tokenizer

log = logging.getLogger("appliance.runtime.engine")

Verify = list[tuple[Sequence, np.ndarray]]  # a verifying sequence and the logits of its fed positions
# the engine's steps that verify uses (Engine._sample, _append, _isolated)
Sample = Callable[[np.ndarray, list[tuple[Sequence, int]]], list[tuple[Sequence, SampleOutput, int]]]
Append = Callable[[Sequence, int, SampleOutput, int], None]
Isolate = Callable[[Sequence], AbstractContextManager[None]]


def load_proposers(
    config: EngineConfig, model_dir: Path, tokenizer: Tokenizer, paged: bool, kv_tokens: int
) -> dict[str, Proposer]:
    """Prompt lookup on every paged model (a request may ask for it); a draft model when configured. By name."""
    proposers: dict[str, Proposer] = {}
    mode = config.speculative()
    if not paged:
        if mode:
            raise ValueError(
                f"speculative decoding ({mode}) needs paged attention: static shapes decode one token per slot"
            )
        return proposers
    proposers["prompt_lookup"] = PromptLookup(tokenizer)
    if config.draft_model:
        from appliance.runtime.speculative.draft import DraftModel

        proposers["draft"] = DraftModel(
            config.draft_model, config, model_dir, config.max_num_batched_tokens, kv_tokens=kv_tokens
        )
    return proposers


class Speculation:
    """Speculative decoding for the engine: `check` a request's parameters (any thread), `start` and `release` a
    sequence's SpecState, `propose` drafts before the schedule, `verify` them after the forward."""

    def __init__(
        self, proposers: dict[str, Proposer], scheduler: Scheduler, config: EngineConfig, counters: dict[str, int]
    ):
        self.proposers, self.scheduler, self.config, self.counters = proposers, scheduler, config, counters

    def check(self, p: SamplingParams) -> None:
        """A request's speculation parameters, on the caller's thread (ValueError: 400). `prediction` is a hint:
        taken where prompt lookup runs, of no effect on static shapes."""
        given = [
            name
            for name in ("num_assistant_tokens", "assistant_confidence_threshold", "max_ngram_size")
            if getattr(p, name) is not None
        ]
        if not given:
            return
        if not self.proposers:
            raise ValueError(f"{given[0]}: speculative decoding needs paged attention; this model runs static shapes")
        if p.num_assistant_tokens is not None and p.assistant_confidence_threshold is not None:
            raise ValueError("num_assistant_tokens and assistant_confidence_threshold cannot be used together")
        if p.assistant_confidence_threshold is not None and "draft" not in self.proposers:
            raise ValueError("assistant_confidence_threshold needs a draft model (serve with --draft-model)")

    def start(self, seq: Sequence) -> None:
        """seq's SpecState, if it speculates: the model's mode, or prompt lookup when the request asks for it."""
        p, config = seq.params, self.config
        if not self.proposers or p.num_assistant_tokens == 0 or (p.best_of or 1) > 1:
            return
        if p.assistant_confidence_threshold is not None:
            name: str | None = "draft"
        elif p.prediction or p.prediction_ids or p.max_ngram_size is not None:
            name = "prompt_lookup"
        else:
            name = config.speculative()
        if name is None:
            return
        seq.spec = SpecState(
            name,
            max_k=p.num_assistant_tokens or config.num_assistant_tokens,
            max_ngram=p.max_ngram_size or config.max_ngram_size,
            confidence=p.assistant_confidence_threshold,
        )
        self.proposers[name].start(seq)

    def release(self, seq: Sequence) -> None:
        """seq ends: its proposer frees what it holds for it."""
        if seq.spec is not None:
            seq.draft = []
            try:
                self.proposers[seq.spec.proposer].release(seq)
            except Exception:  # the request is ending anyway; a proposer bug must not keep it from ending
                log.exception("speculation: could not release request %s", seq.request_id)

    def propose(self) -> None:
        """Drafts for the sequences that decode this step (before the schedule, which may shorten them)."""
        if not self.proposers:
            return
        decoding = []
        for seq in self.scheduler.running:
            seq.draft = []  # a draft the last schedule did not feed is stale
            if seq.num_computed == len(seq.token_ids) - 1:
                decoding.append(seq)
        if not decoding or len(decoding) > self.config.speculation_max_batch:
            return
        asks: dict[str, list[tuple[Sequence, int]]] = {}
        for seq in decoding:
            spec = seq.spec
            if spec is None or seq.status is not Status.RUNNING:
                continue
            k = min(spec.k, seq.max_len - len(seq.token_ids) - 1)  # past max_len nothing would be kept
            if k > 0 and spec.ready():
                asks.setdefault(spec.proposer, []).append((seq, k))
        for name, batch in asks.items():
            proposer = self.proposers[name]
            try:
                drafts = proposer.propose(batch)
            except Exception:  # no drafts this step: the sequences decode as usual, their output is unchanged
                log.exception("speculation: %s failed to propose; decoding without drafts", name)
                continue
            for (seq, k), draft in zip(batch, drafts):
                seq.draft = [int(t) for t in draft[:k]]
                assert seq.spec is not None
                seq.spec.real = len(seq.draft)
                if seq.draft or not proposer.adaptive:  # the same fed shape every step (module docstring)
                    seq.draft += [seq.draft[-1] if seq.draft else seq.token_ids[-1]] * (k - len(seq.draft))

    def verify(self, verifying: Verify, sample: Sample, append: Append, isolate: Isolate) -> None:
        """Keep each sequence's drafts up to the first one its sampler does not draw (module docstring): each
        position's token drawn with `sample`, kept with `append` (the engine's decode path), each sequence's
        part inside `isolate`."""
        start = {id(seq): seq.num_computed for seq, _ in verifying}
        rows = {id(seq): logits for seq, logits in verifying}
        for seq, _ in verifying:
            assert seq.spec is not None
            seq.spec.real = min(seq.spec.real, len(seq.draft))  # the schedule may have cut the draft short
            seq.spec.proposed += seq.spec.real
            self.counters["draft_tokens"] += seq.spec.real
        active, j = [seq for seq, _ in verifying], 0
        while active:
            going = []
            logits = np.stack([rows[id(seq)][j] for seq in active])
            for seq, out, r in sample(logits, [(seq, i) for i, seq in enumerate(active)]):
                with isolate(seq):
                    token = int(out.token_ids[r])
                    seq.num_computed = start[id(seq)] + j + 1  # the KV of the token fed at position j
                    hit = j < len(seq.draft) and token == seq.draft[j]
                    assert seq.spec is not None
                    if hit and j < seq.spec.real:  # a padding token the model also drew is kept, not counted
                        seq.spec.accepted += 1
                        self.counters["accepted_draft_tokens"] += 1
                    append(seq, token, out, r)
                    if hit and seq.status is not Status.FINISHED:
                        going.append(seq)
                    else:
                        self._verified(seq, j + hit)
            active, j = going, j + 1

    def _verified(self, seq: Sequence, accepted: int) -> None:
        """seq's verification is over with `accepted` drafts kept: name its full blocks, give back the blocks of
        rejected positions, adapt k, let the proposer roll back."""
        spec = seq.spec
        assert spec is not None
        proposer = self.proposers[spec.proposer]
        if proposer.adaptive and spec.real:
            spec.adapt(spec.real, min(accepted, spec.real))
        seq.draft = []
        if seq.status is Status.FINISHED:
            return
        self.scheduler.computed(seq)
        self.scheduler.rollback(seq)
        proposer.accepted(seq)
