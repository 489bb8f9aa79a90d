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
as one. Not where the step's tokens fit the backend's graphs of static shapes (Backend.fixed_shapes: the paged
backend's graphs of rows, one compiled per count): there a change of the count costs nothing and filler costs its
rows (the default model verifying 3 tokens took 9.4-9.9 ms, 6 tokens 13.6-14.2), so a draft is fed as it is, and
no draft none.

Rollback costs nothing: KV written for rejected positions lies past num_computed and is overwritten by the next
step; blocks allocated only for them go back to the pool (Scheduler.rollback), and only blocks full of accepted
tokens are named for the prefix cache. Where it is off: static shapes (one-token decode graphs), beam search, and
steps with more than speculation_max_batch decoding sequences.

Whether a step speculates, which sequences and with how many drafts, is the SpeculationPolicy's decision
(speculative/policy.py): the step costs by batch and tokens fed, timed on the engine's own backend (`measure`, at
load, only when the model speculates: timed later it would stall every running stream; then scaled by what the
engine's decode steps take, `observe`), against each sequence's running acceptance (SpecState.rate). The sequences
it leaves out still get a prompt-lookup draft of the length they would feed that is not fed (a "shadow", free to
make): the tokens the next steps produce tell how much of it would have been kept (SpecState.settle), so their rate
keeps up with the text and they speculate again when a copy starts. A draft model's drafts cost its own steps: the
time of its propose calls per drafted token is part of the cost (`draft_cost`).

Speculation is an object of the engine's (Engine.speculation), built with what it uses: the proposers, the
scheduler (its running sequences, rollback), the config (modes, k, speculation_max_batch), the counters and the step
costs the engine measured at load (None: no policy). The engine's own per-token steps reach it as arguments of
`verify` (sample, append, and `isolate`: an exception in one sequence's verification fails that sequence alone, as
everywhere in the step).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np

from appliance.config import EngineConfig
from appliance.params import SamplingParams
from appliance.runtime.backends.base import Backend, StepBatch
from appliance.runtime.kv_cache import BlockPool
from appliance.runtime.sampling import SampleOutput
from appliance.runtime.scheduler import Scheduler
from appliance.runtime.sequence import Sequence, Status
from appliance.runtime.speculative.base import Proposer
from appliance.runtime.speculative.ngram import PromptLookup
from appliance.runtime.speculative.policy import BATCHES, CONTEXT, FED, SpeculationPolicy, StepCosts, measure_step_costs
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


def measure(backend: Backend, pool: BlockPool, max_batch: int) -> StepCosts | None:
    """The step costs of `backend` (policy.measure_step_costs) up to batch `max_batch` (speculation_max_batch:
    larger batches never speculate): b sequences sharing one block table at a CONTEXT-token past, feeding n random
    tokens each (n > 1 with every position's logits, as a verification does). None when the pool has no room for
    it: then, as for a model that does not speculate by flag, a sequence that asks drafts its k on every step."""
    context = max(1, min(CONTEXT, backend.max_context - max(FED)))
    need = pool.blocks_for(context + max(FED))
    if not pool.can_allocate(need):
        return None
    blocks = pool.allocate(need)
    rng = np.random.default_rng(0)
    try:

        def forward(b: int, n: int) -> None:
            ids = rng.integers(100, 1000, (b, n)).tolist()
            backend.forward(StepBatch(ids, [context] * b, [blocks] * b, all_logits=[True] * b if n > 1 else None))

        costs = measure_step_costs(forward, [b for b in BATCHES if b <= max_batch] or [1], fixed=backend.fixed_shapes)
    finally:
        pool.free(blocks)
    log.info(
        "speculation: step costs measured in %.2f s: %s",
        costs.measured_s,
        {f"b{b}": [round(1e3 * t, 1) for t in row] for b, row in zip(costs.batches, costs.seconds)},
    )
    return costs


class Speculation:
    """Speculative decoding for the engine: `check` a request's parameters (any thread), `start` and `release` a
    sequence's SpecState, `propose` drafts before the schedule, `verify` them after the forward. `costs`: the step
    costs `measure` timed on the engine's backend at load, for the policy; None (the model does not speculate by
    flag, or the pool had no room to time them): every speculating sequence drafts its own k on every step."""

    def __init__(
        self,
        proposers: dict[str, Proposer],
        scheduler: Scheduler,
        config: EngineConfig,
        counters: dict[str, int],
        costs: StepCosts | None = None,
        fixed_shapes: int = 0,
    ):
        self.proposers, self.scheduler, self.config, self.counters = proposers, scheduler, config, counters
        self.fixed_shapes = fixed_shapes  # the backend's (Backend.fixed_shapes): up to it, drafts go unpadded
        self.policy = SpeculationPolicy(costs) if costs is not None and proposers else None
        self.draft_cost: dict[str, float] = {}  # proposer -> seconds per drafted token (adaptive proposers)
        self.planned = (0, 0)  # this step's decoding sequences and the tokens they feed, as `propose` left them

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
        if p.prediction or p.prediction_ids:  # the answer is expected to start as the prediction: draft at once
            seq.spec.kept, seq.spec.stopped = 0.9, 0.1
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
            self._planned(len(decoding), len(decoding))
            return
        candidates: list[tuple[Sequence, int]] = []
        for seq in decoding:
            spec = seq.spec
            if spec is None or seq.status is not Status.RUNNING:
                continue
            spec.settle(seq.token_ids)  # a draft not fed: would it have been kept, as far as the tokens tell?
            k = min(spec.k, seq.max_len - len(seq.token_ids) - 1)  # past max_len nothing would be kept
            if k > 0 and spec.ready():
                candidates.append((seq, k))
        if not candidates:
            self._planned(len(decoding), len(decoding))
            return
        policy = self.policy
        fed, shadows = len(decoding), []
        if policy is not None:
            ranked = sorted(candidates, key=lambda c: -c[0].spec.rate if c[0].spec else 0.0)
            names = {seq.spec.proposer for seq, _ in ranked if seq.spec}
            plan = policy.plan(
                len(decoding),
                [seq.spec.rate for seq, _ in ranked if seq.spec],
                max(k for _, k in ranked),
                self.config.max_num_batched_tokens,
                max(self.draft_cost.get(name, 0.0) for name in names),
            )
            candidates = [(seq, min(k, plan.k)) for seq, k in ranked[: plan.m]]
            for seq, _ in candidates:  # their verification tells what a shadow would
                if seq.spec is not None:
                    seq.spec.shadow = None
            shadows = [
                (seq, k)
                for seq, k in ranked[plan.m :]
                if seq.spec and seq.spec.shadow is None and not self._adaptive(seq)
            ]
            for seq, _ in ranked[plan.m :]:
                if seq.spec is not None and self._adaptive(seq):  # a draft model's drafts cost: no shadow
                    seq.spec.forget()
        asks: dict[str, list[tuple[Sequence, int]]] = {}
        for seq, k in candidates + shadows:
            assert seq.spec is not None
            asks.setdefault(seq.spec.proposer, []).append((seq, k))
        shadowed = {id(seq) for seq, _ in shadows}
        pad = len(decoding) + sum(k for _, k in candidates) > self.fixed_shapes  # the module docstring
        for name, batch in asks.items():
            proposer = self.proposers[name]
            t0 = time.perf_counter()
            try:
                drafts = proposer.propose(batch)
            except Exception:  # no drafts this step: the sequences decode as usual, their output is unchanged
                log.exception("speculation: %s failed to propose; decoding without drafts", name)
                continue
            if proposer.adaptive:  # a draft model: what its drafts cost per token, for the policy
                per_token = (time.perf_counter() - t0) / max(1, sum(k for _, k in batch))
                self.draft_cost[name] = 0.8 * self.draft_cost.get(name, per_token) + 0.2 * per_token
            for (seq, k), draft in zip(batch, drafts):
                assert seq.spec is not None
                tokens = [int(t) for t in draft[:k]]
                real = len(tokens)
                if pad and (tokens or not proposer.adaptive):  # the same fed shape every step (module docstring)
                    tokens += [tokens[-1] if tokens else seq.token_ids[-1]] * (k - len(tokens))
                if id(seq) in shadowed:  # what a verification would feed, padding included
                    seq.spec.shadow = (len(seq.token_ids), tuple(tokens))
                    continue
                seq.draft, seq.spec.real = tokens, real
                fed += len(seq.draft)
        self._planned(len(decoding), fed)

    def _planned(self, b: int, fed: int) -> None:
        """This step's b decoding sequences feed `fed` tokens in all (for the policy's next shape, and to
        `observe` the step's time if the schedule runs them alone and uncut and the policy finds such a step
        observable)."""
        if self.policy is None:
            return
        self.planned = (b, fed) if self.policy.observable(fed) else (0, 0)
        self.policy.fed(fed)

    def observe(self, sequences: int, tokens: int, seconds: float) -> None:
        """The step's forward ran `sequences` sequences feeding `tokens` in `seconds`: a decode step as planned
        (no prompt chunk beside it, no draft cut short) tells the policy what such steps cost now."""
        if self.policy is not None and (sequences, tokens) == self.planned and sequences:
            self.policy.observe(sequences, tokens, seconds)

    def _adaptive(self, seq: Sequence) -> bool:
        return seq.spec is not None and self.proposers[seq.spec.proposer].adaptive

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
            seq.spec.pending = seq.spec.real
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
                        seq.spec.pending -= 1
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
        spec.observe(accepted, len(seq.draft))
        spec.pending = 0  # the positions past the first miss: rejected
        seq.draft = []
        if seq.status is Status.FINISHED:
            return
        self.scheduler.computed(seq)
        self.scheduler.rollback(seq)
        proposer.accepted(seq)
