"""Beam search inside the engine: a request with best_of > 1 is a group of sequences (its live beams) that share
KV blocks and advance together.

The search itself (which candidates survive, finished hypotheses, length penalty) is the pure state machine in
appliance/runtime/beam_search.py. Here is what it means for sequences and KV: a step's logits are collected per group
until every beam's row is in; then the best continuation of a beam extends it in place and each further one
forks it (the fork shares the parent's full KV blocks and gets a copy of its partly filled last block). All beams
of a search must fit the KV pool and the sequence slots together (checked at submit), or they could wait on each
other forever; when nothing can run because every running beam waits for a sibling that cannot be admitted, the
oldest search is let through alone (`unstall`). The n best hypotheses leave as one whole-choice Chunk each.

BeamSearches is an object of the engine's (Engine.beams), built with what it uses: the scheduler and the pool (forks and
room), the tokenizer (stop strings, logprob texts, the result's text), the backend's block
copy and the counters. A search's own record, BeamGroup, lives beside Sequence (runtime/sequence.py). The step hands
it each beam's logits row with the engine's `isolate`, so a search that raises fails alone, as everywhere in the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np

from appliance.outputs import Chunk, TokenLogprob
from appliance.runtime.beam_search import Candidate, Hypothesis, fork_sampler, log_softmax
from appliance.runtime.detokenizer import IncrementalDetokenizer
from appliance.runtime.engine.logprobs import token_text
from appliance.runtime.engine.text import text_step
from appliance.runtime.kv_cache import BlockPool
from appliance.runtime.sampling import apply_processors, ranked
from appliance.runtime.scheduler import Scheduler
from appliance.runtime.sequence import BeamGroup, BeamPayload, Sequence, Status
from appliance.runtime.stopping import StopStringMatcher, check_token_stop
from appliance.runtime.tokenizer import Tokenizer

CopyTails = Callable[[list[tuple[int, int, int]]], None]  # runs the (src, dst, positions) copies forks queued
Isolate = Callable[[Sequence], AbstractContextManager[None]]  # the engine's _isolated


class BeamSearches:
    """The engine's beam searches: `collect` feeds them a step's rows, `unstall` lets the oldest through when
    nothing can run, `finish` ends one (its results, or an abort)."""

    def __init__(
        self,
        scheduler: Scheduler,
        pool: BlockPool,
        tokenizer: Tokenizer,
        copy_tails: CopyTails,
        counters: dict[str, int],
    ):
        self.scheduler, self.pool, self.tokenizer = scheduler, pool, tokenizer
        self.copy_tails, self.counters = copy_tails, counters

    def collect(self, beams: list[tuple[Sequence, int]], logits: np.ndarray, isolate: Isolate) -> None:
        """Collect the step's logits row of each beam (sequence, row); a group whose beams are all in steps. Each
        beam's part runs inside `isolate`: a search that raises fails alone."""
        for seq, i in beams:
            group = seq.group
            assert group is not None  # `beams` holds beams only (Engine._computed)
            if group.done or seq not in group.beams:
                continue
            with isolate(seq):
                group.logits[seq] = np.array(logits[i], dtype=np.float32)
                if len(group.logits) == len(group.beams):
                    self._step(group)

    def _step(self, group: BeamGroup) -> None:
        """All beams' logits are in: pick the next beams (beam_search.BeamSearch), then fork / extend / drop the
        sequences. The best continuation of a beam extends it in place; each further one forks it: the fork
        shares the parent's full KV blocks and gets a copy of its partly filled last block."""
        p, beams, search = group.params, group.beams, group.search
        root = group.root
        if root.first_token is None:
            root.first_token = time.monotonic()
        raw = log_softmax(np.stack([group.logits[s] for s in beams]))
        group.logits.clear()
        scores = apply_processors(raw, [s.sampler for s in beams])  # as transformers: on the log-probabilities
        cands = search.candidates(scores, [s.beam_score for s in beams])
        generated = beams[0].num_generated + 1  # every beam has the same length
        full = len(beams[0].token_ids) + 1 >= beams[0].max_len
        reasons = [self._beam_stop(beams[c.beam], c.token, generated, full) for c in cands]
        top = ranked(raw, p.logprobs) if p.logprobs else None
        tok = self.tokenizer

        def entry(c) -> TokenLogprob | None:
            if p.logprobs is None:
                return None
            row = raw[c.beam]
            alts = [] if top is None else [(int(i), token_text(tok, int(i)), float(row[i])) for i in top[c.beam]]
            return TokenLogprob(c.token, token_text(tok, c.token), float(raw[c.beam, c.token]), alts)

        payloads: list[BeamPayload | None] = [
            (beams[c.beam].generated + [c.token], self._beam_logprobs(beams[c.beam], entry(c)), r)
            if r is not None and c.rank < search.num_beams
            else None
            for c, r in zip(cands, reasons)
        ]
        running = search.update(cands, [r is not None for r in reasons], generated, payloads)
        if search.done:
            self.finish(group, [self._beam_chunk(group, h) for h in search.best(p.n)])
            return
        self.counters["generated_tokens"] += len(running)
        kept: dict[int, Candidate] = {}
        forks = []
        for c in running:
            if c.beam in kept:
                forks.append(c)
            else:
                kept[c.beam] = c
        for b, seq in enumerate(beams):  # beams without a continuation leave first: their KV makes room
            if b not in kept:
                self.scheduler.finish(seq)
        copies: list[tuple[int, int, int]] = []
        children = {id(c): self._fork_beam(beams[c.beam], c, entry(c), copies) for c in forks}  # parents unchanged yet
        self.copy_tails(copies)
        for b, c in kept.items():
            seq = beams[b]
            seq.token_ids.append(c.token)
            seq.sampler.append(c.token)
            seq.beam_score = c.score
            if p.logprobs is not None:
                seq.beam_logprobs = self._beam_logprobs(seq, entry(c))
        group.beams = [children[id(c)] if id(c) in children else beams[c.beam] for c in running]

    @staticmethod
    def _beam_logprobs(seq: Sequence, entry: TokenLogprob | None) -> list[TokenLogprob] | None:
        return None if entry is None else (seq.beam_logprobs or []) + [entry]

    def _beam_stop(self, parent: Sequence, token: int, generated: int, context_full: bool) -> str | None:
        """Whether parent + token ends: "stop" (a stop token), "stop_string", "length", or None."""
        p = parent.params
        tail = parent.token_ids + [token] if p.stop_token_sequences else ()
        reason = check_token_stop(token, generated, p, parent.sampler.stop_set, context_full, tail)
        if reason != "stop" and p.stop:
            assert parent.group is not None  # parent is a beam
            window = parent.group.stop_window  # tokens: enough to hold any stop string that ends here (bounded)
            ids = parent.token_ids[max(parent.prompt_len, len(parent.token_ids) - window) :] + [token]
            text = self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
            if any(s in text for s in p.stop):  # a running beam holds no stop string: a match is new
                reason = "stop_string"
        return reason

    def _fork_beam(self, parent: Sequence, c, entry: TokenLogprob | None, copies: list) -> Sequence:
        """A new beam: parent + c.token. It shares parent's KV when all of it is there and a block is free for the
        partly filled last one (appended to `copies`); otherwise it waits to compute its own, first in line."""
        child = Sequence(
            parent.request_id,
            parent.prompt_len,
            parent.token_ids + [c.token],
            parent.params,
            parent.max_len,
            parent.out,
            parent.timing,
            sampler=fork_sampler(parent.sampler),
            arrived=parent.arrived,
            first_scheduled=parent.first_scheduled,
            first_token=parent.first_token,
            group=parent.group,
            beam_score=c.score,
            beam_logprobs=self._beam_logprobs(parent, entry),
            media=parent.media,
        )
        child.sampler.append(c.token)
        computed, bs = parent.num_computed, self.pool.block_size
        full, tail = divmod(computed, bs)
        if (
            parent.status is Status.RUNNING
            and computed == len(parent.token_ids)
            and len(parent.block_table) >= full + (tail > 0)
            and self.scheduler.make_room(int(tail > 0), spare=parent.group)
        ):
            if (copy := self.scheduler.fork(parent, child)) is not None:
                copies.append(copy)
        else:  # the parent's KV is not all there (preempted) or no room: the child computes its own
            self.scheduler.add(child, first=True)
        return child

    def unstall(self) -> None:
        """Nothing could run: every running sequence is a beam waiting for a sibling that cannot be admitted
        (other searches hold the KV). Let the oldest search through: preempt everything else, its waiting
        beams first in line. Each search fits alone (submit checks), so it completes."""
        groups = {s.group for s in self.scheduler.running if s.group is not None and not s.group.done}
        if groups:
            self.scheduler.prioritize(min(groups, key=lambda g: g.root.arrived))

    def _beam_chunk(self, group: BeamGroup, hyp: Hypothesis[BeamPayload]) -> Chunk:
        """A finished hypothesis as one whole-choice Chunk: text as the streaming path would have made it."""
        assert hyp.payload is not None  # _step gives every candidate that can become a hypothesis its payload
        tokens, logprobs, reason = hyp.payload
        p = group.params
        root = group.root
        detok = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=p.skip_special_tokens, prompt_ids=root.token_ids[: root.prompt_len]
        )
        stop = StopStringMatcher(p.stop, p.include_stop_str_in_output) if p.stop else None
        parts = []
        for i, token in enumerate(tokens):
            text, stopped = text_step(
                detok, stop, token, reason if i == len(tokens) - 1 else None, p.include_stop_str_in_output
            )
            parts.append(text)
            if stopped:
                break
        return Chunk(
            text="".join(parts),
            token_ids=tokens,
            logprobs=logprobs,
            finish_reason="length" if reason == "length" else "stop",
            prompt_tokens=root.prompt_len,
            completion_tokens=len(tokens),
            cached_tokens=root.num_cached,
            prompt_logprobs=root.prompt_logprobs,
        )

    def finish(self, group: BeamGroup, chunks: list[Chunk] | None = None, error: str | None = None) -> None:
        """End a beam search with its n result chunks, or (chunks None) abort it: cancel, failure, shutdown."""
        if group.done:
            return
        group.done = True
        # its beams, and any a failed _step forked before it could list them in group.beams
        for seq in group.beams + [s for s in self.scheduler.sequences() if s.group is group]:
            self.scheduler.finish(seq)
        group.logits.clear()
        group.root.set_timing()
        if chunks is None:
            chunks = [
                Chunk(finish_reason="abort", error=error, prompt_tokens=group.root.prompt_len)
                for _ in range(group.params.n)
            ]
        group.out.put(chunks)
