"""The Engine: the heartbeat that drives one step after another on its own thread.

Engine.step() is schedule -> backend forward -> per-request postprocess. Engine is one class over the loop's state,
written in three files (this one: the step; admission.py: submissions and the inbox; liveness.py: the loop and the
failure paths; state.py names what they share). What a step does for one feature is an object built in __init__
with what it uses as its constructor's arguments: n > 1 choices (self.choices, choices.py), speculative decoding
(self.speculation, speculation.py), beam search (self.beams, beams.py); logprobs.py and text.py are functions. The
step hands a feature its part of the per-request work with `_isolated`, so an error there still fails one request.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from appliance.config import EngineConfig
from appliance.manifest import Manifest
from appliance.outputs import Chunk
from appliance.runtime.backends import StepBatch, load_backend
from appliance.runtime.engine.admission import Admission
from appliance.runtime.engine.beams import BeamSearches
from appliance.runtime.engine.choices import FollowerForks
from appliance.runtime.engine.liveness import Liveness
from appliance.runtime.engine.logprobs import record_prompt_logprobs, sampled_logprobs, token_text, wants_prompt_logits
from appliance.runtime.engine.speculation import Speculation, Verify, load_proposers, measure
from appliance.runtime.engine.text import text_step
from appliance.runtime.grammar import GrammarCompiler
from appliance.runtime.kv_cache import BlockPool
from appliance.runtime.kv_disk import DiskTier, fingerprint
from appliance.runtime.sampling import SampleOutput, sample_batch
from appliance.runtime.scheduler import Scheduler
from appliance.runtime.sequence import Sequence
from appliance.runtime.stopping import check_token_stop
from appliance.runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from appliance.runtime.vision.encoder import VisionEncoder

log = logging.getLogger("appliance.runtime.engine")

Plan = list[tuple[Sequence, int]]  # a step's (sequence, tokens it feeds)


class Engine(Admission, Liveness):
    """One model's generation loop on its own thread: submit from any thread (admission.py), one step at a time
    on the engine thread (step)."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None):
        self.model_dir = Path(model_dir)
        self.config = config or EngineConfig()
        self.manifest = Manifest.load(self.model_dir)
        self.vision: VisionEncoder | None = None  # a VLM's image parts (runtime/vision/)
        if self.manifest.is_vlm:
            from appliance.runtime.vision.encoder import VisionEncoder  # Pillow and the parts: for a VLM only

            self.vision = VisionEncoder(self.model_dir, self.manifest, self.config)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        gen_path = self.model_dir / self.manifest.generation_config_file
        self.generation_defaults: dict = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        self.eos_token_ids = sorted(set(self.tokenizer.eos_token_ids) | set(self.manifest.eos_token_ids))
        # structured output (grammar.py): compiled against the tokenizer, masks as wide as the logits
        self.grammars = GrammarCompiler(
            self.model_dir / self.manifest.tokenizer_file, self.manifest.vocab_size, self.eos_token_ids
        )
        self.backend = load_backend(self.model_dir, self.manifest, self.config)
        self.max_context = min(self.manifest.max_context, self.backend.max_context)
        prefix_caching = self.config.prefix_caching and self.backend.max_batch is None
        disk = self._disk_tier() if prefix_caching else None
        self.pool = BlockPool(
            self.backend.num_blocks,
            self.backend.block_size,
            prefix_caching=prefix_caching,
            salt=disk.salt if disk else None,
        )
        if disk is not None:
            self.pool.attach_disk(disk, self.backend.read_block, self.backend.write_block)
        max_seqs = min(self.config.max_num_seqs, self.backend.max_batch or self.config.max_num_seqs)
        self.scheduler = Scheduler(self.pool, max_seqs, self.config.max_num_batched_tokens)
        self.choices = FollowerForks(self.scheduler, self.pool, self._copy_tails)  # n > 1: forks of a prompt's KV
        self.proposers = load_proposers(
            self.config,
            self.model_dir,
            self.tokenizer,
            paged=self.backend.max_batch is None,
            kv_tokens=self.pool.num_blocks * self.pool.block_size,
        )
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox_seqs = 0
        self._backlog: deque = deque()
        self._admit = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._stop_reason = "server shutting down"  # what the requests still held at the stop end with
        self._ids = itertools.count()
        self.counters = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "aborted": 0, "failed": 0}
        self.counters |= {"draft_tokens": 0, "accepted_draft_tokens": 0}  # speculative decoding (speculation.py)
        # the step costs its policy decides from: timed here, before any request, and only when the model
        # speculates (timed later, it would stall every running stream)
        costs = (
            measure(self.backend, self.pool, self.config.speculation_max_batch) if self.config.speculative() else None
        )
        self.speculation = Speculation(
            self.proposers, self.scheduler, self.config, self.counters, costs, self.backend.fixed_shapes
        )
        self.beams = BeamSearches(self.scheduler, self.pool, self.tokenizer, self._copy_tails, self.counters)
        self.heartbeat = time.monotonic()
        self.dead: BaseException | None = None
        self.on_death: Callable[[BaseException], None] | None = None
        self._faults: set[str] = set()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def _disk_tier(self) -> DiskTier | None:
        """The prefix cache's disk tier (kv_disk.py) if configured and the backend can save blocks; a directory
        that cannot be used turns it off with a warning (the server still serves)."""
        layout = self.backend.kv_layout
        if not self.config.kv_disk_dir or layout is None:
            if self.config.kv_disk_dir:
                log.warning("kv disk tier: %s cannot save KV blocks, the tier is off", type(self.backend).__name__)
            return None
        fp = fingerprint(
            self.model_dir,
            layout,
            self.backend.block_size,
            self.config.device,
            self.config.precision,
            self.config.kv_precision(),
        )
        try:
            return DiskTier(self.config.kv_disk_dir, fp, self.config.kv_disk_bytes, self.config.kv_disk_max_age)
        except OSError as exc:
            log.warning("kv disk tier off: %s", exc)
            return None

    def stats(self) -> dict:
        return {
            "queued": self._queued(),
            "running": len(self.scheduler.running),
            "kv_blocks_used": self.pool.num_used,
            "kv_blocks_total": self.pool.num_blocks,
            "kv_block_size": self.pool.block_size,
            "prefix_cache_hit_tokens": self.pool.hits,
            "prefix_cache_query_tokens": self.pool.queries,
            "preemptions": self.scheduler.preemptions,
            "kernels": self.backend.kernels,  # openvino, appliance-<isa>[/one-token] (/metrics)
            **self.counters,
            **(self.pool.disk.stats() if self.pool.disk is not None else {}),
            **(self.vision.stats() if self.vision is not None else {}),
        }

    def token_text(self, token: int) -> str:
        """A token's own text, as logprobs show it (logprobs.token_text)."""
        return token_text(self.tokenizer, token)

    def step(self) -> None:
        """One step: schedule -> forward -> postprocess.

        Fault isolation: each request's part of the postprocess (prompt logprobs, naming its full blocks, forking
        its n > 1 choices, its sampled row, logprobs, detokenizing, stop rules, beam scoring; a later per-request
        hook such as a grammar mask belongs in the same places, or in the sampler's processors) runs inside
        `_isolated`, so an exception there fails that request alone (`_fail`: a sequence, or a whole beam search)
        and the rest of the batch goes on in this step. n > 1 choices are separate sequences: a choice fails
        alone, except while the leader forks them from its prompt (then all of them: _fail). A failed
        backend.forward fails every request of the step (their KV freed); the engine goes on with the next ones.
        """
        plan = self._schedule()
        if not plan:
            return
        batch, logits = self._forward(plan)
        if logits is not None:
            self._postprocess(plan, batch, logits)

    def _schedule(self) -> Plan:
        """The step's plan. A beam whose logits are in but whose siblings' are not (a search advances all its beams
        at once) has nothing to feed: the scheduler lists it with 0 tokens, and it is left out. Nothing to run
        while sequences wait: every running sequence is a stalled beam (BeamSearches.unstall)."""
        self.speculation.propose()  # drafts for the decoding sequences, fed after their last token
        plan = [(s, n) for s, n in self.scheduler.schedule() if n > 0]
        if not plan and self.scheduler.waiting:
            self.beams.unstall()
        now = time.monotonic()
        for seq, _ in plan:
            if seq.first_scheduled is None:
                seq.first_scheduled = now
        return plan

    def _forward(self, plan: Plan) -> tuple[StepBatch, np.ndarray | None]:
        """Run the plan through the backend: the batch (with the logits of every fed position for sequences whose
        prompt logprobs need them) and each sequence's last logits row; None if the backend failed, and with it
        every request of the step."""
        flags = [wants_prompt_logits(s, n) or bool(s.draft) for s, n in plan]  # a draft: logits to verify it
        batch = StepBatch(
            [s.feed(n) for s, n in plan],
            [s.num_computed for s, _ in plan],
            [s.block_table for s, _ in plan],
            all_logits=flags if any(flags) else None,
        )
        if self.manifest.is_vlm and any(s.media is not None for s, _ in plan):  # image rows, 3-D positions
            spans = [(s.media, s.num_computed, s.num_computed + n) for s, n in plan]
            batch.image_rows = [m.rows(b, e) if m is not None else None for m, b, e in spans]
            batch.mrope_positions = [m.position_ids(b, e) if m is not None else None for m, b, e in spans]
        try:
            self._injected("forward")
            t0 = time.perf_counter()
            logits = self.backend.forward(batch)
            self.speculation.observe(len(plan), batch.num_tokens, time.perf_counter() - t0)
            return batch, logits
        except Exception as exc:
            log.exception("backend forward failed: failing the step's %d sequences", len(plan))
            self.counters["failed"] += len(plan)
            for seq, _ in plan:
                self._try_fail(seq, f"internal error: {type(exc).__name__}")
            return batch, None

    def _postprocess(self, plan: Plan, batch: StepBatch, logits: np.ndarray) -> None:
        """Each request's part of the step, each inside _isolated: account for the computed tokens, then sample
        the sequences that are ready (one batched call) and feed the beams' rows to their searches."""
        ready, beams, verifying = self._computed(plan, batch)
        for seq, out, j in self._sample(logits, ready):
            with self._isolated(seq):
                self._append(seq, int(out.token_ids[j]), out, j)
        if verifying:
            self.speculation.verify(verifying, self._sample, self._append, self._isolated)
        if beams:
            self.beams.collect(beams, logits, self._isolated)

    def _computed(self, plan: Plan, batch: StepBatch) -> tuple[Plan, Plan, Verify]:
        """The plan's tokens are computed: record prompt logprobs, name the blocks that became full. Returns the
        sequences whose every token is computed, (sequence, its logits row): those that sample now (a leader with
        the n > 1 choices forked from it) and beams; a prompt-only request (max_tokens 0) ends here. And the
        sequences that fed a draft, with the logits of their fed positions: verified next (speculation.py)."""
        ready: Plan = []
        beams: Plan = []
        verifying: Verify = []
        for i, (seq, n) in enumerate(plan):
            with self._isolated(seq):
                if seq.draft:  # its tokens count as computed as far as the verification accepts them
                    assert batch.position_logits is not None
                    rows = batch.position_logits[i]
                    assert rows is not None
                    verifying.append((seq, rows))
                    continue
                if batch.all_logits is not None and batch.all_logits[i]:
                    # forward fills position_logits[i] for every flagged sequence (StepBatch)
                    assert batch.position_logits is not None
                    rows = batch.position_logits[i]
                    assert rows is not None
                    record_prompt_logprobs(self.tokenizer, seq, seq.num_computed, rows)
                seq.num_computed += n
                self.scheduler.computed(seq)
                if seq.num_computed != len(seq.token_ids):
                    continue
                if seq.params.max_tokens == 0:  # echo + prompt logprobs: the prompt is all that was asked for
                    self._finish_prompt_only(seq)
                elif seq.group is not None:
                    beams.append((seq, i))
                else:
                    ready += [(s, i) for s in [seq] + (self.choices.fork(seq) if seq.followers else [])]
        return ready, beams, verifying

    def _sample(self, logits: np.ndarray, ready: Plan) -> list[tuple[Sequence, SampleOutput, int]]:
        """The next token of every ready sequence, (sequence, output, its row in output): one batched call. If
        that raises, each row is sampled alone (the error path only), so the row that fails is found and fails
        alone; a seeded row then may draw differently than in the batch (its generator may have moved on)."""
        if not ready:
            return []
        rows = [i for _, i in ready]
        try:
            out = sample_batch(
                logits if rows == list(range(len(logits))) else logits[rows], [s.sampler for s, _ in ready]
            )
            return [(s, out, j) for j, (s, _) in enumerate(ready)]
        except Exception:
            log.exception("batched sampling failed: sampling the %d rows one by one", len(ready))
        alone = []
        for seq, i in ready:
            with self._isolated(seq):
                alone.append((seq, sample_batch(logits[i : i + 1], [seq.sampler]), 0))
        return alone

    def _append(self, seq: Sequence, token: int, out: SampleOutput, j: int) -> None:
        """seq sampled `token` (row j of out): its text, logprobs and stop rules, streamed as one Chunk."""
        now = time.monotonic()
        if seq.first_token is None:
            seq.first_token = now
        seq.token_ids.append(token)
        seq.sampler.append(token)
        self.counters["generated_tokens"] += 1
        reason = check_token_stop(
            token, seq.num_generated, seq.params, seq.sampler.stop_set, len(seq.token_ids) >= seq.max_len, seq.token_ids
        )
        # the grammar is complete (nothing but EOS may follow, even with ignore_eos): "stop", the token kept as text
        closed = reason != "stop" and seq.sampler.grammar is not None and seq.sampler.grammar.finished
        text, stopped = text_step(
            seq.detok, seq.stop, token, "grammar" if closed else reason, seq.params.include_stop_str_in_output
        )
        if stopped or closed:
            reason = "stop"
        logprobs = sampled_logprobs(self.tokenizer, seq, token, out, j) if seq.params.logprobs is not None else None
        chunk = Chunk(
            text=text,
            token_ids=[token],
            logprobs=logprobs,
            prompt_tokens=seq.prompt_len,
            completion_tokens=seq.num_generated,
            cached_tokens=seq.num_cached,
            prompt_logprobs=seq.prompt_logprobs if seq.num_generated == 1 else None,
            accepted_prediction_tokens=seq.spec.accepted if seq.spec else 0,
            rejected_prediction_tokens=seq.spec.rejected if seq.spec else 0,
        )
        if reason is None:
            seq.emit(chunk)
        else:
            self._finish(seq, reason, chunk)

    def _copy_tails(self, copies: list[tuple[int, int, int]]) -> None:
        """Run the (src, dst, positions) block copies that forks (Scheduler.fork) queued, before the next forward."""
        if copies:
            self.backend.copy_blocks([(s, d) for s, d, _ in copies], [n for _, _, n in copies])

    def _finish(self, seq: Sequence, reason: str, chunk: Chunk | None = None, error: str | None = None) -> None:
        if seq.group is not None:  # a beam ends only with its whole search; here that means an abort
            self.beams.finish(seq.group, error=error)
            return
        if seq.followers:  # ended before its prompt was computed: the other choices compute their own
            self.choices.release(seq)
        self.speculation.release(seq)
        self.scheduler.finish(seq)
        seq.set_timing()
        chunk = chunk or Chunk(prompt_tokens=seq.prompt_len, completion_tokens=seq.num_generated)
        chunk.finish_reason, chunk.error = reason, error
        seq.emit(chunk)

    def _finish_prompt_only(self, seq: Sequence) -> None:
        """max_tokens 0 (echo with prompt logprobs): end after the prompt, nothing sampled."""
        chunk = Chunk(prompt_tokens=seq.prompt_len, prompt_logprobs=seq.prompt_logprobs, finish_reason="length")
        if seq.group is None:
            self._finish(seq, "length", chunk)
        else:
            self.beams.finish(seq.group, [chunk] + [copy.copy(chunk) for _ in range(seq.params.n - 1)])
