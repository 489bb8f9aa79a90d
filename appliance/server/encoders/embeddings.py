"""Embeddings and rerank in the engine process: the engine socket's ENCODE op (`run_encode`, on the worker
connection's thread), the load of an encoder export (`load_encoder_service`) and the export's task (`model_task`).

The parts: appliance/server/encoders/inputs.py (a job's inputs tokenized and checked: every 400),
appliance/server/encoders/batches.py (the queue and how a forward's batch is chosen: length buckets, round robin),
appliance/server/encoders/service.py (`EncoderService`: the encoder's threads, their priority beside chat).

The HTTP path of one request: the worker sends the `EncodeJob` on its pooled engine connection; this connection's
thread tokenizes and checks it (`prepare`) and, when the encoder is idle and chat is not running, runs its forward
itself; otherwise it queues it and waits on its event (the worker's closing the connection cancels it) while an
encoder thread runs the forward; this thread answers `Encoded`, the vectors as float32 bytes (a
384-dimension vector is 1.5 KB pickled; the worker turns it into JSON floats or base64).
"""

from __future__ import annotations

from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from appliance import protocol as p
from appliance.limits import Limits
from appliance.server.encoders.inputs import EncodeFailed
from appliance.server.encoders.service import ENCODER_THREADS, EncoderService
from appliance.server.jobs import closed

if TYPE_CHECKING:
    from appliance.server.metrics import ServerMetrics
    from appliance.server.slots import Models

__all__ = ["EncodeFailed", "EncoderService", "chat_running", "load_encoder_service", "model_task", "run_encode"]

CANCEL_POLL = 0.05  # seconds between checks that the worker is still there while a request waits


def chat_running(models: Models) -> bool:
    """True while a generation model of the process has sequences running or waiting: the encoder's forwards
    then yield the cores to it (service.py). Reads the schedulers' lists without their engines' locks
    (a length under the GIL; a stale answer costs one batch's priority)."""
    for slot in models.all():
        scheduler = getattr(slot.engine, "scheduler", None)
        if scheduler is not None and (scheduler.running or scheduler.waiting):
            return True
    return False


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
        service.contended = lambda: chat_running(models)
        try:
            req = service.submit(service.prepare(job, limits), inline=True)
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
        p.send_event(conn, answer)
        return True


def load_encoder_service(
    model_dir: str, device: str, threads: int | None, metrics: ServerMetrics | None, nice: int, sched: str
):
    """The served model of an encoder export, loaded and warmed up (the first forward compiles); `nice`, `sched`:
    its background thread's priority (--encoder-nice, --encoder-sched)."""
    from appliance.runtime.encoder import Encoder  # type: ignore[import-not-found,unused-ignore]  # heavy (OpenVINO)

    encoder = Encoder(model_dir, device, threads=threads or ENCODER_THREADS)
    service = EncoderService(encoder, metrics=metrics, nice=nice, sched=sched)
    try:
        if service.task == "rerank":
            encoder.score(encoder.tokenize_pairs("Hello", ["Hello"], truncate=True))
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
