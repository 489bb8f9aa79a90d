"""`EncoderService`: an Encoder (appliance/runtime/encoder.py) served to many clients at once, in the model's slot
where an LLM has its Engine; its batches are chosen by appliance/server/encoders/batches.py, its inputs checked by
appliance/server/encoders/inputs.py.

Why threads of its own, not the LLM engine's step loop: an encoder forward over a large batch takes tens to
hundreds of milliseconds, and the engine's loop decodes a token for every stream per step; run inside it, one big
embeddings request would stall every chat stream by that much. Here the encoder runs beside the engine thread
(both release the GIL inside OpenVINO), so the two only share the cores. On a small box the encoder gets fewer
inference threads than the cores (`ENCODER_THREADS`; with one, OpenVINO runs the forward on the calling thread).

Priority follows the chat engine: two encoder threads take turns at the one queue, one forward at a time. While a
generation model in the process has sequences running or waiting (`contended`), forwards run on the background
thread, at the lowest priority (appliance/server/encoders/priority.py: why and what it measured); otherwise on the
one at the process's own priority.

The path of a request when nothing else is queued and chat is not running: its connection thread runs the forward
itself (`submit(inline=True)`) instead of waking an encoder thread and being woken by it: on a loaded box each
wake-up may wait for a core. Measured on the loaded 2-core dev box: the engine's queue-to-answer is the forward
+ 0.6 ms (docs/performance.md).

A request whose client went away (the worker closed the connection) is dropped from the queue at once; a forward
that fails is run again one request at a time, so only the request whose inputs fail gets the error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from appliance import protocol as p
from appliance.limits import Limits
from appliance.runtime.cores import cores
from appliance.server.encoders.batches import Batch, EncodeRequest, deliver, item_length, next_batch
from appliance.server.encoders.inputs import EncodeFailed, prepare_items
from appliance.server.encoders.priority import lower_priority, name_os_thread

if TYPE_CHECKING:
    from appliance.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

# Padded tokens per batch (longest item x items). all-MiniLM-L6-v2 int8 on one thread of the 2-core dev box (under
# other agents' load, average 13) ran ~800 tokens/s whether the batch was 8 x 128, 32 x 128, 64 x 128 or 256 x 16,
# and a forward's own cost is ~6 tokens' worth (appliance/runtime/encoder.py): past a few inputs a bigger batch buys
# nothing, it only holds the encoder longer. 512 keeps a batch, the longest a new request waits for its turn and
# the longest a batch started at full priority runs once chat starts (the turn is decided per batch), at ~0.6 s
# loaded (~0.15 s idle); 2048 measured the same sentences/s and held chat's first tokens up to 4x longer.
BATCH_TOKENS = 512
MAX_BATCH = 64  # items per forward
# inference threads; the rest of the cores stay the LLM's. The cores the process may run on (a pinned service's), not
# the box's: a service given one core gets one thread, not half of the box.
ENCODER_THREADS = max(1, cores() // 2)
IDLE_WAIT = 0.5  # seconds between heartbeats while idle
HANDOFF_WAIT = 0.05  # seconds a thread whose turn it is not waits before it looks again


class _NoChatTemplate:
    chat_template = None  # Slot.parsers() reads it: an encoder has no chat, its parsers are never used


class EncoderService:
    """It stands where an LLM's Engine stands in a slot: `alive`, `dead`, `heartbeat`, `on_death`, `shutdown()`,
    `stats()`, `manifest`, `max_context`. `contended`: true while chat needs the cores (module docstring); the
    engine socket's handler sets it to the process's generation models' (appliance/server/encoders/embeddings.py)."""

    def __init__(
        self,
        encoder,
        *,
        batch_tokens: int = BATCH_TOKENS,
        max_batch: int = MAX_BATCH,
        nice: int = 0,  # the background thread's (0: none); serving passes --encoder-nice
        sched: str = "normal",  # its policy (priority.lower_priority); serving passes --encoder-sched
        metrics: ServerMetrics | None = None,
        contended: Callable[[], bool] | None = None,
    ):
        self.encoder = encoder
        self.task: str = encoder.task
        self.manifest = encoder.manifest
        self.max_context: int = encoder.max_length
        self.dimensions: int = encoder.dimensions if self.task == "embed" else 0
        self.normalized = bool(getattr(self.manifest, "normalize", False))
        self.vocab_size = int(getattr(self.manifest, "vocab_size", 0) or 0)
        self.generation_defaults: dict = {}
        self.tokenizer = _NoChatTemplate()
        self.metrics = metrics
        self.batch_tokens, self.max_batch, self.nice, self.sched = batch_tokens, max_batch, nice, sched
        self.contended: Callable[[], bool] = contended or (lambda: False)
        self.heartbeat = time.monotonic()
        self.dead: BaseException | None = None
        self.on_death = None
        self._queue: deque[EncodeRequest] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._running = False  # a batch is being run (one at a time)
        self._batches = 0
        self.background_batches = 0  # forwards run on the niced thread
        self.inline_batches = 0  # forwards run on a request's own thread (`submit(inline=True)`)
        self._threads = [threading.Thread(target=self._loop, args=(False,), name="encoder", daemon=True)]
        if nice:
            self._threads.append(threading.Thread(target=self._loop, args=(True,), name="encoder-bg", daemon=True))
        for thread in self._threads:
            thread.start()

    # ---- the Engine-like surface a slot needs
    @property
    def alive(self) -> bool:
        return all(t.is_alive() for t in self._threads) and self.dead is None

    def shutdown(self) -> None:
        with self._cv:
            self._stopping = True
            for req in self._queue:
                req.error = EncodeFailed(p.Failed(503, "The server is shutting down", code="shutting_down"))
                req.done.set()
            self._queue.clear()
            self._cv.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=10)

    def stats(self) -> dict:
        with self._cv:
            return {"queued": sum(len(r.waiting) for r in self._queue), "running": int(self._running)}

    # ---- requests (any thread)
    def prepare(self, job: p.EncodeJob, limits: Limits) -> EncodeRequest:
        """The job's items, tokenized and checked (EncodeFailed: a 400 naming the bound)."""
        items = prepare_items(self.encoder, job, limits, vocab_size=self.vocab_size, normalized=self.normalized)
        return EncodeRequest(items, job.task)

    def submit(self, req: EncodeRequest, *, inline: bool = False) -> EncodeRequest:
        """Queues the request for the encoder threads. `inline` (the engine socket's connection thread): when the
        encoder is idle and chat is not running, the request's first batch runs on the caller's thread instead,
        at once (module docstring: two thread wake-ups fewer); the rest, if any, queues."""
        quiet = inline and not (len(self._threads) > 1 and self.contended())
        with self._cv:
            if self._stopping or self.dead is not None:
                raise EncodeFailed(p.Failed(503, "The model cannot serve now", code="engine_failed"))
            if not req.items:
                return req
            if not quiet or self._running or self._queue:
                self._queue.append(req)
                self._cv.notify_all()
                return req
            self._running = True
            mine = deque([req])
            batch = next_batch(mine, self.batch_tokens, self.max_batch)
            if mine:  # more than one batch: the rest waits its turn
                self._queue.append(req)
        try:
            self.inline_batches += 1
            self._run(batch)
        finally:
            with self._cv:
                self._running = False
                if self._queue:  # the encoder threads wait for a queued request: wake them only for one
                    self._cv.notify_all()
        return req

    def cancel(self, req: EncodeRequest) -> None:
        """The client went away: its items not yet run are dropped."""
        with self._cv:
            req.cancelled = True
            if req in self._queue:
                self._queue.remove(req)

    def encode(self, job: p.EncodeJob, limits: Limits) -> p.Encoded:
        """In-process and tests: one job, waited for."""
        req = self.submit(self.prepare(job, limits))
        req.done.wait()
        return self.answer(job, req)

    def answer(self, job: p.EncodeJob, req: EncodeRequest) -> p.Encoded:
        if req.error is not None:
            if isinstance(req.error, EncodeFailed):
                raise req.error
            raise EncodeFailed(p.Failed(500, f"the model failed on this input: {type(req.error).__name__}"))
        seconds = time.monotonic() - req.queued
        if job.task == "rerank":  # relevance in (0, 1): the logit's sigmoid, as sentence-transformers' CrossEncoder
            logits = np.asarray(req.results, np.float64)
            scores = (1.0 / (1.0 + np.exp(-logits))).tolist()
            return p.Encoded([len(ids) for ids, _ in req.items], scores=scores, seconds=seconds)
        vectors = np.stack(req.results).astype(np.float32, copy=False) if req.results else np.zeros((0, 0), np.float32)
        if job.dimensions is not None and job.dimensions != vectors.shape[1]:
            vectors = vectors[:, : job.dimensions]
            norms = np.linalg.norm(vectors, axis=1, keepdims=True)
            vectors = vectors / np.maximum(norms, 1e-12)
        out = vectors.astype("<f4", copy=False)
        return p.Encoded([len(ids) for ids in req.items], vectors=[row.tobytes() for row in out], seconds=seconds)

    # ---- the encoder threads
    def _loop(self, background: bool) -> None:
        name_os_thread(threading.current_thread().name)
        if background:
            lower_priority(self.nice, self.sched)
        try:
            while True:
                batch = self._take(background)
                if batch is None:
                    return
                try:
                    self._run(batch)
                finally:
                    with self._cv:
                        self._running = False
                        self._cv.notify_all()
                self.heartbeat = time.monotonic()
        except BaseException as exc:  # a bug here: fail what waits, report like a dead engine
            self.dead = exc
            log.exception("the encoder loop died")
            with self._cv:
                self._stopping = True
                for req in self._queue:
                    req.error = exc
                    req.done.set()
                self._queue.clear()
                self._cv.notify_all()
            if self.on_death is not None:
                self.on_death(exc)

    def _take(self, background: bool) -> Batch | None:
        """The next batch for this thread once it is its turn (None: stopping). `contended` is asked outside the
        queue's lock: it reads the models' table, whose lock may be held by a caller of `stats()`."""
        while True:
            with self._cv:
                while not self._stopping and (not self._queue or self._running):
                    self._cv.wait(IDLE_WAIT)
                    self.heartbeat = time.monotonic()
                if self._stopping:
                    return None
            if len(self._threads) > 1 and self.contended() != background:
                with self._cv:  # the other thread's turn
                    self._cv.notify_all()
                    self._cv.wait(HANDOFF_WAIT)
                continue
            with self._cv:
                if self._stopping or not self._queue or self._running:
                    continue
                self._running = True
                return next_batch(self._queue, self.batch_tokens, self.max_batch)

    def _run(self, batch: Batch) -> None:
        batch = [(r, i) for r, i in batch if not r.cancelled]
        if not batch:
            return
        try:
            deliver(batch, self._forward([r.items[i] for r, i in batch]))
        except Exception:
            requests = list(dict.fromkeys(r for r, _ in batch))
            if len(requests) == 1:
                self._fail(requests[0])
                return
            for req in requests:  # one request at a time: only the one whose inputs fail gets the error
                mine = [(r, i) for r, i in batch if r is req]
                try:
                    deliver(mine, self._forward([r.items[i] for r, i in mine]))
                except Exception:
                    self._fail(req)

    def _forward(self, items: list) -> np.ndarray:
        started = time.monotonic()
        values = self.encoder.score(items) if self.task == "rerank" else self.encoder.embed(items)
        if self.metrics is not None:
            padded = max(map(item_length, items)) * len(items)
            self.metrics.observe_encoder_batch(len(items), padded, time.monotonic() - started)
        self._batches += 1
        if threading.current_thread().name == "encoder-bg":
            self.background_batches += 1
        return values

    def _fail(self, req: EncodeRequest) -> None:
        log.warning("encoder: a request failed", exc_info=True, extra={"inputs": len(req.items)})
        req.error = EncodeFailed(p.Failed(500, "The model failed on this request's input", code="encoder_failed"))
        with self._cv:
            req.cancelled = True
            if req in self._queue:
                self._queue.remove(req)
        req.done.set()
