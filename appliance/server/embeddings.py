"""Embeddings and rerank in the engine process: an `EncoderService` per served encoder model (a manifest whose
`task` is embed or rerank), in the model's slot where an LLM has its Engine, and `run_encode`, which answers one
`EncodeJob` on its worker connection's thread.

Why a worker thread of its own, not the LLM engine's step loop: an encoder forward over a large batch takes tens
to hundreds of milliseconds, and the engine's loop decodes a token for every stream per step; run inside it, one
big embeddings request would stall every chat stream by that much. Here the encoder thread runs beside the engine
thread (both release the GIL inside OpenVINO), so the two only share the cores. On a small box the encoder then
gets fewer inference threads than the cores (`ENCODER_THREADS`) and the lowest scheduling priority (`NICE`), so
chat decoding keeps the lead: the measurements are in docs/performance.md (bench/embeddings_http.py `mixed`).

Batching: requests from every client queue here; their inputs (texts, token ids, rerank pairs) are items. Each
forward takes one batch of items of similar length (a length bucket: the window of waiting items sorted by
length, cut where the padded size, longest x count, would pass `batch_tokens`): the bucket that holds the first
waiting item of the request whose turn it is, the requests taking turns (round robin), so a small request is not
stuck behind a large one that came first, and none waits behind later ones for long. A request's inputs may span
several batches (and share them with other requests); each result goes to its input's place. A request whose
client went away (the worker closed the connection) is dropped from the queue at once; a forward that fails is
run again one request at a time, so only the request whose inputs fail gets the error.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np

from appliance import protocol as p
from appliance.limits import Limits
from appliance.server.jobs import closed

if TYPE_CHECKING:
    from appliance.server.metrics import ServerMetrics
    from appliance.server.slots import Models

log = logging.getLogger(__name__)

# Padded tokens per forward (longest item x items). all-MiniLM-L6-v2 int8 on one thread of the 2-core dev box (under
# other agents' load, average 13) ran ~800 tokens/s whether the batch was 8 x 128, 32 x 128, 64 x 128 or 256 x 16:
# past a few inputs a bigger batch buys nothing, it only holds the encoder longer (4096 tokens: ~5 s there). 2048
# keeps a forward, the longest a new request waits for its turn, at ~2.5 s loaded (well under a second idle).
BATCH_TOKENS = 2048
MAX_BATCH = 64  # items per forward
WINDOW = 1024  # waiting items sorted into length buckets per batch
ENCODER_THREADS = max(1, (os.cpu_count() or 2) // 2)  # inference threads; the rest of the cores stay the LLM's
# The encoder thread's niceness above the process's (Linux: a thread's own; the inference thread it runs is itself
# with 1 thread): chat decoding first whenever both want the cores. Measured with bench/embeddings_http.py `mixed`
# (4 chat streams, 8 clients embedding, 1 encoder thread) on the dev box under other agents' load: chat ITL p99
# +59% at nice 5 (6 pairs), +24% at nice 19 (4 pairs; p50 unchanged). The cost: under contention a niced encoder
# gets little CPU (a one-sentence forward took 94 ms at nice 5 against 48 ms at nice 0 with the box loaded); on a
# box whose only other work is the chat engine it only yields to chat. APPLIANCE_ENCODER_NICE sets it (0: none).
NICE = int(os.environ.get("APPLIANCE_ENCODER_NICE", "19"))
IDLE_WAIT = 0.5  # seconds between heartbeats while idle
CANCEL_POLL = 0.05  # seconds between checks that the worker is still there while a request waits


class EncodeFailed(Exception):
    """A request's own failure, answered with this `Failed`."""

    def __init__(self, failed: p.Failed):
        super().__init__(failed.message)
        self.failed = failed


class _NoChatTemplate:
    chat_template = None  # Slot.parsers() reads it: an encoder has no chat, its parsers are never used


@dataclass(eq=False)
class _Request:
    items: list[Any]  # token ids (embed) or (ids, token type ids) pairs (rerank)
    task: str
    results: list[Any] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)  # indexes of the items not batched yet
    remaining: int = 0  # items without a result yet
    error: BaseException | None = None
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    queued: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.results = [None] * len(self.items)
        self.waiting = list(range(len(self.items)))
        self.remaining = len(self.items)
        if not self.items:
            self.done.set()


class EncoderService:
    """An Encoder (appliance/runtime/encoder.py) served to many clients at once. It stands where an LLM's Engine
    stands in a slot: `alive`, `dead`, `heartbeat`, `on_death`, `shutdown()`, `stats()`, `manifest`, `max_context`."""

    def __init__(
        self,
        encoder,
        *,
        batch_tokens: int = BATCH_TOKENS,
        max_batch: int = MAX_BATCH,
        nice: int = NICE,
        metrics: ServerMetrics | None = None,
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
        self.batch_tokens, self.max_batch, self.nice = batch_tokens, max_batch, nice
        self.heartbeat = time.monotonic()
        self.dead: BaseException | None = None
        self.on_death = None
        self._queue: deque[_Request] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._batches = 0
        self._thread = threading.Thread(target=self._loop, name="encoder", daemon=True)
        self._thread.start()

    # ---- the Engine-like surface a slot needs
    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.dead is None

    def shutdown(self) -> None:
        with self._cv:
            self._stopping = True
            for req in self._queue:
                req.error = EncodeFailed(p.Failed(503, "The server is shutting down", code="shutting_down"))
                req.done.set()
            self._queue.clear()
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def stats(self) -> dict:
        with self._cv:
            return {"queued": sum(len(r.waiting) for r in self._queue), "running": 0}

    # ---- requests (any thread)
    def prepare(self, job: p.EncodeJob, limits: Limits) -> _Request:
        """The job's items, tokenized and checked (EncodeFailed: a 400 naming the bound)."""
        enc, limit = self.encoder, self.max_context
        if job.task != self.task:
            what = "an embedding model" if self.task == "embed" else "a rerank model"
            raise EncodeFailed(
                p.Failed(400, f"The model `{job.model}` is {what}: it does not serve {job.task} requests", "model")
            )
        items: list[Any]
        if job.task == "rerank":
            assert job.query is not None and job.documents is not None, "a rerank job has a query and documents"
            try:
                items = [(list(ids), list(types)) for ids, types in enc.tokenize_pairs(job.query, job.documents)]
            except (TypeError, ValueError) as exc:
                raise EncodeFailed(p.Failed(400, f"the input cannot be tokenized: {exc}", "documents")) from None
            items = [_cut_pair(ids, types, limit) for ids, types in items]  # as Cohere: a long document is cut
            param = "documents"
        else:
            if job.token_ids is not None:
                items = [list(ids) for ids in job.token_ids]
                bad = next((t for ids in items for t in ids if self.vocab_size and not 0 <= t < self.vocab_size), None)
                if bad is not None:
                    raise EncodeFailed(
                        p.Failed(400, f"token id {bad} is out of the vocabulary range [0, {self.vocab_size})", "input")
                    )
            else:
                assert job.texts is not None, "an embed job has texts or token ids"
                try:
                    items = [list(ids) for ids in enc.tokenize(list(job.texts))]
                except (TypeError, ValueError) as exc:
                    raise EncodeFailed(p.Failed(400, f"the input cannot be tokenized: {exc}", "input")) from None
            for i, ids in enumerate(items):
                if not ids:
                    raise EncodeFailed(p.Failed(400, f"input {i} is empty", "input"))
                if len(ids) > limit:
                    if not job.truncate:
                        raise EncodeFailed(
                            p.Failed(
                                400,
                                f"input {i} is {len(ids)} tokens, more than the model's maximum of {limit} "
                                "(send truncate: true to cut it to the maximum)",
                                "input",
                            )
                        )
                    items[i] = list(enc.truncate(ids))
            param = "input"
        total = sum(len(item[0] if job.task == "rerank" else item) for item in items)
        if total > limits.embedding_tokens:
            raise EncodeFailed(
                p.Failed(
                    400,
                    f"this request is {total} tokens, more than the limit of {limits.embedding_tokens} per request",
                    param,
                )
            )
        if job.dimensions is not None:
            if job.task != "embed" or not 1 <= job.dimensions <= self.dimensions:
                raise EncodeFailed(
                    p.Failed(400, f"dimensions must be between 1 and {self.dimensions} for this model", "dimensions")
                )
            if job.dimensions != self.dimensions and not self.normalized:
                raise EncodeFailed(
                    p.Failed(
                        400,
                        "this model does not support `dimensions`: its vectors are not normalized, so a shortened "
                        "one would not be one of its embeddings",
                        "dimensions",
                    )
                )
        return _Request(items, job.task)

    def submit(self, req: _Request) -> _Request:
        with self._cv:
            if self._stopping or self.dead is not None:
                raise EncodeFailed(p.Failed(503, "The model cannot serve now", code="engine_failed"))
            if req.items:
                self._queue.append(req)
                self._cv.notify()
        return req

    def cancel(self, req: _Request) -> None:
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

    def answer(self, job: p.EncodeJob, req: _Request) -> p.Encoded:
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

    # ---- the encoder thread
    def _loop(self) -> None:
        if self.nice:
            try:  # Linux: a thread's own niceness (inference threads it starts inherit it)
                os.setpriority(
                    os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + self.nice
                )
            except (OSError, AttributeError):
                pass
        try:
            while True:
                with self._cv:
                    while not self._queue and not self._stopping:
                        self._cv.wait(IDLE_WAIT)
                        self.heartbeat = time.monotonic()
                    if self._stopping:
                        return
                    batch = self._next_batch()
                self._run(batch)
                self.heartbeat = time.monotonic()
        except BaseException as exc:  # a bug here: fail what waits, report like a dead engine
            self.dead = exc
            log.exception("the encoder loop died")
            with self._cv:
                for req in self._queue:
                    req.error = exc
                    req.done.set()
                self._queue.clear()
            if self.on_death is not None:
                self.on_death(exc)

    def _next_batch(self) -> list[tuple[_Request, int]]:
        """Under the lock: the length bucket holding the first waiting item of the request at the head of the queue
        (whose turn it is), then that request goes to the back (module docstring)."""
        window: list[tuple[_Request, int]] = []
        for req in self._queue:
            window += [(req, i) for i in req.waiting[: WINDOW - len(window)]]
            if len(window) >= WINDOW:
                break
        first = window[0]
        window.sort(key=lambda it: _length(it[0].items[it[1]]))
        batches: list[list[tuple[_Request, int]]] = [[]]
        longest = 0
        for it in window:
            n = _length(it[0].items[it[1]])
            if batches[-1] and (
                max(longest, n) * (len(batches[-1]) + 1) > self.batch_tokens or len(batches[-1]) >= self.max_batch
            ):
                batches.append([])
                longest = 0
            batches[-1].append(it)
            longest = max(longest, n)
        batch = next(b for b in batches if first in b)
        taken: dict[_Request, set[int]] = {}
        for req, i in batch:
            taken.setdefault(req, set()).add(i)
        for req, indexes in taken.items():
            req.waiting = [i for i in req.waiting if i not in indexes]
            if not req.waiting:
                self._queue.remove(req)
        if self._queue and self._queue[0] is first[0]:  # round robin: the next batch starts from the next request
            self._queue.rotate(-1)
        return batch

    def _run(self, batch: list[tuple[_Request, int]]) -> None:
        batch = [(r, i) for r, i in batch if not r.cancelled]
        if not batch:
            return
        try:
            values = self._forward([r.items[i] for r, i in batch])
            self._deliver(batch, values)
        except Exception:
            requests = list(dict.fromkeys(r for r, _ in batch))
            if len(requests) == 1:
                self._fail(requests[0], batch)
                return
            for req in requests:  # one request at a time: only the one whose inputs fail gets the error
                mine = [(r, i) for r, i in batch if r is req]
                try:
                    self._deliver(mine, self._forward([r.items[i] for r, i in mine]))
                except Exception:
                    self._fail(req, mine)

    def _forward(self, items: list) -> np.ndarray:
        started = time.monotonic()
        values = self.encoder.score(items) if self.task == "rerank" else self.encoder.embed(items)
        if self.metrics is not None:
            padded = max(map(_length, items)) * len(items)
            self.metrics.observe_encoder_batch(len(items), padded, time.monotonic() - started)
        self._batches += 1
        return values

    @staticmethod
    def _deliver(batch: list[tuple[_Request, int]], values: np.ndarray) -> None:
        for (req, i), value in zip(batch, values, strict=True):
            req.results[i] = value
            req.remaining -= 1
            if req.remaining == 0:
                req.done.set()

    def _fail(self, req: _Request, batch: list) -> None:
        log.warning("encoder: a request failed", exc_info=True, extra={"inputs": len(req.items)})
        req.error = EncodeFailed(p.Failed(500, "The model failed on this request's input", code="encoder_failed"))
        with self._cv:
            req.cancelled = True
            if req in self._queue:
                self._queue.remove(req)
        req.done.set()


def _length(item) -> int:
    return len(item[0]) if isinstance(item, tuple) else len(item)


def _cut_pair(ids: list[int], types: list[int], limit: int) -> tuple[list[int], list[int]]:
    """A query + document pair cut to `limit` tokens, its last ([SEP]) token kept."""
    if len(ids) <= limit:
        return ids, types
    return ids[: limit - 1] + ids[-1:], types[: limit - 1] + types[-1:]


# ---- the engine socket's ENCODE op (engine_service.py hands it over on the connection's thread)
def run_encode(
    models: Models,
    conn: Connection,
    job: p.EncodeJob,
    limits: Limits,
    metrics: ServerMetrics,
    ensure: Callable[[str, Callable[[], bool]], p.Failed | None] | None = None,
) -> bool:
    """Answers the job with one Encoded or Failed. False when the worker closed the connection meanwhile (its
    client went away: the request's waiting inputs were dropped). `ensure`: the supervisor's load on demand, for a
    model its keep_alive or the memory budget unloaded (appliance/server/residency.py), as a generation job's."""
    from appliance.server.slots import model_not_found, not_ready

    with models.in_flight(job.model) as slot:
        if slot is None:
            conn.send(model_not_found(job.model))
            return True
        if slot.unloaded and ensure is not None and (failed := ensure(slot.spec.name, lambda: closed(conn))):
            conn.send(failed)
            return True
        service = slot.engine
        if service is None or slot.state != "ready":
            conn.send(not_ready("stopping" if models.stopping else slot.state))
            return True
        if not isinstance(service, EncoderService):
            conn.send(
                p.Failed(
                    400,
                    f"The model `{slot.spec.name}` generates text: it does not serve "
                    f"{'embeddings' if job.task == 'embed' else 'rerank'} requests "
                    "(ask an embedding or rerank model; GET /v3/models lists them)",
                    "model",
                )
            )
            return True
        if problem := slot.problem():
            conn.send(p.Failed(503, f"The engine cannot serve: {problem}", code="engine_failed"))
            return True
        try:
            req = service.submit(service.prepare(job, limits))
        except EncodeFailed as exc:
            metrics.encode_requests.labels(job.task, "invalid" if exc.failed.status < 500 else "failed").inc()
            conn.send(exc.failed)
            return True
        while not req.done.wait(CANCEL_POLL):
            if conn.poll(0):  # the worker only ever closes the connection mid-request
                service.cancel(req)
                metrics.encode_requests.labels(job.task, "cancelled").inc()
                return False
        try:
            answer = service.answer(job, req)
        except EncodeFailed as exc:
            metrics.encode_requests.labels(job.task, "failed").inc()
            conn.send(exc.failed)
            return True
        metrics.encode_requests.labels(job.task, "ok").inc()
        metrics.encode_tokens.labels(job.task).inc(sum(answer.tokens))
        metrics.encode_duration.observe(answer.seconds)
        conn.send(answer)
        return True


def load_encoder_service(model_dir: str, device: str, threads: int | None, metrics: ServerMetrics | None):
    """The served model of an encoder export, loaded and warmed up (the first forward compiles)."""
    from appliance.runtime.encoder import Encoder  # type: ignore[import-not-found,unused-ignore]  # heavy (OpenVINO)

    encoder = Encoder(model_dir, device, threads=threads or ENCODER_THREADS)
    service = EncoderService(encoder, metrics=metrics)
    try:
        if service.task == "rerank":
            ids, types = encoder.tokenize_pairs("Hello", ["Hello"])[0]
            encoder.score([_cut_pair(list(ids), list(types), encoder.max_length)])
        else:
            encoder.embed([list(encoder.tokenize(["Hello"])[0])])
    except BaseException:
        service.shutdown()
        raise
    return service


def model_task(model_dir: str) -> str:
    """The export's task from its manifest: generate (an LLM), embed or rerank."""
    from appliance.manifest import Manifest

    try:
        return Manifest.load(model_dir).task
    except (OSError, ValueError, TypeError):
        return "generate"  # the LLM loader reports what is wrong with it
