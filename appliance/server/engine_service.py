"""The engine process's side of the socket: owns the Engine, tokenizes, submits jobs, streams chunks back.

One thread per worker connection. A job's sequences are each drained by a pump thread that forwards chunks as
the engine produces them; the connection's thread meanwhile watches the socket, and when the worker closes it
(its client went away, or the request timed out) every sequence of the job is cancelled at once.

Liveness: the accept loop only accepts; the HMAC handshake runs in the connection's own thread with a timeout, so
a worker killed mid-handshake, a stalled peer or a wrong key costs that connection alone and never ends or
blocks accepting. `status()` is computed on every call from the engine loop's heartbeat: a dead engine thread or
one stuck in a step for ENGINE_STALL_SECONDS reads as not ready (the supervisor exits on a dead one).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, wait
from typing import TYPE_CHECKING

from appliance import tool_prompt
from appliance.engine import EngineDead, QueueFull
from appliance.grammar import GrammarError
from appliance.outputs import Chunk, Timing
from appliance.server import protocol as p
from appliance.server.metrics import ServerMetrics
from appliance.server.settings import ServeSettings

if TYPE_CHECKING:
    from appliance.engine import Engine

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 128  # workers x their pools reconnecting at once after a restart
ACCEPT_BACKOFF_SECONDS = 0.05
# A step that has not ended after this long means the engine is wedged (the longest legitimate step, a
# max_num_batched_tokens prefill of a large model on a slow CPU, is seconds). Readiness then answers 503.
ENGINE_STALL_SECONDS = 60.0


class _Rejected(Exception):
    def __init__(self, failed: p.Failed):
        super().__init__(failed.message)
        self.failed = failed


class EngineService:
    def __init__(self, settings: ServeSettings, metrics: ServerMetrics):
        self.settings = settings
        self._parsers: tuple[str, str] | None = None  # parsers(): resolved once the engine is attached
        self.metrics = metrics
        self.engine: Engine | None = None
        self.device = ""
        self.state = "loading"
        self.error: str | None = None
        self._listener: Listener | None = None
        self._authkey = b""
        self._faults = os.environ.get(p.FAULT_INJECTION_ENV) == "1"

    # ---- lifecycle (supervisor thread)
    def start(self) -> None:
        """Listen before the model loads, so workers can answer 503 "loading" instead of failing to connect.
        No authkey on the Listener: its accept() would run the handshake in the accept thread (see _serve)."""
        self._authkey = self.settings.authkey()
        self._listener = Listener(self.settings.socket_path, "AF_UNIX", backlog=LISTEN_BACKLOG)
        os.chmod(self.settings.socket_path, 0o600)
        threading.Thread(target=self._accept_loop, name="engine-accept", daemon=True).start()

    def attach(self, engine: Engine, device: str) -> None:
        self.engine, self.device = engine, device
        self.state = "ready"

    def fail(self, message: str) -> None:
        self.state, self.error = "failed", message

    def stop(self) -> None:
        self.state = "stopping"
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass

    # ---- connections
    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None, "start() opens the listener before this thread runs"
        while self.state != "stopping":
            try:
                conn = listener.accept()
                threading.Thread(target=self._serve, args=(conn,), name="engine-conn", daemon=True).start()
            except Exception:  # OSError (EMFILE, ...), RuntimeError (no thread): this loop must outlive it
                if self.state == "stopping":
                    return
                log.warning("engine socket: could not accept a connection", exc_info=True)
                time.sleep(ACCEPT_BACKOFF_SECONDS)  # e.g. out of fds: do not spin

    def _serve(self, conn: Connection) -> None:
        with conn:
            try:
                p.handshake(conn, self._authkey, server=True)
            except (OSError, EOFError, AuthenticationError) as exc:
                log.warning("engine socket: handshake failed", extra={"error": repr(exc)})
                return
            while True:
                try:
                    op, *args = conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    if op == p.JOB:
                        if not self._run_job(conn, args[0]):
                            return
                    else:
                        conn.send(self._call(op, args))
                except (EOFError, OSError):
                    return
                except Exception:  # a bug here must not take the engine process down; the worker sees EOF
                    log.exception("engine service: %s failed", op)
                    return

    def _call(self, op: str, args: list) -> p.Reply:
        if op == p.STATUS:
            return p.Reply(self.status())
        if op == p.FAULT and self._faults and self.engine is not None:
            self.engine.inject_fault(args[0])
            return p.Reply()
        if op == p.RECORD_HTTP:
            r: p.HttpRecord = args[0]
            self.metrics.record_http(r.route, r.method, r.status, r.error_type)
            return p.Reply()
        if op == p.METRICS:
            stats = self.engine.stats() if self.engine is not None else None
            return p.Reply(self.metrics.render(self.state == "ready", stats))
        if op == p.TOKENIZE:
            if self.engine is None:
                return p.Reply(error=_not_ready(self.state))
            return p.Reply([self.engine.tokenizer.encode(text, add_special_tokens=True) for text in args[0]])
        return p.Reply(error=p.Failed(500, f"unknown engine call {op!r}"))

    def status(self) -> p.EngineStatus:
        e = self.engine
        if e is None:
            return p.EngineStatus(self.state, self.error)
        state, error = self.state, self.error
        if state == "ready" and (problem := self.engine_problem()):
            state, error = "failed", problem
        return p.EngineStatus(
            state,
            error,
            e.max_context,
            e.manifest.vocab_size,
            e.generation_defaults,
            e.manifest.backend,
            e.manifest.weight_format,
            self.device,
            *self.parsers(),
        )

    def parsers(self) -> tuple[str, str]:
        """(tool parser, reasoning parser): the serve flags, `auto` resolved from the chat template once."""
        if self._parsers is None:
            assert self.engine is not None, "called with an attached engine"
            template = self.engine.tokenizer.chat_template
            s = self.settings
            self._parsers = (
                tool_prompt.choose_tool_parser(template, s.tool_parser),
                tool_prompt.choose_reasoning_parser(template, s.reasoning_parser),
            )
        return self._parsers

    def healthy(self) -> bool:
        """For the watchdog: loading or ready with a live, advancing engine loop."""
        return self.state in ("loading", "ready") and self.engine_problem() is None

    def engine_problem(self) -> str | None:
        """Why the attached engine cannot serve now (None: it can): its loop died, or one step has taken
        longer than ENGINE_STALL_SECONDS."""
        e = self.engine
        if e is None:
            return None
        if not e.alive:
            return f"the engine loop stopped: {type(e.dead).__name__ if e.dead else 'exited'}"
        stalled = time.monotonic() - e.heartbeat
        if stalled > ENGINE_STALL_SECONDS:
            return f"the engine loop has not advanced for {stalled:.0f} s"
        return None

    # ---- jobs
    def _run_job(self, conn: Connection, job: p.Job) -> bool:
        """Streams the job's events. False when the worker closed the connection (the job was cancelled)."""
        if problem := self.engine_problem():
            conn.send(p.Failed(503, f"The engine cannot serve: {problem}", code="engine_failed"))
            conn.send(p.End())
            return True
        try:
            handles, accepted = self._submit(job)
        except _Rejected as exc:
            conn.send(exc.failed)
            conn.send(p.End())
            return True
        conn.send(accepted)
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
        return self._stream(conn, handles)

    def _submit(self, job: p.Job) -> tuple[list, p.Accepted]:
        engine = self.engine
        if engine is None:
            raise _Rejected(_not_ready(self.state))
        vocab, limits = engine.manifest.vocab_size, self.settings.limits
        bad = next((t for t in job.params.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise _Rejected(
                p.Failed(400, f"stop token id {bad} is out of the vocabulary range [0, {vocab})", "stop_token_ids")
            )
        try:
            prompts = [self._prompt_ids(spec) for spec in job.prompts]
            echo = [self._echo_text(spec) for spec in job.prompts] if job.echo else None
        except (TypeError, ValueError) as exc:  # the tokenizer refused the text: the request's fault, not ours
            raise _Rejected(p.Failed(400, f"the prompt cannot be tokenized: {exc}", "prompt")) from None
        k = job.params.prompt_logprobs
        volume = sum(map(len, prompts)) * (1 + k) * job.n if k is not None else 0
        if volume > limits.prompt_logprobs:  # echo + logprobs: an entry per prompt token and alternative, per choice
            raise _Rejected(
                p.Failed(
                    400,
                    f"echo with logprobs: {sum(map(len, prompts))} prompt tokens x (1 + {k}) "
                    f"logprobs x n {job.n} = {volume} entries, more than the limit of "
                    f"{limits.prompt_logprobs} per request",
                    "logprobs",
                )
            )
        accepted = p.Accepted([len(ids) for ids in prompts], echo)
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
            self._cancel(handles)
            self.metrics.rejected.inc("queue_full")
            raise _Rejected(p.Failed(429, str(exc), code="queue_full")) from None
        except EngineDead as exc:  # died between engine_problem() and the submission
            self._cancel(handles)
            raise _Rejected(p.Failed(503, f"The engine cannot serve: {exc}", code="engine_failed")) from None
        except GrammarError as exc:  # the response_format's schema / regex / grammar does not compile
            self._cancel(handles)
            self.metrics.rejected.inc("invalid")
            raise _Rejected(p.Failed(400, str(exc), "response_format")) from None
        except ValueError as exc:  # PromptTooLong and other prompt problems the engine found
            self._cancel(handles)
            self.metrics.rejected.inc("invalid")
            raise _Rejected(p.Failed(400, str(exc))) from None
        return handles, accepted

    def _prompt_ids(self, spec: p.PromptSpec) -> list[int]:
        engine = self.engine
        assert engine is not None, "_submit checked it"
        tok = engine.tokenizer
        if spec.token_ids is not None:
            vocab = engine.manifest.vocab_size
            bad = next((t for t in spec.token_ids if t >= vocab), None)
            if bad is not None:
                raise _Rejected(
                    p.Failed(400, f"prompt token id {bad} is out of the vocabulary range [0, {vocab})", "prompt")
                )
            return list(spec.token_ids)
        if spec.messages is not None:
            try:
                # the template spells out BOS and friends; special-token text in content stays text. Tools go to
                # the template, or into the prompt when it has no use for them (appliance/tool_prompt.py)
                messages, kwargs = tool_prompt.chat_inputs(
                    spec.messages, spec.tools, tok.chat_template, self.parsers()[0]
                )
                ids = tok.encode_chat(messages, add_generation_prompt=True, **kwargs)
            except Exception as exc:  # no template, a broken one, or its raise_exception (roles must alternate)
                raise _Rejected(p.Failed(400, str(exc), "messages")) from None
        else:
            assert spec.text is not None, "a PromptSpec holds text, token ids or messages"
            ids = tok.encode(spec.text, add_special_tokens=True)  # as OVMS: a raw prompt gets BOS if the model has one
        if not ids:
            raise _Rejected(p.Failed(400, "prompt is empty after tokenization", "prompt"))
        return ids

    def _echo_text(self, spec: p.PromptSpec) -> str:
        if spec.text is not None:
            return spec.text
        assert self.engine is not None and spec.token_ids is not None, "_submit checked both"
        return self.engine.tokenizer.decode(spec.token_ids)

    @staticmethod
    def _cancel(handles: list) -> None:
        for _, handle, _ in handles:
            handle.cancel()

    def _stream(self, conn: Connection, handles: list) -> bool:
        send_lock = threading.Lock()
        wake_r, wake_w = os.pipe()
        state = {"open": True}

        def pump(index: int, handle, submitted: float) -> None:
            try:
                last = submitted
                for offset, chunk in handle.events():
                    last = self._observe(chunk, submitted, last)
                    if not state["open"]:
                        continue
                    event = p.ChoiceChunk(index + offset, chunk, handle.timing if chunk.finish_reason else None)
                    try:
                        with send_lock:
                            conn.send(event)
                    except OSError:
                        state["open"] = False
                        self._cancel(handles)
            finally:
                os.write(wake_w, b".")

        pumps = [threading.Thread(target=pump, args=h, name="engine-pump", daemon=True) for h in handles]
        for t in pumps:
            t.start()
        finished = 0
        watch: list[Connection | int] = [conn, wake_r]
        try:
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
                    self._cancel(handles)
            for t in pumps:
                t.join()
        finally:
            os.close(wake_r)
            os.close(wake_w)
        if state["open"]:
            conn.send(p.End())
        return state["open"]

    def _observe(self, chunk: Chunk, submitted: float, last: float) -> float:
        now = time.monotonic()
        m = self.metrics
        if chunk.token_ids:
            m.generated_tokens.inc(amount=len(chunk.token_ids))
            if chunk.completion_tokens <= len(chunk.token_ids):
                m.ttft.observe(now - submitted)
            else:
                m.itl.observe((now - last) / len(chunk.token_ids))
            last = now
        if chunk.finish_reason:
            m.sequences.inc(chunk.finish_reason)
            m.prompt_tokens.inc(amount=chunk.prompt_tokens)
            m.e2e.observe(now - submitted)
            if chunk.finish_reason == "abort" and chunk.error is None:
                m.cancelled.inc()
        return last


def _not_ready(state: str) -> p.Failed:
    if state == "stopping":
        return p.Failed(503, "The server is shutting down", code="shutting_down")
    return p.Failed(503, "The model is not ready yet (loading)", code="model_not_ready")
