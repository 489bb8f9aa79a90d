"""The engine process's OpenTelemetry spans of a job (appliance/tracing.py says when tracing is on): children of
the worker's request span, whose trace context came with the job (protocol.Job.trace).

    POST /v1/chat/completions          (the worker's SERVER span)
      engine job                       receipt of the job -> its End sent to the worker
        queue                          the sequence arrived -> its first step scheduled
        prefill                        first step -> first token
        decode                         first token -> last token
        stream                         first chunk handed to the worker -> last chunk

queue, prefill and decode are one sequence's (choice's; `appliance.choice` tells them apart when a request has
several), and their edges are the engine's own timestamps of the sequence: the `Timing` it reports with the last
chunk (created + queue_time, prompt_time, completion_time: the numbers of a response's `time_info` and Ollama's
durations). stream's edges are when the job's chunks went to the worker. No span is made while the request runs:
the engine's step loop is untouched, and the spans are written with explicit start and end times once the job's
End is sent (`JobTrace.end`), into the batch processor's queue; its thread exports them.

Attributes: `gen_ai.request.model`, `gen_ai.usage.input_tokens` (prompt tokens), `gen_ai.usage.output_tokens`
(completion tokens), `gen_ai.usage.cache_read.input_tokens` (prompt tokens from the prefix cache),
`gen_ai.response.finish_reasons`; a job refused (400, 404, 429, 503) has status Error with the status and code, a
sequence aborted by an error too. Never the prompt, the output, or an error message (they may quote the prompt).

The hook into the job runner is one wrapper around the job's connection (`JobTrace.watch`): the events sent to the
worker already say everything (Accepted, Failed, each ChoiceChunk with its Timing at the end, End).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from appliance import protocol as p
from appliance import tracing
from appliance.outputs import Chunk, Timing
from appliance.settings import ServeSettings

log = logging.getLogger(__name__)

_tracing: JobTracing | None = None  # this process's, when tracing is on (`setup`)


def setup(settings: ServeSettings) -> None:
    """At the engine process's start: its provider, when tracing is on (nothing imported otherwise)."""
    global _tracing
    url = tracing.endpoint(settings.otlp_endpoint)
    _tracing = JobTracing(tracing.provider("engine", url)) if url is not None else None


def job_trace(job: p.Job) -> JobTrace | None:
    """A recorder for this job's spans: None unless tracing is on and the job's request span is sampled."""
    if _tracing is None or not tracing.sampled(job.trace):
        return None
    return JobTrace(_tracing, job)


class JobTracing:
    def __init__(self, tracer_provider: Any):
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = tracer_provider
        self.tracer = tracer_provider.get_tracer("appliance.engine")
        self.trace = trace
        self.w3c = TraceContextTextMapPropagator()


def _ns(seconds: float) -> int:
    return int(round(seconds * 1e9))


@dataclass
class ChoiceTrace:
    first_sent: int = 0  # time.time_ns() of its first chunk to the worker
    last_sent: int = 0
    chunks: int = 0
    last: Chunk | None = None  # the chunk with its finish_reason
    timing: Timing | None = None


@dataclass
class JobTrace:
    """One job's timestamps and counts as it runs; its spans once it ended."""

    tracing: JobTracing
    job: p.Job
    received: int = field(default_factory=time.time_ns)
    prompt_tokens: list[int] = field(default_factory=list)
    failed: p.Failed | None = None
    ended: int = 0  # time.time_ns() of its End to the worker (0: the worker went away before it)
    choices: dict[int, ChoiceTrace] = field(default_factory=dict)

    def watch(self, conn: Any) -> TracedConnection:
        return TracedConnection(conn, self)

    def sent(self, event: object) -> None:
        """An event went to the worker."""
        if type(event) is p.ChoiceChunk:  # per token: a few assignments (a choice is one pump thread's)
            now = time.time_ns()
            c = self.choices.get(event.index)
            if c is None:
                c = self.choices.setdefault(event.index, ChoiceTrace(now))
            c.last_sent = now
            c.chunks += 1
            if event.chunk.finish_reason:
                c.last, c.timing = event.chunk, event.timing
        elif isinstance(event, p.Accepted):
            self.prompt_tokens = list(event.prompt_tokens)
        elif isinstance(event, p.Failed):
            self.failed = event
        elif isinstance(event, p.End):
            self.ended = time.time_ns()

    def end(self) -> None:
        """The job is over (its End sent, or its worker gone): its spans, with the times recorded. A failure here is
        logged, never the job's."""
        try:
            self._spans()
        except Exception:
            log.warning("tracing: the spans of a job could not be made", exc_info=True)

    def _spans(self) -> None:
        trace, tracer = self.tracing.trace, self.tracing.tracer
        Status, StatusCode = trace.Status, trace.StatusCode
        parent = self.tracing.w3c.extract(self.job.trace or {})
        choices = sorted(self.choices.items())  # the pumps are done: nothing adds to it any more
        done = [(i, c) for i, c in choices if c.last is not None]  # the choices whose last chunk was sent
        attributes: dict[str, Any] = {"appliance.choices": len(self.job.prompts) * self.job.n}
        if self.job.model:
            attributes["gen_ai.request.model"] = self.job.model
        if self.prompt_tokens:
            attributes["gen_ai.usage.input_tokens"] = sum(self.prompt_tokens)
        if done:
            attributes["gen_ai.usage.output_tokens"] = sum(c.last.completion_tokens for _, c in done if c.last)
            attributes["gen_ai.usage.cache_read.input_tokens"] = sum(c.last.cached_tokens for _, c in done if c.last)
            attributes["gen_ai.response.finish_reasons"] = [c.last.finish_reason or "" for _, c in done if c.last]
        job_span = tracer.start_span(
            "engine job", context=parent, kind=trace.SpanKind.INTERNAL, start_time=self.received, attributes=attributes
        )
        if self.failed is not None:
            job_span.set_attribute("error.type", self.failed.code or str(self.failed.status))
            job_span.set_status(Status(StatusCode.ERROR, f"{self.failed.status} {self.failed.code or ''}".strip()))
        elif len(done) < len(choices) or (not choices and self.prompt_tokens and self.job.params.max_tokens != 0):
            job_span.set_attribute("appliance.cancelled", True)  # the worker closed the job before its end
        inside = trace.set_span_in_context(job_span, parent)
        for index, c in choices:
            self._choice_spans(tracer, inside, index, c, len(choices) > 1)
        job_span.end(end_time=self.ended or time.time_ns())

    def _choice_spans(self, tracer: Any, inside: Any, index: int, c: ChoiceTrace, several: bool) -> None:
        Status, StatusCode = self.tracing.trace.Status, self.tracing.trace.StatusCode
        own = {"appliance.choice": index} if several else {}
        chunk, t = c.last, c.timing
        if chunk is not None and t is not None and t.total_time > 0:
            queued = _ns(t.created)
            scheduled = queued + _ns(t.queue_time)
            first_token = scheduled + _ns(t.prompt_time)
            finished = first_token + _ns(t.completion_time)
            prefill = {"gen_ai.usage.input_tokens": chunk.prompt_tokens}
            prefill["gen_ai.usage.cache_read.input_tokens"] = chunk.cached_tokens
            decode = {
                "gen_ai.usage.output_tokens": chunk.completion_tokens,
                "gen_ai.response.finish_reasons": [chunk.finish_reason or ""],
            }
            for name, start, end, attributes in (
                ("queue", queued, scheduled, {}),
                ("prefill", scheduled, first_token, prefill),
                ("decode", first_token, finished, decode),
            ):
                span = tracer.start_span(name, context=inside, start_time=start, attributes={**own, **attributes})
                if name == "decode" and chunk.finish_reason == "abort":
                    span.set_status(Status(StatusCode.ERROR, "aborted" if chunk.error else "cancelled"))
                span.end(end_time=end)
        if c.chunks:
            span = tracer.start_span(
                "stream", context=inside, start_time=c.first_sent, attributes={**own, "appliance.chunks": c.chunks}
            )
            span.end(end_time=c.last_sent)


class TracedConnection(p.EventConnection):
    """The job's connection as the job runner uses it (protocol.EventConnection: the same one-write sends),
    telling `trace` what is sent to the worker."""

    def __init__(self, conn: Any, trace: JobTrace):
        super().__init__(conn)
        self._trace = trace

    def send(self, event: object) -> None:
        # noted first: once sent, the worker may end its own span before this thread runs again, and a child span
        # must not end after its parent (a send that fails ends the job anyway)
        self._trace.sent(event)
        super().send(event)

    def try_send(self, event: object) -> bool:
        if not super().try_send(event):  # (a first token only: no span ends on it)
            return False
        self._trace.sent(event)
        return True
