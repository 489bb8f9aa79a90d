"""Jobs in the engine process (engine_service.py hands them over): tokenize a job's prompts, submit them to its
model's Engine, stream the chunks back over the worker's connection, and count them in the metrics.

A job's sequences are each drained by a pump thread that forwards chunks as the engine produces them (a
one-sequence job's first token is written by the engine thread itself when the socket takes it without blocking:
waking the pump while the next step holds the cores cost 0.5-5 ms of TTFT, bench.http_breakdown); the
connection's thread meanwhile watches the socket, and when the worker closes it (its client went away, or the
request timed out) every sequence of the job is cancelled at once. A refused job is one `Failed` then `End`: the
request's fault is a 400, a full queue a 429, a model that cannot serve a 503, before anything is queued.

A job for a model the residency policy unloaded waits here, on its connection's thread, for `ensure` (the
supervisor's load on its loader thread); its in-flight count is held meanwhile, so once loaded the model cannot be
unloaded under it. The wait is part of the job: queue_time, total_time, time to first token (metrics) and
Accepted.load_seconds (Ollama's load_duration) include it. A worker that closes the connection meanwhile ends the
wait (the load itself goes on, for the next request).

Ollama's num_ctx (Job.context_window, at most the model's context) bounds the prompt and the output together:
max_tokens is capped to what is left of the window; a chat prompt over the window loses its oldest messages (never
a system message, never the last one), as Ollama's chat does; a prompt still over it (a raw prompt, or a last
message alone too long) is a 400: cutting tokens off its start, as Ollama's runner does, would cut the chat
template's own start.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from appliance import protocol as p
from appliance.limits import Limits
from appliance.outputs import Chunk, Timing
from appliance.runtime.engine import EngineDead, PromptTooLong, QueueFull
from appliance.runtime.engine.admission import ParamInvalid
from appliance.runtime.grammar import GrammarError
from appliance.runtime.tokenizer import TextTooLong
from appliance.server import tool_prompt, tracing
from appliance.server.metrics import ServerMetrics
from appliance.server.setup_gate import SetupGate
from appliance.server.slots import Models, Rejected, Slot, model_not_found, not_ready

if TYPE_CHECKING:
    from appliance.runtime.engine import Engine

log = logging.getLogger(__name__)


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
        return self._stream(conn, handles, load_seconds)

    def submit(self, job: p.Job, slot: Slot | None = None) -> tuple[list, p.Accepted]:
        """Tokenize and queue the job on its model's engine: ([(choice index, handle, submitted)], Accepted), or
        Rejected with nothing left queued. The prompts are tokenized first, outside the set-up gate (the tokenizer
        drops the GIL: a 600,000-character prompt's 2 s of encoding held the gate, and so every other tenant's
        set-up, a victim's completion going from 0.08 to 1.17 s); the rest of its set-up (bad words, the
        prediction, the grammar, the submission) one job at a time, tenants in turn (setup_gate.py)."""
        slot = slot or self.models.slot(job.model)
        engine = slot.engine
        if engine is None or slot.state != "ready":
            raise Rejected(not_ready("stopping" if self.models.stopping else slot.state))
        task = getattr(engine, "task", "generate")
        if task != "generate":  # an embedding / rerank model (server/encoders/embeddings.py)
            raise Rejected(
                p.Failed(
                    400,
                    f"The model `{slot.spec.name}` is {'an embedding' if task == 'embed' else 'a rerank'} "
                    "model: it does not generate text (send it to /v3/embeddings or /v3/rerank, or ask a chat model)",
                    "model",
                )
            )
        vocab = engine.manifest.vocab_size
        bad = next((t for t in job.params.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise Rejected(
                p.Failed(400, f"stop token id {bad} is out of the vocabulary range [0, {vocab})", "stop_token_ids")
            )
        window = min(job.context_window, engine.max_context) if job.context_window else None
        try:
            prompts = [prompt_ids(spec, slot, job.params.max_tokens, window) for spec in job.prompts]
            echo = [echo_text(spec, engine) for spec in job.prompts] if job.echo else None
        except (TypeError, ValueError) as exc:  # the tokenizer refused the text: the request's fault, not ours
            raise Rejected(p.Failed(400, f"the prompt cannot be tokenized: {exc}", "prompt")) from None
        with self.setup_gate.hold(job.tenant):
            return self._set_up(job, slot, engine, prompts, echo, window)

    def _set_up(
        self, job: p.Job, slot: Slot, engine: Engine, prompts: list[list[int]], echo: list | None, window: int | None
    ) -> tuple[list, p.Accepted]:
        limits = self.limits
        try:  # bad words and the prediction tokenized once for all the request's sequences, off the engine thread
            prepared = engine.prepare(job.params)
        except (TypeError, ValueError) as exc:  # ParamInvalid names its field; the rest came from bad words
            param = exc.param if isinstance(exc, ParamInvalid) else "bad_words"
            raise Rejected(p.Failed(400, str(exc), param)) from None
        if job.tenant and engine.config.prefix_cache_sharing == "keys":  # API keys apart in the prefix cache
            prepared = replace(prepared, cache_scope=job.tenant)
        if window is not None:  # num_ctx: the prompt and the output within the window
            room = window - max(map(len, prompts))
            if prepared.max_tokens is None or prepared.max_tokens > room:
                prepared = replace(prepared, max_tokens=room)
        job = replace(job, params=prepared)
        check_setup(job, prompts, engine, limits)
        check_generated_logprobs(job, prompts, engine.max_context, limits)
        k = job.params.prompt_logprobs
        volume = sum(map(len, prompts)) * (1 + k) * job.n if k is not None else 0
        if volume > limits.prompt_logprobs:  # echo + logprobs: an entry per prompt token and alternative, per choice
            raise Rejected(
                p.Failed(
                    400,
                    f"echo with logprobs: {sum(map(len, prompts))} prompt tokens x (1 + {k}) "
                    f"logprobs x n {job.n} = {volume} entries, more than the limit of "
                    f"{limits.prompt_logprobs} per request",
                    "logprobs",
                )
            )
        accepted = p.Accepted([len(ids) for ids in prompts], echo, slot.serial)
        if job.params.max_tokens == 0 and job.params.prompt_logprobs is None:
            return [], accepted
        beam = job.params.best_of is not None and job.params.best_of > 1
        handles = []
        try:
            if beam:  # one search per prompt answers its n choices (events carry the choice offset)
                for i, ids in enumerate(prompts):
                    handles.append(
                        (
                            i * job.n,
                            engine.submit(ids, job.params, request_id=f"{job.request_id}-{i}"),
                            time.monotonic(),
                        )
                    )
            else:  # every prompt and choice in one submission: all queued or none, prefilled together
                p0 = job.params  # n choices must differ even with a fixed seed; Friendli's seed list: one each
                seeds: list[int | None] = (
                    list(job.seeds)
                    if job.seeds
                    else [p0.seed if j == 0 or p0.seed is None else (p0.seed + j) % 2**32 for j in range(job.n)]
                )
                params = [p0 if s == p0.seed else replace(p0, seed=s) for s in seeds]
                choices = engine.submit_prompts(
                    [
                        (ids, params, [f"{job.request_id}-{i * job.n + j}" for j in range(job.n)])
                        for i, ids in enumerate(prompts)
                    ]
                )
                now = time.monotonic()
                handles = [(k, h, now) for k, h in enumerate(h for hs in choices for h in hs)]
        except QueueFull as exc:
            cancel(handles)
            self.metrics.rejected.labels("queue_full").inc()
            raise Rejected(p.Failed(429, str(exc), code="queue_full")) from None
        except EngineDead as exc:  # died between slot.problem() and the submission
            cancel(handles)
            raise Rejected(p.Failed(503, f"The engine cannot serve: {exc}", code="engine_failed")) from None
        except GrammarError as exc:  # the response_format's (or the tools') schema / regex / grammar does not compile
            cancel(handles)
            self.metrics.rejected.labels("invalid").inc()
            grammar = job.params.grammar
            raise Rejected(p.Failed(400, str(exc), grammar.param if grammar else "response_format")) from None
        except ValueError as exc:  # PromptTooLong and other prompt problems the engine found
            cancel(handles)
            self.metrics.rejected.labels("invalid").inc()
            raise Rejected(p.Failed(400, str(exc))) from None
        return handles, accepted

    def _stream(self, conn: p.EventConnection, handles: list, load_seconds: float = 0.0) -> bool:
        send_lock = threading.Lock()
        wake_r, wake_w = os.pipe()
        state = {"open": True}
        lasts = {index: submitted for index, _, submitted in handles}  # each choice's last token (metrics' ITL)

        def pump(index: int, handle, submitted: float) -> None:
            try:
                for offset, chunk in handle.events():
                    lasts[index] = self._observe(chunk, submitted, lasts[index])
                    if not state["open"]:
                        continue
                    timing = handle.timing if chunk.finish_reason else None
                    if timing is not None and load_seconds:
                        timing = replace(
                            timing,
                            queue_time=timing.queue_time + load_seconds,
                            total_time=timing.total_time + load_seconds,
                        )
                    event = p.ChoiceChunk(index + offset, chunk, timing)
                    try:
                        with send_lock:
                            conn.send(event)
                    except OSError:
                        state["open"] = False
                        cancel(handles)
            finally:
                os.write(wake_w, b".")

        pumps = [threading.Thread(target=pump, args=h, name="engine-pump", daemon=True) for h in handles]
        finished = 0
        watch: list[Any] = [conn, wake_r]  # wait() takes anything with fileno()
        starting = True
        try:
            for t in pumps:
                t.start()
            starting = False
            if len(handles) == 1:  # its first token sent by the engine thread itself: no hand-off to the pump
                index, handle, submitted = handles[0]

                def first(chunk: Chunk) -> bool:
                    return self._send_first(conn, index, chunk, submitted, send_lock, state, lasts)

                handle.divert_first(first)
            while finished < len(pumps):
                for ready in wait(watch):
                    if ready is wake_r:
                        finished += len(os.read(wake_r, 64))
                        continue
                    try:  # the worker only ever closes the connection mid-job; anything else is treated alike
                        conn.recv()
                    except (EOFError, OSError):
                        pass
                    state["open"] = False
                    watch = [wake_r]
                    cancel(handles)
            for t in pumps:
                t.join()
        except BaseException as exc:  # no sequence of the job may run on without a reader (to max_tokens)
            state["open"] = False
            cancel(handles)
            for t in pumps:
                if t.ident is not None:  # started: it drains its sequence to the abort
                    t.join()
            if not (starting and isinstance(exc, RuntimeError)):
                raise
            # no thread to spare (the unit's TasksMax, memory): this request fails, the next may not
            log.warning("engine: no thread for a job's output", extra={"sequences": len(handles), "error": str(exc)})
            message = "The server cannot take this request now: no thread left for its output"
            conn.send(p.Failed(503, message, code="engine_overloaded"))
            conn.send(p.End())
            return True
        finally:
            os.close(wake_r)
            os.close(wake_w)
        if state["open"]:
            conn.send(p.End())
        return state["open"]

    def _send_first(
        self,
        conn: p.EventConnection,
        index: int,
        chunk: Chunk,
        submitted: float,
        send_lock: threading.Lock,
        state: dict,
        lasts: dict,
    ) -> bool:
        """On the engine thread (RequestHandle.divert_first): the job's first token sent now if that cannot block;
        False leaves it to the pump (which also meets a broken connection and ends the job)."""
        if not state["open"] or not send_lock.acquire(blocking=False):
            return False
        try:
            if not conn.try_send(p.ChoiceChunk(index, chunk)):
                return False
        except OSError:
            return False
        finally:
            send_lock.release()
        lasts[index] = self._observe(chunk, submitted, lasts[index])
        return True

    def _observe(self, chunk: Chunk, submitted: float, last: float) -> float:
        now = time.monotonic()
        m = self.metrics
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


def check_setup(job: p.Job, prompts: list[list[int]], engine: Engine, limits: Limits) -> None:
    """Rejected (400) when the request's set-up work on the engine thread (limits.py's `setup_work`: ban tables,
    the prediction's draft index, the no-repeat n-gram index, per sequence) is over the limit."""
    params = job.params
    beam = params.best_of is not None and params.best_of > 1  # beams share their root's tables; no speculation
    per_prompt = 1 if beam else job.n
    bad = sum(map(len, params.bad_word_tokens))
    ngram = params.max_ngram_size or engine.config.max_ngram_size
    predicted = len(params.prediction_ids or ()) * ngram if not beam else 0
    repeat = max(0, params.no_repeat_ngram - 1)
    work = sum((bad + predicted + len(ids) * repeat) * per_prompt for ids in prompts)
    if work > limits.setup_work:
        raise Rejected(
            p.Failed(
                400,
                f"this request's set-up work is {work} positions (per sequence: {bad} bad word tokens + "
                f"{len(params.prediction_ids or ())} prediction tokens x n-gram size {ngram} + prompt tokens x "
                f"(no_repeat_ngram {params.no_repeat_ngram} - 1); {len(prompts) * per_prompt} sequences), more than "
                f"the limit of {limits.setup_work} per request",
                "bad_words" if bad else "prediction" if predicted else "no_repeat_ngram",
            )
        )


def check_generated_logprobs(job: p.Job, prompts: list[list[int]], context: int, limits: Limits) -> None:
    """Rejected (400) when the request could produce more generated logprobs (n x tokens x (1 + logprobs)) than
    the limits table's `generated_logprobs`: the HTTP worker holds them until a unary response is built."""
    k = job.params.logprobs
    if k is None:
        return
    cap = job.params.max_tokens
    tokens = sum(max(0, context - len(ids)) if cap is None else min(cap, context) for ids in prompts)
    volume = tokens * (1 + k) * job.n
    if volume > limits.generated_logprobs:
        raise Rejected(
            p.Failed(
                400,
                f"logprobs: up to {tokens} generated tokens x (1 + {k}) logprobs x n {job.n} = {volume} entries, "
                f"more than the limit of {limits.generated_logprobs} per request (lower max_tokens, n or logprobs)",
                "logprobs",
            )
        )


def closed(conn: Connection | p.EventConnection) -> bool:
    """The worker closed the connection (it sends nothing else during a job: readable means EOF)."""
    try:
        return conn.poll(0)
    except (OSError, EOFError):
        return True


def prompt_ids(spec: p.PromptSpec, slot: Slot, max_tokens: int | None = None, window: int | None = None) -> list[int]:
    """The prompt's token ids (chat: templated). `window` (num_ctx): a chat prompt loses its oldest messages until
    it leaves room for one token; a prompt still too long is a 400."""
    ids = _prompt_ids(spec, slot, max_tokens)
    if window is None or len(ids) < window:
        return ids
    if spec.messages is not None:
        ids = _fit_messages(spec, slot, max_tokens, window)
    if len(ids) >= window:
        raise Rejected(
            p.Failed(
                400,
                f"the prompt is {len(ids)} tokens, which does not fit num_ctx {window} (with room for one token "
                "to generate); raise num_ctx or shorten the prompt",
                "num_ctx",
            )
        )
    return ids


def _fit_messages(spec: p.PromptSpec, slot: Slot, max_tokens: int | None, window: int) -> list[int]:
    """The prompt with the fewest oldest droppable messages (not system, not the last) left out that fits the
    window; binary search (the prompt shrinks as more are left out), each probe one templating."""
    messages = spec.messages or []
    droppable = [i for i, m in enumerate(messages[:-1]) if not (isinstance(m, dict) and m.get("role") == "system")]

    def without(k: int) -> list[int]:
        gone = set(droppable[:k])
        kept = [m for i, m in enumerate(messages) if i not in gone]
        return _prompt_ids(replace(spec, messages=kept), slot, max_tokens)

    if not droppable:
        return _prompt_ids(spec, slot, max_tokens)
    lo, hi = 1, len(droppable)  # without(hi) fits once checked; the least k in [lo, hi] that fits is wanted
    best = without(hi)
    if len(best) >= window:
        return best
    while lo < hi:
        mid = (lo + hi) // 2
        ids = without(mid)
        if len(ids) < window:
            hi, best = mid, ids
        else:
            lo = mid + 1
    return best


def _prompt_ids(spec: p.PromptSpec, slot: Slot, max_tokens: int | None = None) -> list[int]:
    engine = slot.engine
    assert engine is not None, "submit checked it"
    tok = engine.tokenizer
    limit = engine.max_context  # text that cannot be this many tokens is refused before it is encoded
    if spec.token_ids is not None:
        vocab = engine.manifest.vocab_size
        bad = next((t for t in spec.token_ids if t >= vocab), None)
        if bad is not None:
            raise Rejected(
                p.Failed(400, f"prompt token id {bad} is out of the vocabulary range [0, {vocab})", "prompt")
            )
        return list(spec.token_ids)
    if spec.messages is not None:
        try:
            # the template spells out BOS and friends; special-token text in content stays text. Tools go to
            # the template, or into the prompt when it has no use for them (appliance/server/tool_prompt.py)
            messages, kwargs = tool_prompt.chat_inputs(spec.messages, spec.tools, tok.chat_template, slot.parsers()[0])
            if spec.thinking is not None:  # a template without the switch ignores it
                kwargs["enable_thinking"] = spec.thinking
            ids = tok.encode_chat(messages, add_generation_prompt=True, token_budget=limit, **kwargs)
        except Exception as exc:  # no template, a broken one, or its raise_exception (roles must alternate)
            raise Rejected(p.Failed(400, str(exc), "messages")) from None
    else:
        assert spec.text is not None, "a PromptSpec holds text, token ids or messages"
        try:  # as OVMS: a raw prompt gets BOS if the model has one
            ids = tok.encode(spec.text, add_special_tokens=True, token_budget=limit)
        except TextTooLong as exc:
            raise Rejected(
                p.Failed(400, f"the prompt cannot fit the model max length: {limit}: {exc}", "prompt")
            ) from None
    if not ids:
        raise Rejected(p.Failed(400, "prompt is empty after tokenization", "prompt"))
    # (static shapes: a prompt past max_prompt gets the engine's own message for that)
    if len(ids) >= limit and (engine.backend.max_prompt is None or len(ids) <= engine.backend.max_prompt):
        # refused now, not after the request's other prompts were tokenized too (in the engine's words)
        raise Rejected(p.Failed(400, str(PromptTooLong.over_context(len(ids), max_tokens, limit))))
    return ids


def echo_text(spec: p.PromptSpec, engine: Engine) -> str:
    if spec.text is not None:
        return spec.text
    assert spec.token_ids is not None, "a PromptSpec holds text, token ids or messages"
    return engine.tokenizer.decode(spec.token_ids)


def cancel(handles: list) -> None:
    for _, handle, _ in handles:
        handle.cancel()
