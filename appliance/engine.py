"""The generation loop: requests in, streamed chunks out, one engine thread driving scheduler -> backend ->
sampler -> detokenizer -> stop rules. Usable without HTTP: `Engine(model_dir).generate(prompt, params)`.

No request can hurt another: an exception in one request's part of a step fails that request alone (see
Engine.step), a failed backend call fails that step's requests, and the engine goes on. The engine thread itself
never dies silently: if something escapes its loop, `Engine.dead` records it, every request ends with an error and
`Engine.on_death` is called (the server exits so that systemd / Docker restart it); `Engine.heartbeat` and
`Engine.alive` let readiness see a live loop.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import json
import logging
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from appliance.backends import StepBatch, load_backend
from appliance.beam_search import BeamSearch, Hypothesis, fork_sampler, log_softmax
from appliance.config import EngineConfig
from appliance.detokenizer import IncrementalDetokenizer
from appliance.kv_cache import BlockPool
from appliance.manifest import Manifest
from appliance.outputs import Chunk, GenerationResult, Timing, TokenLogprob
from appliance.params import SamplingParams
from appliance.sampling import SampleOutput, SequenceSampler, apply_processors, ranked, sample_batch
from appliance.scheduler import Scheduler
from appliance.sequence import Sequence, Status
from appliance.stopping import StopStringMatcher, check_token_stop, stop_token_ids
from appliance.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """More requests are waiting than `max_queued` allows (HTTP 429)."""


class PromptTooLong(ValueError):
    """Prompt (+ max_tokens) does not fit the context (HTTP 400)."""


class EngineDead(RuntimeError):
    """The engine thread died (Engine.dead): nothing submitted can run (HTTP 503)."""


class InjectedFault(RuntimeError):
    """Raised by Engine.inject_fault's faults (tests of the failure paths)."""


IDLE_WAIT = 0.5            # seconds the idle loop sleeps between checks: the heartbeat's longest idle gap
STOP_WINDOW_TOKENS = 256   # beam search: most tokens decoded per candidate to look for a stop string
FAULT_KINDS = ("loop", "forward")


def _text_step(detok: IncrementalDetokenizer, stop: StopStringMatcher | None, token: int, reason: str | None,
                include_stop: bool) -> tuple[str, bool]:
    """The text one token adds to a choice, and whether a stop string ended it there. `reason`: why the token
    ends the choice (None: it does not). The EOS / stop token that ends a choice is not text the user asked for
    (as OpenAI and vLLM do) unless include_stop_str_in_output; the last token flushes what was held back."""
    text = "" if reason == "stop" and not include_stop else detok.add([token])
    if reason is not None:
        text += detok.flush()
    if stop is None:
        return text, False
    text, stopped = stop.feed(text)
    if not stopped and reason is not None:
        text += stop.flush()
    return text, stopped


class RequestHandle:
    """The requester's side of one sequence: iterate for Chunks, cancel to free its KV at once."""

    def __init__(self, engine: "Engine", seq: Sequence):
        self._engine, self._seq = engine, seq
        self.id = seq.request_id
        self.prompt_tokens = seq.prompt_len

    @property
    def timing(self) -> Timing:
        return self._seq.timing

    def __iter__(self) -> Iterator[Chunk]:
        while True:
            chunk = self._seq.out.get()
            yield chunk
            if chunk.finish_reason is not None:
                return

    def events(self) -> Iterator[tuple[int, Chunk]]:
        """(choice offset, chunk) pairs, as a BeamHandle gives them; always offset 0 here."""
        for chunk in self:
            yield 0, chunk

    def cancel(self) -> None:
        self._engine._cancel(self._seq)

    def result(self) -> GenerationResult:
        text, ids, logprobs, last, prompt_logprobs = [], [], [], Chunk(), None
        for last in self:
            text.append(last.text)
            ids += last.token_ids
            if last.logprobs:
                logprobs += last.logprobs
            if last.prompt_logprobs is not None:
                prompt_logprobs = last.prompt_logprobs
        if last.error:
            raise RuntimeError(last.error)
        params = self._seq.params
        return GenerationResult("".join(text), ids, last.finish_reason, last.prompt_tokens, last.completion_tokens,
                                logprobs if params.logprobs is not None else None, self.timing, prompt_logprobs)


class BeamGroup:
    """One beam search inside the engine: its live beams (Sequences that share KV blocks), the logits they
    produced for the next step so far, the search state. Engine thread only, except `out`."""

    def __init__(self, root: Sequence, num_stop_tokens: int):
        self.root, self.params = root, root.params
        self.search = BeamSearch(root.params.best_of, root.params.length_penalty, num_stop_tokens)
        # tokens decoded per candidate to find a stop string ending there: enough for the longest one (a token is
        # at least one character, 8 spare for byte pieces), bounded so that no stop string makes a step costly
        longest = max((len(s) for s in root.params.stop), default=0)
        self.stop_window = min(longest + 8, STOP_WINDOW_TOKENS)
        self.beams: list[Sequence] = [root]
        self.logits: dict[Sequence, np.ndarray] = {}
        self.out: queue.SimpleQueue = queue.SimpleQueue()   # once: the n result Chunks
        self.done = False


class BeamHandle:
    """The requester's side of a beam search. Not streamed: the n best hypotheses arrive together, best first,
    each as one Chunk holding the whole choice."""

    def __init__(self, engine: "Engine", group: BeamGroup):
        self._engine, self._group = engine, group
        self.id = group.root.request_id
        self.prompt_tokens = group.root.prompt_len
        self._chunks: list[Chunk] | None = None

    @property
    def timing(self) -> Timing:
        return self._group.root.timing

    def chunks(self) -> list[Chunk]:
        if self._chunks is None:
            self._chunks = self._group.out.get()
        return self._chunks

    def events(self) -> Iterator[tuple[int, Chunk]]:
        yield from enumerate(self.chunks())

    def cancel(self) -> None:
        self._engine._cancel(self._group)

    def result(self) -> list[GenerationResult]:
        chunks = self.chunks()
        if chunks[0].error:
            raise RuntimeError(chunks[0].error)
        return [GenerationResult(c.text, c.token_ids, c.finish_reason, c.prompt_tokens, c.completion_tokens,
                                 c.logprobs, self.timing, c.prompt_logprobs) for c in chunks]


class Engine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None):
        self.model_dir = Path(model_dir)
        self.config = config or EngineConfig()
        self.manifest = Manifest.load(self.model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        gen_path = self.model_dir / self.manifest.generation_config_file
        self.generation_defaults: dict = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        self.eos_token_ids = sorted(set(self.tokenizer.eos_token_ids) | set(self.manifest.eos_token_ids))
        self.backend = load_backend(self.model_dir, self.manifest, self.config)
        self.max_context = min(self.manifest.max_context, self.backend.max_context)
        self.pool = BlockPool(self.backend.num_blocks, self.backend.block_size,
                              prefix_caching=self.config.prefix_caching and self.backend.max_batch is None)
        max_seqs = min(self.config.max_num_seqs, self.backend.max_batch or self.config.max_num_seqs)
        self.scheduler = Scheduler(self.pool, max_seqs, self.config.max_num_batched_tokens)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox_seqs = 0                  # sequences submitted, not yet taken by the engine thread
        self._admit = threading.Lock()        # check and count a submission at once (no two pass on one slot)
        self._wake = threading.Event()
        self._stop = False
        self._ids = itertools.count()
        self.counters = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "aborted": 0, "failed": 0}
        # liveness: time.monotonic() of the loop's last iteration (at least every IDLE_WAIT s when idle, every step
        # when busy); what ended the engine thread (None: running); called from the engine thread when it dies
        self.heartbeat = time.monotonic()
        self.dead: BaseException | None = None
        self.on_death: Callable[[BaseException], None] | None = None
        self._faults: set[str] = set()        # inject_fault: pending injected faults
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # ---- requester side (any thread) ----
    def submit(self, prompt_ids: list[int], params: SamplingParams,
               request_id: str | None = None) -> RequestHandle | BeamHandle:
        """One sequence (a RequestHandle streaming Chunks), or with params.best_of > 1 a beam search (a
        BeamHandle whose result is the params.n best beams)."""
        beam = params.best_of is not None and params.best_of > 1
        seq = self._new_sequence(prompt_ids, params, request_id)
        if beam:
            seq.max_len = self._beam_max_len(len(prompt_ids), params, seq.max_len)
            seq.group = BeamGroup(seq, len(stop_token_ids(params, self.eos_token_ids)))
        self._enqueue([[seq]])
        return BeamHandle(self, seq.group) if beam else RequestHandle(self, seq)

    def submit_choices(self, prompt_ids: list[int], params: list[SamplingParams],
                       request_ids: list[str] | None = None) -> list[RequestHandle]:
        """n sampled choices of one prompt (params[j] for choice j, e.g. seeds apart). The prompt is computed
        once: the other choices then share its KV blocks (copy-on-write: full blocks by reference, the partly
        filled last one copied) and sample their first token from the same logits."""
        return self.submit_prompts([(prompt_ids, params, request_ids)])[0]

    def submit_prompts(self, requests: list[tuple[list[int], list[SamplingParams], list[str] | None]]
                       ) -> list[list[RequestHandle]]:
        """Several prompts at once, each with its choices as in submit_choices (a completions request's prompt
        list, a burst of clients): all are queued or none (429), and they reach the scheduler in the same step,
        so their prefills batch together instead of the first one starting alone."""
        groups = []
        for prompt_ids, params, request_ids in requests:
            ids = request_ids or [None] * len(params)
            seqs = [self._new_sequence(prompt_ids, p, r) for p, r in zip(params, ids)]
            if len(seqs) > 1 and self.backend.max_batch is None and all(p.max_tokens != 0 for p in params):
                seqs[0].followers = seqs[1:]
            groups.append(seqs)
        self._enqueue(groups)
        return [[RequestHandle(self, seq) for seq in seqs] for seqs in groups]

    def _enqueue(self, groups: list[list[Sequence]]) -> None:
        """Hands a submission to the engine thread, or refuses all of it (429) if its sequences would take the
        queue past max_queued. Counted in sequences, not submissions: a prompt list or n > 1 is several."""
        count = sum(map(len, groups))
        with self._admit:
            if self.dead is not None:   # checked under the lock _die takes: nothing is queued after its drain
                raise EngineDead(f"the engine stopped: internal error: {type(self.dead).__name__}")
            if self._queued() + count > self.config.max_queued:
                raise QueueFull("the server is busy: too many queued requests, retry later")
            self._inbox_seqs += count
            self._inbox.put(("add", groups))
        self._wake.set()

    def _queued(self) -> int:
        """Sequences not started: in the inbox, or waiting in the scheduler with the n > 1 choices that wait for
        their prompt (a snapshot: the engine thread may be moving them)."""
        return self._inbox_seqs + sum(1 + len(s.followers or ()) for s in list(self.scheduler.waiting))

    def _new_sequence(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None) -> Sequence:
        """The prompt's checks, made on the caller's thread (400 before anything is queued), then the Sequence."""
        if not prompt_ids:
            raise ValueError("prompt is empty")
        limit = self.max_context
        if len(prompt_ids) + (params.max_tokens or 0) > limit or len(prompt_ids) >= limit:
            raise PromptTooLong(f"Number of prompt tokens: {len(prompt_ids)} + max tokens value: "
                                f"{params.max_tokens or 0} exceeds model max length: {limit}")
        max_len = min(limit, len(prompt_ids) + params.max_tokens if params.max_tokens is not None else limit)
        return Sequence(request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}", len(prompt_ids),
                        list(prompt_ids), params, max_len, queue.SimpleQueue(), Timing(created=time.time()))

    def _beam_max_len(self, prompt_len: int, params: SamplingParams, max_len: int) -> int:
        """All beams of a search must fit in the KV pool and the sequence slots together, or they could wait on
        each other forever. Without max_tokens the search is capped at what fits."""
        beams, pool = params.best_of, self.pool
        if params.n > beams:
            raise ValueError(f"n value cannot be greater than best_of ({params.n} > {beams})")
        if beams > self.scheduler.max_num_seqs:
            raise ValueError(f"best_of {beams} runs {beams} sequences at once; this server runs at most "
                             f"{self.scheduler.max_num_seqs}")
        fits = pool.num_blocks // beams * pool.block_size
        if max_len > fits and (params.max_tokens is not None or prompt_len >= fits):
            raise PromptTooLong(f"best_of {beams}: {beams} beams of {prompt_len} prompt tokens + max tokens value "
                                f"{params.max_tokens or 0} do not fit the KV cache ({pool.num_blocks * pool.block_size}"
                                " positions)")
        return min(max_len, fits)

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None
                 ) -> GenerationResult | list[GenerationResult]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return self.submit(ids, params or SamplingParams()).result()

    def stats(self) -> dict:
        return {"queued": self._queued(), "running": len(self.scheduler.running),
                "kv_blocks_used": self.pool.num_used, "kv_blocks_total": self.pool.num_blocks,
                "kv_block_size": self.pool.block_size, "prefix_cache_hit_tokens": self.pool.hits,
                "prefix_cache_query_tokens": self.pool.queries,
                "preemptions": self.scheduler.preemptions, **self.counters}

    @property
    def alive(self) -> bool:
        """The engine thread runs its loop (readiness also wants a fresh `heartbeat`: a wedged loop is alive)."""
        return self._thread.is_alive() and self.dead is None

    def inject_fault(self, kind: str) -> None:
        """Test hook for the failure paths (the server exposes it only with APPLIANCE_FAULT_INJECTION=1).
        "loop": the engine thread's loop raises on its next iteration, outside every guard: the real death path
        (dead set, requests aborted, on_death called). "forward": the next backend forward raises once: that
        step's requests fail, later ones run."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}: one of {', '.join(FAULT_KINDS)}")
        self._faults.add(kind)
        self._wake.set()

    def _injected(self, kind: str) -> None:
        if kind in self._faults:
            self._faults.discard(kind)
            raise InjectedFault(f"injected {kind} fault")

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.backend.close()

    def _cancel(self, target: Sequence | BeamGroup) -> None:
        self._inbox.put(("cancel", target))
        self._wake.set()

    # ---- engine thread ----
    def _loop(self) -> None:
        """The engine thread. Each iteration's failures are contained by _iterate; what still escapes (a bug in
        the loop itself) ends the thread through _die, never silently."""
        try:
            while not self._stop:
                self.heartbeat = time.monotonic()
                self._injected("loop")
                self._iterate()
            self._abort_all("server shutting down")
        except BaseException as exc:
            self._die(exc)

    def _iterate(self) -> None:
        """One loop iteration: take new requests and cancels, then one step (or wait for work). A failure outside
        every request's own part (the scheduler, say) leaves state that cannot be trusted: every request in the
        scheduler fails, and the engine starts over empty."""
        try:
            self._drain_inbox()
            if not self.scheduler.has_work():
                self._wake.wait(IDLE_WAIT)
                self._wake.clear()
                return
            self.step()
        except Exception as exc:
            log.exception("engine step failed: failing every scheduled request")
            self._abort_scheduled(f"internal error: {type(exc).__name__}")

    def _die(self, exc: BaseException) -> None:
        """The loop is gone: record why, end every request (best effort), tell the owner (on_death)."""
        with self._admit:
            self.dead = exc
        log.critical("the engine thread died", exc_info=exc)
        try:
            self._abort_all(f"the engine stopped: internal error: {type(exc).__name__}")
        except BaseException:
            log.exception("could not abort every request of the dead engine")
        if self.on_death is not None:
            try:
                self.on_death(exc)
            except BaseException:
                log.exception("Engine.on_death failed")

    def _abort_all(self, error: str) -> None:
        """End every request the engine holds (inbox, waiting, running) with an error; each on its own, best
        effort (one that cannot be ended does not keep the others waiting)."""
        while True:
            try:
                op, target = self._inbox.get_nowait()
            except queue.Empty:
                break
            if op == "add":
                with self._admit:
                    self._inbox_seqs -= sum(map(len, target))
                for seqs in target:
                    for seq in seqs:
                        self._try_fail(seq, error)
        self._abort_scheduled(error)

    def _abort_scheduled(self, error: str) -> None:
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._try_fail(seq, error)

    def _try_fail(self, seq: Sequence, error: str) -> None:
        """_fail, and if even that raises: drop seq from the scheduler and tell its requester all the same (its KV
        may stay held: a bug is in the log, the requester must not wait forever)."""
        try:
            self._fail(seq, error)
        except Exception:
            log.exception("could not end request %s", seq.request_id)
            seq.status = Status.FINISHED
            with contextlib.suppress(ValueError):
                self.scheduler.running.remove(seq)
            with contextlib.suppress(ValueError):
                self.scheduler.waiting.remove(seq)
            end = Chunk(finish_reason="abort", error=error, prompt_tokens=seq.prompt_len)
            if seq.group is None:
                seq.emit(end)
            elif not seq.group.done:
                seq.group.done = True
                seq.group.out.put([copy.copy(end) for _ in range(seq.params.n)])

    def _fail(self, seq: Sequence, error: str) -> None:
        """End seq's request with `error` (finish "abort"). The unit: a beam search as a whole (its beams share
        one result); otherwise this sequence, with the n > 1 choices still waiting to start from its prompt KV
        (their prompt is the one that failed; a fork of them that raised leaves them all here). Choices already
        forked are sequences of their own and go on: each choice fails alone. A finished sequence is left alone."""
        if seq.group is None and seq.status is Status.FINISHED:
            return
        for f in seq.followers or ():
            if f.status is not Status.FINISHED:
                self._finish(f, "abort", error=error)
        seq.followers = None
        self._finish(seq, "abort", error=error)

    @contextlib.contextmanager
    def _isolated(self, seq: Sequence) -> Iterator[None]:
        """Runs one request's part of a step: an exception fails that request alone (_fail, with the exception's
        type as the error; the traceback goes to the log) and the caller goes on with the rest of the batch."""
        try:
            yield
        except Exception as exc:
            log.exception("request %s failed in the engine step", seq.request_id)
            self.counters["failed"] += 1
            self._fail(seq, f"internal error: {type(exc).__name__}")

    def _drain_inbox(self) -> None:
        while True:
            try:
                op, target = self._inbox.get_nowait()   # ("add", groups of sequences) or ("cancel", one)
            except queue.Empty:
                return
            try:
                self._take(op, target)
            except Exception as exc:   # one submission or cancel fails alone
                log.exception("could not take %s from the inbox", op)
                if op == "add":
                    for seqs in target:
                        for seq in seqs:
                            self._try_fail(seq, f"internal error: {type(exc).__name__}")

    def _take(self, op: str, target) -> None:
        if op == "add":
            try:
                for seqs in target:
                    self._start_all(seqs)
            finally:
                with self._admit:   # after the start: counted as queued until in the scheduler's waiting list
                    self._inbox_seqs -= sum(map(len, target))
        elif isinstance(target, BeamGroup):
            if not target.done:
                self.counters["aborted"] += 1
                self._finish_group(target)
        elif target.status is not Status.FINISHED:
            self.counters["aborted"] += 1
            self._finish(target, "abort")

    def _start_all(self, seqs: list[Sequence]) -> None:
        """A request's sequences: the first is scheduled, its followers (n > 1) wait for its prompt KV. They
        start first, so that a leader failing to start hands ready followers to the scheduler (_finish)."""
        share = bool(seqs[0].followers)
        self.counters["requests"] += 1   # one prompt, however many choices
        self.counters["prompt_tokens"] += seqs[0].prompt_len
        for seq in seqs[1:] + seqs[:1] if share else seqs:
            try:
                self._start(seq, scheduled=seq is seqs[0] or not share)
            except Exception as exc:  # one bad request fails alone; the engine thread goes on
                log.exception("could not start request %s", seq.request_id)
                self._finish(seq, "abort", error=f"internal error: {type(exc).__name__}")

    def _start(self, seq: Sequence, scheduled: bool = True) -> None:
        p = seq.params
        seq.sampler = SequenceSampler(p, seq.token_ids[: seq.prompt_len], self.eos_token_ids)
        seq.detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=p.skip_special_tokens,
                                           prompt_ids=seq.token_ids[: seq.prompt_len])
        seq.stop = StopStringMatcher(p.stop, p.include_stop_str_in_output) if p.stop else None
        if p.prompt_logprobs is not None:   # nothing predicts the first prompt token: its logprob is None
            first = seq.token_ids[0]
            seq.prompt_logprobs = [TokenLogprob(first, self.token_text(first), None)]
        if scheduled:
            self.scheduler.add(seq)

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
        # A beam whose logits are in but whose siblings' are not (a search advances all its beams at once) has
        # nothing to feed: the scheduler lists it with 0 tokens.
        plan = [(s, n) for s, n in self.scheduler.schedule() if n > 0]
        if not plan:
            if self.scheduler.waiting:
                self._unstall()
            return
        now = time.monotonic()
        for seq, _ in plan:
            if seq.first_scheduled is None:
                seq.first_scheduled = now
        flags = [self._wants_prompt_logits(s, n) for s, n in plan]
        batch = StepBatch([s.token_ids[s.num_computed: s.num_computed + n] for s, n in plan],
                          [s.num_computed for s, _ in plan], [s.block_table for s, _ in plan],
                          all_logits=flags if any(flags) else None)
        try:
            self._injected("forward")
            logits = self.backend.forward(batch)
        except Exception as exc:
            log.exception("backend forward failed: failing the step's %d sequences", len(plan))
            self.counters["failed"] += len(plan)
            for seq, _ in plan:
                self._try_fail(seq, f"internal error: {type(exc).__name__}")
            return
        ready: list[tuple[Sequence, int]] = []   # (sequence, its logits row): sample the next token now
        beams: list[tuple[Sequence, int]] = []
        for i, (seq, n) in enumerate(plan):
            with self._isolated(seq):
                if flags[i]:
                    self._prompt_logprobs(seq, seq.num_computed, batch.position_logits[i])
                seq.num_computed += n
                self.scheduler.computed(seq)
                if seq.num_computed != len(seq.token_ids):
                    continue
                if seq.params.max_tokens == 0:   # echo + prompt logprobs: the prompt is all that was asked for
                    self._finish_prompt_only(seq)
                elif seq.group is not None:
                    beams.append((seq, i))
                else:
                    ready += [(s, i) for s in [seq] + (self._fork_followers(seq) if seq.followers else [])]
        for seq, out, j in self._sample(logits, ready):
            with self._isolated(seq):
                self._append(seq, int(out.token_ids[j]), out, j)
        for seq, i in beams:
            group = seq.group
            if group.done or seq not in group.beams:
                continue
            with self._isolated(seq):
                group.logits[seq] = np.array(logits[i], dtype=np.float32)
                if len(group.logits) == len(group.beams):
                    self._beam_step(group)

    def _sample(self, logits: np.ndarray, ready: list[tuple[Sequence, int]]
                ) -> list[tuple[Sequence, SampleOutput, int]]:
        """The next token of every ready sequence, (sequence, output, its row in output): one batched call. If
        that raises, each row is sampled alone (the error path only), so the row that fails is found and fails
        alone; a seeded row then may draw differently than in the batch (its generator may have moved on)."""
        if not ready:
            return []
        rows = [i for _, i in ready]
        try:
            out = sample_batch(logits if rows == list(range(len(logits))) else logits[rows],
                               [s.sampler for s, _ in ready])
            return [(s, out, j) for j, (s, _) in enumerate(ready)]
        except Exception:
            log.exception("batched sampling failed: sampling the %d rows one by one", len(ready))
        alone = []
        for seq, i in ready:
            with self._isolated(seq):
                alone.append((seq, sample_batch(logits[i:i + 1], [seq.sampler]), 0))
        return alone

    def _append(self, seq: Sequence, token: int, out, j: int) -> None:
        now = time.monotonic()
        if seq.first_token is None:
            seq.first_token = now
        seq.token_ids.append(token)
        seq.sampler.append(token)
        self.counters["generated_tokens"] += 1
        reason = check_token_stop(token, seq.num_generated, seq.params, seq.sampler.stop_set,
                                  len(seq.token_ids) >= seq.max_len)
        text, stopped = _text_step(seq.detok, seq.stop, token, reason, seq.params.include_stop_str_in_output)
        if stopped:
            reason = "stop"
        logprobs = self._logprobs(seq, token, out, j) if seq.params.logprobs is not None else None
        chunk = Chunk(text=text, token_ids=[token], logprobs=logprobs, prompt_tokens=seq.prompt_len,
                      completion_tokens=seq.num_generated,
                      prompt_logprobs=seq.prompt_logprobs if seq.num_generated == 1 else None)
        if reason is None:
            seq.emit(chunk)
        else:
            self._finish(seq, reason, chunk)

    def token_text(self, token: int) -> str:
        """A token's own text for logprobs (a lone byte of a multi-byte character shows as U+FFFD). Ids past
        the tokenizer's vocabulary (models pad their embedding) have no text."""
        try:
            return self.tokenizer.token_bytes(token).decode("utf-8", errors="replace")
        except IndexError:
            return ""

    def _logprobs(self, seq: Sequence, token: int, out, j: int) -> list[TokenLogprob]:
        k = seq.params.logprobs or 0
        top = [(int(i), self.token_text(int(i)), float(lp))
               for i, lp in zip(out.top_ids[j][:k], out.top_logprobs[j][:k])]
        return [TokenLogprob(token, self.token_text(token), float(out.logprobs[j]), top)]

    def _finish(self, seq: Sequence, reason: str, chunk: Chunk | None = None, error: str | None = None) -> None:
        if seq.group is not None:   # a beam ends only with its whole search; here that means an abort
            self._finish_group(seq.group, error=error)
            return
        if seq.followers:   # ended before its prompt was computed: the other choices compute their own
            for f in seq.followers:
                if f.status is not Status.FINISHED:
                    self.scheduler.add(f)
            seq.followers = None
        self.scheduler.finish(seq)
        self._set_timing(seq)
        chunk = chunk or Chunk(prompt_tokens=seq.prompt_len, completion_tokens=seq.num_generated)
        chunk.finish_reason, chunk.error = reason, error
        seq.emit(chunk)

    @staticmethod
    def _set_timing(seq: Sequence) -> None:
        t = seq.timing
        end = time.monotonic()
        start = seq.first_scheduled or end
        first = seq.first_token or end
        t.queue_time, t.prompt_time = start - seq.arrived, first - start
        t.completion_time, t.total_time = end - first, end - seq.arrived

    def _finish_prompt_only(self, seq: Sequence) -> None:
        """max_tokens 0 (echo with prompt logprobs): end after the prompt, nothing sampled."""
        chunk = Chunk(prompt_tokens=seq.prompt_len, prompt_logprobs=seq.prompt_logprobs, finish_reason="length")
        if seq.group is None:
            self._finish(seq, "length", chunk)
        else:
            self._finish_group(seq.group, [chunk] + [copy.copy(chunk) for _ in range(seq.params.n - 1)])

    # ---- prompt logprobs ----
    def _wants_prompt_logits(self, seq: Sequence, n: int) -> bool:
        """Whether this step must return the logits of every position seq feeds: some of them predict prompt
        tokens whose logprobs are still missing (position i's logits predict token i + 1)."""
        done = seq.prompt_logprobs
        if done is None or len(done) >= seq.prompt_len:
            return False
        return seq.num_computed <= len(done) - 1 < seq.num_computed + n

    def _prompt_logprobs(self, seq: Sequence, start: int, rows: np.ndarray) -> None:
        """Record the logprobs of the prompt tokens that rows (logits of positions start...) predict."""
        done, k = seq.prompt_logprobs, seq.params.prompt_logprobs or 0
        a, b = len(done) - 1 - start, min(len(rows), seq.prompt_len - 1 - start)
        if a < 0 or a >= b:
            return
        raw = np.asarray(rows[a:b], np.float32)
        lp = log_softmax(raw)
        targets = seq.token_ids[start + a + 1: start + b + 1]
        top = ranked(raw, k) if k else None
        for r, t in enumerate(targets):
            alts = [(int(i), self.token_text(int(i)), float(lp[r, i])) for i in top[r]] if k else []
            done.append(TokenLogprob(int(t), self.token_text(int(t)), float(lp[r, t]), alts))

    # ---- beam search ----
    def _beam_step(self, group: BeamGroup) -> None:
        """All beams' logits are in: pick the next beams (beam_search.BeamSearch), then fork / extend / drop the
        sequences. The best continuation of a beam extends it in place; each further one forks it: the fork
        shares the parent's full KV blocks and gets a copy of its partly filled last block."""
        p, beams, search = group.params, group.beams, group.search
        root = group.root
        if root.first_token is None:
            root.first_token = time.monotonic()
        raw = log_softmax(np.stack([group.logits[s] for s in beams]))
        group.logits.clear()
        scores = apply_processors(raw, [s.sampler for s in beams])   # as transformers: on the log-probabilities
        cands = search.candidates(scores, [s.beam_score for s in beams])
        generated = beams[0].num_generated + 1                      # every beam has the same length
        full = len(beams[0].token_ids) + 1 >= beams[0].max_len
        reasons = [self._beam_stop(beams[c.beam], c.token, generated, full) for c in cands]
        top = ranked(raw, p.logprobs) if p.logprobs else None

        def entry(c) -> TokenLogprob | None:
            if p.logprobs is None:
                return None
            row = raw[c.beam]
            alts = [] if top is None else [(int(i), self.token_text(int(i)), float(row[i])) for i in top[c.beam]]
            return TokenLogprob(c.token, self.token_text(c.token), float(raw[c.beam, c.token]), alts)

        payloads = [(beams[c.beam].generated + [c.token], self._beam_logprobs(beams[c.beam], entry(c)), r)
                    if r is not None and c.rank < search.num_beams else None for c, r in zip(cands, reasons)]
        running = search.update(cands, [r is not None for r in reasons], generated, payloads)
        if search.done:
            self._finish_group(group, [self._beam_chunk(group, h) for h in search.best(p.n)])
            return
        self.counters["generated_tokens"] += len(running)
        kept: dict[int, object] = {}
        forks = []
        for c in running:
            if c.beam in kept:
                forks.append(c)
            else:
                kept[c.beam] = c
        for b, seq in enumerate(beams):   # beams without a continuation leave first: their KV makes room
            if b not in kept:
                self.scheduler.finish(seq)
        copies: list[tuple[int, int, int]] = []
        children = {id(c): self._fork_beam(beams[c.beam], c, entry(c), copies) for c in forks}  # parents unchanged yet
        self._copy_tails(copies)
        for b, c in kept.items():
            seq = beams[b]
            seq.token_ids.append(c.token)
            seq.sampler.append(c.token)
            seq.beam_score = c.score
            if p.logprobs is not None:
                seq.beam_logprobs = self._beam_logprobs(seq, entry(c))
        group.beams = [children[id(c)] if id(c) in children else beams[c.beam] for c in running]

    @staticmethod
    def _beam_logprobs(seq: Sequence, entry: TokenLogprob | None) -> list | None:
        return None if entry is None else (seq.beam_logprobs or []) + [entry]

    def _beam_stop(self, parent: Sequence, token: int, generated: int, context_full: bool) -> str | None:
        """Whether parent + token ends: "stop" (a stop token), "stop_string", "length", or None."""
        p = parent.params
        reason = check_token_stop(token, generated, p, parent.sampler.stop_set, context_full)
        if reason != "stop" and p.stop:
            window = parent.group.stop_window   # tokens: enough to hold any stop string that ends here (bounded)
            ids = parent.token_ids[max(parent.prompt_len, len(parent.token_ids) - window):] + [token]
            text = self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
            if any(s in text for s in p.stop):   # a running beam holds no stop string: a match is new
                reason = "stop_string"
        return reason

    def _fork_beam(self, parent: Sequence, c, entry: TokenLogprob | None, copies: list) -> Sequence:
        child = Sequence(parent.request_id, parent.prompt_len, parent.token_ids + [c.token], parent.params,
                         parent.max_len, parent.out, parent.timing, sampler=fork_sampler(parent.sampler),
                         arrived=parent.arrived, first_scheduled=parent.first_scheduled,
                         first_token=parent.first_token, group=parent.group, beam_score=c.score,
                         beam_logprobs=self._beam_logprobs(parent, entry))
        child.sampler.append(c.token)
        computed, bs = parent.num_computed, self.pool.block_size
        full, tail = divmod(computed, bs)
        if (parent.status is Status.RUNNING and computed == len(parent.token_ids)
                and len(parent.block_table) >= full + (tail > 0) and self._make_room(int(tail > 0), parent.group)):
            self._share_kv(parent, child, copies)
        else:   # the parent's KV is not all there (preempted) or no room: the child computes its own
            child.status = Status.WAITING
            self.scheduler.waiting.appendleft(child)
        return child

    def _share_kv(self, parent: Sequence, child: Sequence, copies: list) -> None:
        """child continues from parent's computed KV: full blocks shared (ref + 1), the partly filled last one
        copied into a block of its own (both write their next position there). Appends the copy to `copies`
        (the caller runs backend.copy_blocks before the next forward) and makes child a running sequence.
        The caller made sure one block is free."""
        full, tail = divmod(parent.num_computed, self.pool.block_size)
        shared = parent.block_table[:full]
        self.pool.fork(shared)
        child.block_table, child.block_hashes = list(shared), list(parent.block_hashes[:full])
        if tail:
            block = self.pool.allocate(1)[0]
            copies.append((parent.block_table[full], block, tail))
            child.block_table.append(block)
        child.num_computed, child.status = parent.num_computed, Status.RUNNING
        self.scheduler.running.append(child)

    def _copy_tails(self, copies: list[tuple[int, int, int]]) -> None:
        """Run the (src, dst, positions) block copies _share_kv queued."""
        if copies:
            self.backend.copy_blocks([(s, d) for s, d, _ in copies], [n for _, _, n in copies])

    def _fork_followers(self, leader: Sequence) -> list[Sequence]:
        """n > 1: leader's prompt KV is complete; the other choices start from it and sample their first token
        from the same logits row. One without a free block for its tail computes its own prompt later."""
        forked, copies = [], []
        tail = int(leader.num_computed % self.pool.block_size > 0)
        for f in leader.followers:
            if f.status is Status.FINISHED:   # cancelled while waiting
                continue
            if not self.pool.can_allocate(tail):
                self.scheduler.add(f)
                continue
            self._share_kv(leader, f, copies)
            f.first_scheduled = leader.first_scheduled
            if leader.prompt_logprobs is not None:
                f.prompt_logprobs = list(leader.prompt_logprobs)
            forked.append(f)
        self._copy_tails(copies)
        leader.followers = None   # only now: if forking raised, _fail ends them all with the leader
        return forked

    def _make_room(self, blocks: int, group: BeamGroup) -> bool:
        """Free `blocks` KV blocks, preempting the newest running sequences of other requests if needed."""
        while not self.pool.can_allocate(blocks):
            victim = next((s for s in reversed(self.scheduler.running) if s.group is not group), None)
            if victim is None:
                return False
            self.scheduler.preempt(victim)
        return True

    def _unstall(self) -> None:
        """Nothing could run: every running sequence is a beam waiting for a sibling that cannot be admitted
        (other searches hold the KV). Let the oldest search through: preempt everything else, its waiting
        beams first in line. Each search fits alone (submit checks), so it completes."""
        groups = {s.group for s in self.scheduler.running if s.group is not None and not s.group.done}
        if not groups:
            return
        oldest = min(groups, key=lambda g: g.root.arrived)
        for seq in list(self.scheduler.running):
            if seq.group is not oldest:
                self.scheduler.preempt(seq)
        waiting = self.scheduler.waiting
        first = [s for s in waiting if s.group is oldest]
        rest = [s for s in waiting if s.group is not oldest]
        waiting.clear()
        waiting.extend(first + rest)

    def _beam_chunk(self, group: BeamGroup, hyp: Hypothesis) -> Chunk:
        """A finished hypothesis as one whole-choice Chunk: text as the streaming path would have made it."""
        tokens, logprobs, reason = hyp.payload
        p = group.params
        root = group.root
        detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=p.skip_special_tokens,
                                       prompt_ids=root.token_ids[:root.prompt_len])
        stop = StopStringMatcher(p.stop, p.include_stop_str_in_output) if p.stop else None
        parts = []
        for i, token in enumerate(tokens):
            text, stopped = _text_step(detok, stop, token, reason if i == len(tokens) - 1 else None,
                                        p.include_stop_str_in_output)
            parts.append(text)
            if stopped:
                break
        return Chunk(text="".join(parts), token_ids=tokens, logprobs=logprobs,
                     finish_reason="length" if reason == "length" else "stop", prompt_tokens=root.prompt_len,
                     completion_tokens=len(tokens), prompt_logprobs=root.prompt_logprobs)

    def _finish_group(self, group: BeamGroup, chunks: list[Chunk] | None = None, error: str | None = None) -> None:
        """End a beam search with its n result chunks, or (chunks None) abort it: cancel, failure, shutdown."""
        if group.done:
            return
        group.done = True
        # its beams, and any a failed _beam_step forked before it could list them in group.beams
        sched = self.scheduler
        for seq in group.beams + [s for s in sched.running + list(sched.waiting) if s.group is group]:
            self.scheduler.finish(seq)
        group.logits.clear()
        self._set_timing(group.root)
        if chunks is None:
            chunks = [Chunk(finish_reason="abort", error=error, prompt_tokens=group.root.prompt_len)
                      for _ in range(group.params.n)]
        group.out.put(chunks)
