"""The generation loop: requests in, streamed chunks out, one engine thread driving scheduler -> backend ->
sampler -> detokenizer -> stop rules. Usable without HTTP: `Engine(model_dir).generate(prompt, params)`."""
from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np

from appliance.backends import StepBatch, load_backend
from appliance.config import EngineConfig
from appliance.detokenizer import IncrementalDetokenizer
from appliance.kv_cache import BlockPool
from appliance.manifest import Manifest
from appliance.outputs import Chunk, GenerationResult, Timing, TokenLogprob
from appliance.params import SamplingParams
from appliance.sampling import SequenceSampler, sample_batch
from appliance.scheduler import Scheduler
from appliance.sequence import Sequence, Status
from appliance.stopping import StopStringMatcher, check_token_stop
from appliance.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """More requests are waiting than `max_queued` allows (HTTP 429)."""


class PromptTooLong(ValueError):
    """Prompt (+ max_tokens) does not fit the context (HTTP 400)."""


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

    def cancel(self) -> None:
        self._engine._cancel(self._seq)

    def result(self) -> GenerationResult:
        text, ids, logprobs, last = [], [], [], Chunk()
        for last in self:
            text.append(last.text)
            ids += last.token_ids
            if last.logprobs:
                logprobs += last.logprobs
        if last.error:
            raise RuntimeError(last.error)
        params = self._seq.params
        return GenerationResult("".join(text), ids, last.finish_reason, last.prompt_tokens, last.completion_tokens,
                                logprobs if params.logprobs is not None else None, self.timing)


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
        self._wake = threading.Event()
        self._stop = False
        self._ids = itertools.count()
        self.counters = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "aborted": 0}
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # ---- requester side (any thread) ----
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> RequestHandle:
        if not prompt_ids:
            raise ValueError("prompt is empty")
        limit = self.max_context
        if len(prompt_ids) + (params.max_tokens or 0) > limit or len(prompt_ids) >= limit:
            raise PromptTooLong(f"Number of prompt tokens: {len(prompt_ids)} + max tokens value: "
                                f"{params.max_tokens or 0} exceeds model max length: {limit}")
        if self._inbox.qsize() + len(self.scheduler.waiting) >= self.config.max_queued:
            raise QueueFull("the server is busy: too many queued requests, retry later")
        max_len = min(limit, len(prompt_ids) + params.max_tokens if params.max_tokens is not None else limit)
        seq = Sequence(request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}", len(prompt_ids),
                       list(prompt_ids), params, max_len, queue.SimpleQueue(), Timing(created=time.time()))
        self._inbox.put(("add", seq))
        self._wake.set()
        return RequestHandle(self, seq)

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None) -> GenerationResult:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return self.submit(ids, params or SamplingParams()).result()

    def stats(self) -> dict:
        return {"queued": len(self.scheduler.waiting) + self._inbox.qsize(), "running": len(self.scheduler.running),
                "kv_blocks_used": self.pool.num_used, "kv_blocks_total": self.pool.num_blocks,
                "kv_block_size": self.pool.block_size, "prefix_cache_hit_tokens": self.pool.hits,
                "prefix_cache_query_tokens": self.pool.queries,
                "preemptions": self.scheduler.preemptions, **self.counters}

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.backend.close()

    def _cancel(self, seq: Sequence) -> None:
        self._inbox.put(("cancel", seq))
        self._wake.set()

    # ---- engine thread ----
    def _loop(self) -> None:
        while not self._stop:
            self._drain_inbox()
            if not self.scheduler.has_work():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception as exc:  # a failed step must not kill the engine: fail its sequences, go on
                log.exception("engine step failed")
                for seq in list(self.scheduler.running):
                    self._finish(seq, "abort", error=f"internal error: {type(exc).__name__}")
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._finish(seq, "abort", error="server shutting down")

    def _drain_inbox(self) -> None:
        while True:
            try:
                op, seq = self._inbox.get_nowait()
            except queue.Empty:
                return
            if op == "add":
                self._start(seq)
            elif seq.status is not Status.FINISHED:
                self.counters["aborted"] += 1
                self._finish(seq, "abort")

    def _start(self, seq: Sequence) -> None:
        p = seq.params
        seq.sampler = SequenceSampler(p, seq.token_ids[: seq.prompt_len], self.eos_token_ids)
        seq.detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=p.skip_special_tokens,
                                           prompt_ids=seq.token_ids[: seq.prompt_len])
        seq.stop = StopStringMatcher(p.stop, p.include_stop_str_in_output) if p.stop else None
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += seq.prompt_len
        self.scheduler.add(seq)

    def step(self) -> None:
        plan = self.scheduler.schedule()
        if not plan:
            return
        now = time.monotonic()
        for seq, _ in plan:
            if seq.first_scheduled is None:
                seq.first_scheduled = now
        batch = StepBatch([s.token_ids[s.num_computed: s.num_computed + n] for s, n in plan],
                          [s.num_computed for s, _ in plan], [s.block_table for s, _ in plan])
        logits = self.backend.forward(batch)
        rows, ready = [], []
        for i, (seq, n) in enumerate(plan):
            seq.num_computed += n
            self.scheduler.computed(seq)
            if seq.num_computed == len(seq.token_ids):
                rows.append(i)
                ready.append(seq)
        if not ready:
            return
        out = sample_batch(logits[rows] if len(rows) < len(plan) else logits, [s.sampler for s in ready])
        for j, seq in enumerate(ready):
            self._append(seq, int(out.token_ids[j]), out, j)

    def _append(self, seq: Sequence, token: int, out, j: int) -> None:
        now = time.monotonic()
        if seq.first_token is None:
            seq.first_token = now
        seq.token_ids.append(token)
        seq.sampler.append(token)
        self.counters["generated_tokens"] += 1
        reason = check_token_stop(token, seq.num_generated, seq.params, self.eos_token_ids,
                                  len(seq.token_ids) >= seq.max_len)
        # The EOS / stop token that ends a sequence is not text the user asked for (as OpenAI and vLLM do).
        hidden = reason == "stop" and not seq.params.include_stop_str_in_output
        text = "" if hidden else seq.detok.add([token])
        if reason is not None:
            text += seq.detok.flush()
        if seq.stop is not None:
            text, stopped = seq.stop.feed(text)
            if stopped:
                reason = "stop"
            elif reason is not None:
                text += seq.stop.flush()
        logprobs = self._logprobs(seq, token, out, j) if seq.params.logprobs is not None else None
        chunk = Chunk(text=text, token_ids=[token], logprobs=logprobs, prompt_tokens=seq.prompt_len,
                      completion_tokens=seq.num_generated)
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
        self.scheduler.finish(seq)
        t = seq.timing
        end = time.monotonic()
        start = seq.first_scheduled or end
        first = seq.first_token or end
        t.queue_time, t.prompt_time = start - seq.arrived, first - start
        t.completion_time, t.total_time = end - first, end - seq.arrived
        chunk = chunk or Chunk(prompt_tokens=seq.prompt_len, completion_tokens=seq.num_generated)
        chunk.finish_reason, chunk.error = reason, error
        seq.emit(chunk)
