"""A queued job's output in the engine process (jobs.py queues it): its sequences' chunks forwarded over the
worker's connection as the engine produces them, and counted in the metrics.

Each sequence is drained by a pump thread (a one-sequence job's first token is written by the engine thread itself
when the socket takes it without blocking: waking the pump while the next step holds the cores cost 0.5-5 ms of
TTFT, bench.http_breakdown); the connection's thread meanwhile watches the socket, and when the worker closes it
(its client went away, or the request timed out) every sequence of the job is cancelled at once. No sequence runs
on without a reader: a pump thread that cannot start fails the job (503) and cancels the rest.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from multiprocessing.connection import wait
from typing import Any

from appliance import protocol as p
from appliance.outputs import Chunk
from appliance.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


class JobPumps:
    """One job's pumps over `handles` ([(choice index, handle, submitted)]); `run` streams them to the end."""

    def __init__(self, conn: p.EventConnection, handles: list, metrics: ServerMetrics, load_seconds: float = 0.0):
        self.conn = conn
        self.handles = handles
        self.metrics = metrics
        self.load_seconds = load_seconds  # the model's load was part of the job's wait: its timings count it
        self.send_lock = threading.Lock()
        self.open = True  # False once the worker is gone (or a send failed): the rest is drained, not sent
        self.lasts = {index: submitted for index, _, submitted in handles}  # each choice's last token (ITL)
        self.wake_r, self.wake_w = os.pipe()

    def run(self) -> bool:
        """Streams every sequence and then End. False when the worker closed the connection (the job was
        cancelled)."""
        handles = self.handles
        pumps = [threading.Thread(target=self.pump, args=h, name="engine-pump", daemon=True) for h in handles]
        starting = True
        try:
            for t in pumps:
                t.start()
            starting = False
            if len(handles) == 1:  # its first token sent by the engine thread itself: no hand-off to the pump
                index, handle, submitted = handles[0]

                def first(chunk: Chunk) -> bool:
                    return self.send_first(index, chunk, submitted)

                handle.divert_first(first)
            self.watch(len(pumps))
            for t in pumps:
                t.join()
        except BaseException as exc:  # no sequence of the job may run on without a reader (to max_tokens)
            self.open = False
            cancel(handles)
            for t in pumps:
                if t.ident is not None:  # started: it drains its sequence to the abort
                    t.join()
            if not (starting and isinstance(exc, RuntimeError)):
                raise
            # no thread to spare (the unit's TasksMax, memory): this request fails, the next may not
            log.warning("engine: no thread for a job's output", extra={"sequences": len(handles), "error": str(exc)})
            message = "The server cannot take this request now: no thread left for its output"
            self.conn.send(p.Failed(503, message, code="engine_overloaded"))
            self.conn.send(p.End())
            return True
        finally:
            os.close(self.wake_r)
            os.close(self.wake_w)
        if self.open:
            self.conn.send(p.End())
        return self.open

    def watch(self, pumps: int) -> None:
        """Until every pump has finished: a worker that closes the connection cancels the job's sequences."""
        finished = 0
        watch: list[Any] = [self.conn, self.wake_r]  # wait() takes anything with fileno()
        while finished < pumps:
            for ready in wait(watch):
                if ready is self.wake_r:
                    finished += len(os.read(self.wake_r, 64))
                    continue
                try:  # the worker only ever closes the connection mid-job; anything else is treated alike
                    self.conn.recv()
                except (EOFError, OSError):
                    pass
                self.open = False
                watch = [self.wake_r]
                cancel(self.handles)

    def pump(self, index: int, handle, submitted: float) -> None:
        """On its own thread: one sequence's chunks, each sent as it comes (its last one with the timings)."""
        try:
            for offset, chunk in handle.events():
                self.lasts[index] = observe(self.metrics, chunk, submitted, self.lasts[index])
                if not self.open:
                    continue
                timing = handle.timing if chunk.finish_reason else None
                if timing is not None and self.load_seconds:
                    timing = replace(
                        timing,
                        queue_time=timing.queue_time + self.load_seconds,
                        total_time=timing.total_time + self.load_seconds,
                    )
                event = p.ChoiceChunk(index + offset, chunk, timing)
                try:
                    with self.send_lock:
                        self.conn.send(event)
                except OSError:
                    self.open = False
                    cancel(self.handles)
        finally:
            os.write(self.wake_w, b".")

    def send_first(self, index: int, chunk: Chunk, submitted: float) -> bool:
        """On the engine thread (RequestHandle.divert_first): the job's first token sent now if that cannot block;
        False leaves it to the pump (which also meets a broken connection and ends the job)."""
        if not self.open or not self.send_lock.acquire(blocking=False):
            return False
        try:
            if not self.conn.try_send(p.ChoiceChunk(index, chunk)):
                return False
        except OSError:
            return False
        finally:
            self.send_lock.release()
        self.lasts[index] = observe(self.metrics, chunk, submitted, self.lasts[index])
        return True


def observe(m: ServerMetrics, chunk: Chunk, submitted: float, last: float) -> float:
    """A chunk counted in the metrics (tokens, TTFT or ITL, and at its end the sequence); the time of the choice's
    last token."""
    now = time.monotonic()
    if chunk.token_ids:
        m.generated_tokens.inc(len(chunk.token_ids))
        if chunk.completion_tokens <= len(chunk.token_ids):
            m.ttft.observe(now - submitted)
        else:
            m.itl.observe((now - last) / len(chunk.token_ids))
        last = now
    if chunk.finish_reason:
        m.sequences.labels(chunk.finish_reason).inc()
        m.prompt_tokens.inc(chunk.prompt_tokens)
        m.e2e.observe(now - submitted)
        if chunk.finish_reason == "abort" and chunk.error is None:
            m.cancelled.inc()
    return last


def cancel(handles: list) -> None:
    for _, handle, _ in handles:
        handle.cancel()
