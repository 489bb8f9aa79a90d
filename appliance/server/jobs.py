"""Jobs in the engine process (engine_service.py hands them over): a job checked and its prompts tokenized
(admit.py), its sequences queued on its model's Engine, its chunks streamed back over the worker's connection
(job_pumps.py). A refused job is one `Failed` then `End`: the request's fault is a 400, a full queue a 429, a model
that cannot serve a 503, before anything is queued.

A job for a model the residency policy unloaded waits here, on its connection's thread, for `ensure` (the
supervisor's load on its loader thread); its in-flight count is held meanwhile, so once loaded the model cannot be
unloaded under it. The wait is part of the job: queue_time, total_time, time to first token (metrics) and
Accepted.load_seconds (Ollama's load_duration) include it. A worker that closes the connection meanwhile ends the
wait (the load itself goes on, for the next request).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from appliance import protocol as p
from appliance.limits import Limits
from appliance.outputs import Chunk, Timing
from appliance.params import SamplingParams
from appliance.runtime.engine import EngineDead, PromptTooLong, QueueFull
from appliance.runtime.grammar import GrammarError
from appliance.server import tracing
from appliance.server.admit import Admitted, admit, tokenize
from appliance.server.job_pumps import JobPumps, cancel
from appliance.server.metrics import ServerMetrics
from appliance.server.prompts import CONTEXT_EXCEEDED
from appliance.server.setup_gate import SetupGate
from appliance.server.slots import Models, Rejected, Slot, model_not_found

if TYPE_CHECKING:
    from appliance.runtime.engine import Engine
    from appliance.runtime.media import Media


class JobRunner:
    """Runs the jobs of every connection against `models`, bounded by `limits`, counted in `metrics`."""

    def __init__(self, models: Models, metrics: ServerMetrics, limits: Limits):
        self.models = models
        self.metrics = metrics
        self.limits = limits
        self.setup_gate = SetupGate()  # every model's: set-up shares the cores and the GIL whichever model it is for
        # the supervisor's load of an unloaded model (name, worker gone?) -> None once loaded, or why it failed
        self.ensure: Callable[[str, Callable[[], bool]], p.Failed | None] | None = None

    def run(self, conn: Connection, job: p.Job) -> bool:
        """Streams the job's events. False when the worker closed the connection (the job was cancelled)."""
        trace = tracing.job_trace(job) if job.trace is not None else None  # OpenTelemetry on, request sampled
        sender = trace.watch(conn) if trace is not None else p.EventConnection(conn)  # one-write sends either way
        return self._run(sender, job, trace)

    def _run(self, conn: p.EventConnection, job: p.Job, trace: tracing.JobTrace | None) -> bool:
        try:
            arrived = time.monotonic()
            with self.models.in_flight(job.model, job.keep_alive) as slot:
                if slot is None:
                    conn.send(model_not_found(job.model))
                    conn.send(p.End())
                    return True
                load_seconds = 0.0
                if slot.unloaded and self.ensure is not None:
                    failed = self.ensure(slot.spec.name, lambda: closed(conn))
                    load_seconds = time.monotonic() - arrived
                    if failed is not None:
                        if closed(conn):
                            return False
                        conn.send(failed)
                        conn.send(p.End())
                        return True
                return self._run_on(conn, job, slot, arrived if load_seconds else None, load_seconds)
        finally:
            if trace is not None:
                trace.end()  # the job's spans, written after its End went out

    def _run_on(
        self,
        conn: p.EventConnection,
        job: p.Job,
        slot: Slot,
        arrived: float | None = None,
        load_seconds: float = 0.0,
    ) -> bool:
        if problem := slot.problem():
            conn.send(p.Failed(503, f"The engine cannot serve: {problem}", code="engine_failed"))
            conn.send(p.End())
            return True
        try:
            handles, accepted = self.submit(job, slot)
        except Rejected as exc:
            conn.send(exc.failed)
            conn.send(p.End())
            return True
        if load_seconds:  # the load was part of this job's wait: its timings and TTFT count it
            accepted = replace(accepted, load_seconds=load_seconds)
            handles = [(i, h, arrived) for i, h, _ in handles]
        try:
            conn.send(accepted)
        except BaseException:  # the worker is gone: nobody would read the sequences, which would run on
            cancel(handles)
            raise
        if not handles:  # echo with max_tokens 0 (and no prompt logprobs): the prompt is the whole answer
            for index in range(len(job.prompts) * job.n):
                tokens = accepted.prompt_tokens[index // job.n]
                conn.send(
                    p.ChoiceChunk(
                        index, Chunk(finish_reason="length", prompt_tokens=tokens), Timing(created=time.time())
                    )
                )
            conn.send(p.End())
            return True
        return JobPumps(conn, handles, self.metrics, load_seconds).run()  # False: the worker closed the connection

    def submit(self, job: p.Job, slot: Slot | None = None) -> tuple[list, p.Accepted]:
        """Check and queue the job on its model's engine: ([(choice index, handle, submitted)], Accepted), or
        Rejected with nothing left queued. The prompts are tokenized first, outside the set-up gate; the rest of
        its set-up (bad words, the prediction, the grammar, the submission) one job at a time, tenants in turn
        (admit.py says why)."""
        slot = slot or self.models.slot(job.model)
        tokenized = tokenize(job, slot, self.models.stopping, self.limits)
        with self.setup_gate.hold(job.tenant):
            return self.enqueue(admit(tokenized, self.limits))

    def enqueue(self, admitted: Admitted) -> tuple[list, p.Accepted]:
        """The admitted job's sequences queued on its engine, all or none: what the engine still refuses (a full
        queue 429, a dead engine 503, a grammar that does not compile or a prompt it finds too long 400) leaves
        nothing queued."""
        job, accepted = admitted.job, admitted.accepted
        if job.params.max_tokens == 0 and job.params.prompt_logprobs is None:
            return [], accepted
        handles: list = []
        try:
            queue_choices(admitted.engine, job, admitted.prompts, handles, admitted.media)
        except (QueueFull, EngineDead, ValueError) as exc:  # GrammarError and PromptTooLong are ValueErrors
            cancel(handles)
            raise Rejected(self.refusal(exc, job)) from None
        return handles, accepted

    def refusal(self, exc: Exception, job: p.Job) -> p.Failed:
        """The reply to a submission the engine refused, counted in the metrics."""
        if isinstance(exc, QueueFull):
            self.metrics.rejected.labels("queue_full").inc()
            return p.Failed(429, str(exc), code="queue_full")
        if isinstance(exc, EngineDead):  # died between slot.problem() and the submission
            return p.Failed(503, f"The engine cannot serve: {exc}", code="engine_failed")
        self.metrics.rejected.labels("invalid").inc()
        if isinstance(exc, GrammarError):  # the response_format's (or the tools') schema / regex / grammar
            grammar = job.params.grammar
            return p.Failed(400, str(exc), grammar.param if grammar else "response_format")
        if isinstance(exc, PromptTooLong):  # token ids past the context (a text was refused before it was encoded)
            return p.Failed(400, str(exc), job.prompts[0].prompt_field if job.prompts else None, CONTEXT_EXCEEDED)
        return p.Failed(400, str(exc))  # other prompt problems the engine found


def queue_choices(
    engine: Engine, job: p.Job, prompts: list[list[int]], handles: list, media: list[Media | None] | None = None
) -> None:
    """Submits the job's choices, appending (choice index, handle, submitted) to `handles` as they are queued (the
    caller cancels those if a later one is refused). `media[i]`: prompt i's images (vision-language models); the
    engine is given them only when a prompt has some, so a text job's submission is what it always was."""
    media = media if media and any(m is not None for m in media) else None
    if job.params.best_of is not None and job.params.best_of > 1:
        # beam search: one search per prompt answers its n choices (events carry the choice offset)
        for i, ids in enumerate(prompts):
            extra = {"media": media[i]} if media and media[i] is not None else {}
            handle = engine.submit(ids, job.params, request_id=f"{job.request_id}-{i}", **extra)
            handles.append((i * job.n, handle, time.monotonic()))
        return
    # every prompt and choice in one submission: all queued or none, prefilled together
    params = choice_params(job)
    requests: list[tuple[list[int], list[SamplingParams], list[str] | None]] = [
        (ids, params, [f"{job.request_id}-{i * job.n + j}" for j in range(job.n)]) for i, ids in enumerate(prompts)
    ]
    if media:
        choices = engine.submit_prompts(requests, media=media)
    else:
        choices = engine.submit_prompts(requests)
    now = time.monotonic()
    handles.extend((k, h, now) for k, h in enumerate(h for hs in choices for h in hs))


def choice_params(job: p.Job) -> list[SamplingParams]:
    """Each of the n choices' params: n choices must differ even with a fixed seed (seed + j); Friendli's seed
    list gives one each."""
    p0 = job.params
    seeds: list[int | None] = (
        list(job.seeds)
        if job.seeds
        else [p0.seed if j == 0 or p0.seed is None else (p0.seed + j) % 2**32 for j in range(job.n)]
    )
    return [p0 if s == p0.seed else replace(p0, seed=s) for s in seeds]


def closed(conn: Connection | p.EventConnection) -> bool:
    """The worker closed the connection (it sends nothing else during a job: readable means EOF)."""
    try:
        return conn.poll(0)
    except (OSError, EOFError):
        return True
