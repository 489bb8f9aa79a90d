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
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from appliance.params import SamplingParams
from appliance.runtime.engine.state import EngineState
from appliance.runtime.sequence import Sequence, Status
from appliance.runtime.speculative.base import Proposer, SpecState
from appliance.runtime.speculative.ngram import PromptLookup

if TYPE_CHECKING:
    from appliance.runtime.sampling import SampleOutput

log = logging.getLogger("appliance.runtime.engine")

Verify = list[tuple[Sequence, np.ndarray]]  # a verifying sequence and the logits of its fed positions


class Speculation(EngineState):
    """Engine's speculative decoding (a part of Engine: see state.py for the state it uses)."""

    def _load_proposers(self) -> None:
        """Prompt lookup on every paged model (a request may ask for it); a draft model when configured."""
        self.proposers = {}
        mode = self.config.speculative()
        if self.backend.max_batch is not None:
            if mode:
                raise ValueError(
                    f"speculative decoding ({mode}) needs paged attention: static shapes decode one token per slot"
                )
            return
        self.proposers["prompt_lookup"] = PromptLookup(self.tokenizer)
        if self.config.draft_model:
            from appliance.runtime.speculative.draft import DraftModel

            self.proposers["draft"] = DraftModel(
                self.config.draft_model,
                self.config,
                self.model_dir,
                self.config.max_num_batched_tokens,
                kv_tokens=self.pool.num_blocks * self.pool.block_size,
            )

    def _check_speculation(self, p: SamplingParams) -> None:
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

    def _start_speculation(self, seq: Sequence) -> None:
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
        proposer = self.proposers[name]
        seq.spec = SpecState(
            proposer,
            max_k=p.num_assistant_tokens or config.num_assistant_tokens,
            max_ngram=p.max_ngram_size or config.max_ngram_size,
            confidence=p.assistant_confidence_threshold,
        )
        proposer.start(seq)

    def _release_speculation(self, seq: Sequence) -> None:
        if seq.spec is not None:
            seq.draft = []
            try:
                seq.spec.proposer.release(seq)
            except Exception:  # the request is ending anyway; a proposer bug must not keep it from ending
                log.exception("speculation: could not release request %s", seq.request_id)

    def _propose(self) -> None:
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
        asks: dict[Proposer, list[tuple[Sequence, int]]] = {}
        for seq in decoding:
            spec = seq.spec
            if spec is None or seq.status is not Status.RUNNING:
                continue
            k = min(spec.k, seq.max_len - len(seq.token_ids) - 1)  # past max_len nothing would be kept
            if k > 0 and spec.ready():
                asks.setdefault(spec.proposer, []).append((seq, k))
        for proposer, batch in asks.items():
            try:
                drafts = proposer.propose(batch)
            except Exception:  # no drafts this step: the sequences decode as usual, their output is unchanged
                log.exception("speculation: %s failed to propose; decoding without drafts", proposer.name)
                continue
            for (seq, k), draft in zip(batch, drafts):
                seq.draft = [int(t) for t in draft[:k]]
                assert seq.spec is not None
                seq.spec.real = len(seq.draft)
                if seq.draft or not proposer.adaptive:  # the same fed shape every step (module docstring)
                    seq.draft += [seq.draft[-1] if seq.draft else seq.token_ids[-1]] * (k - len(seq.draft))

    def _verify(self, verifying: Verify) -> None:
        """Keep each sequence's drafts up to the first one its sampler does not draw (module docstring)."""
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
            for seq, out, r in self._sample(logits, [(seq, i) for i, seq in enumerate(active)]):
                with self._isolated(seq):
                    token = int(out.token_ids[r])
                    seq.num_computed = start[id(seq)] + j + 1  # the KV of the token fed at position j
                    hit = j < len(seq.draft) and token == seq.draft[j]
                    assert seq.spec is not None
                    if hit and j < seq.spec.real:  # a padding token the model also drew is kept, not counted
                        seq.spec.accepted += 1
                        self.counters["accepted_draft_tokens"] += 1
                    self._append(seq, token, out, r)
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
        if spec.proposer.adaptive and spec.real:
            spec.adapt(spec.real, min(accepted, spec.real))
        seq.draft = []
        if seq.status is Status.FINISHED:
            return
        self.scheduler.computed(seq)
        self.scheduler.rollback(seq)
        spec.proposer.accepted(seq)

    if TYPE_CHECKING:

        def _sample(
            self, logits: np.ndarray, ready: list[tuple[Sequence, int]]
        ) -> list[tuple[Sequence, SampleOutput, int]]: ...
        def _append(self, seq: Sequence, token: int, out: SampleOutput, j: int) -> None: ...
