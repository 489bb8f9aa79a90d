"""The engine process's side of the socket: owns the served models' Engines, tokenizes, submits jobs, streams
chunks back.

One thread per worker connection. A job's sequences are each drained by a pump thread that forwards chunks as
the engine produces them; the connection's thread meanwhile watches the socket, and when the worker closes it
(its client went away, or the request timed out) every sequence of the job is cancelled at once.

Several models: one `Slot` per served model (its ModelSpec, Engine, state, parsers), in config order. A job, a
status or a tokenize call names its model (`""`: the first one, for single-model callers); an unknown name is a
404. A reload (the supervisor's `reloader`) swaps slots in and out: a removed or replaced slot stops taking jobs at
once and its engine is shut down once its in-flight jobs end (or after graceful_timeout). Each slot has a serial,
new per load, that workers compare to drop a status they kept for a replaced model (client.py).

Liveness: the accept loop only accepts; the HMAC handshake runs in the connection's own thread with a timeout, so
a worker killed mid-handshake, a stalled peer or a wrong key costs that connection alone and never ends or
blocks accepting. `status()` is computed on every call from the engine loop's heartbeat: a dead engine thread or
one stuck in a step for ENGINE_STALL_SECONDS (slots.py) reads as not ready (the supervisor exits on a dead one).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
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
from appliance.server.settings import ModelSpec, ServeSettings
from appliance.server.slots import Slot, model_not_found, single_spec

if TYPE_CHECKING:
    from appliance.engine import Engine

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 128  # workers x their pools reconnecting at once after a restart
ACCEPT_BACKOFF_SECONDS = 0.05
RETIRE_POLL_SECONDS = 0.1  # a retiring model's in-flight jobs are checked this often


class _Rejected(Exception):
    def __init__(self, failed: p.Failed):
        super().__init__(failed.message)
        self.failed = failed


class EngineService:
    def __init__(self, settings: ServeSettings, metrics: ServerMetrics):
        self.settings = settings
        self.metrics = metrics
        self._serials = itertools.count(1)
        self._slots: dict[str, Slot] = {}  # the served models, in config order; guarded by _lock
        self._retiring: list[Slot] = []  # removed or replaced, draining their jobs before shutdown
        self._lock = threading.Lock()
        for spec in settings.models or [single_spec(settings)]:
            self._slots[spec.name] = self._new_slot(spec)
        self.stopping = False
        # the supervisor's reload (POST /v1/config/reload): a Reply with (changed, [ModelInfo]) or a Failed
        self.reloader: Callable[[], p.Reply] | None = None
        self._listener: Listener | None = None
        self._authkey = b""
        self._faults = os.environ.get(p.FAULT_INJECTION_ENV) == "1"

    def _new_slot(self, spec: ModelSpec) -> Slot:
        return Slot(spec, next(self._serials))

    # ---- lifecycle (supervisor thread)
    def start(self) -> None:
        """Listen before the models load, so workers can answer 503 "loading" instead of failing to connect.
        No authkey on the Listener: its accept() would run the handshake in the accept thread (see _serve)."""
        self._authkey = self.settings.authkey()
        self._listener = Listener(self.settings.socket_path, "AF_UNIX", backlog=LISTEN_BACKLOG)
        os.chmod(self.settings.socket_path, 0o600)
        threading.Thread(target=self._accept_loop, name="engine-accept", daemon=True).start()

    def attach(self, engine: Engine, device: str, name: str = "", spec: ModelSpec | None = None) -> None:
        """`engine` serves model `name` (the first one by default) from now on. With a `spec` (a reload), a
        fresh slot takes the name: a slot it replaces retires (its jobs finish on the old engine)."""
        with self._lock:
            old = self._find(name)
            if spec is None:
                assert old is not None, f"attach to an unknown model {name!r}"
                slot = old
            else:
                slot = self._new_slot(spec)
                self._slots[spec.name] = slot
            slot.engine, slot.device, slot.state, slot.error = engine, device, "ready", None
        if old is not None and old is not slot:
            self._retire(old)

    def add(self, spec: ModelSpec) -> None:
        """A model a reload adds: listed as loading until attach() or fail()."""
        with self._lock:
            if spec.name not in self._slots:
                self._slots[spec.name] = self._new_slot(spec)

    def fail(self, message: str, name: str | None = None) -> None:
        """Model `name` (every model when None) cannot serve; a model serving an older spec keeps serving."""
        with self._lock:
            for slot in self._slots.values():
                if name is None or slot.spec.name == name:
                    if name is not None and slot.state == "ready" and slot.engine is not None:
                        slot.error = f"the reload failed, the previous settings serve: {message}"
                    else:
                        slot.state, slot.error = "failed", message

    def remove(self, names: list[str]) -> None:
        """Stop routing to these models at once; their engines stop once their jobs end."""
        with self._lock:
            gone = [self._slots.pop(n) for n in names if n in self._slots]
        for slot in gone:
            self._retire(slot)

    def order(self, names: list[str]) -> None:
        """List the models in this order (the config file's)."""
        with self._lock:
            self._slots = {n: self._slots[n] for n in names if n in self._slots} | self._slots

    def specs(self) -> dict[str, tuple[ModelSpec, str]]:
        """name -> (spec, state) of every configured model."""
        with self._lock:
            return {n: (s.spec, s.state) for n, s in self._slots.items()}

    def _retire(self, slot: Slot) -> None:
        slot.state = "stopping"
        with self._lock:
            self._retiring.append(slot)
        threading.Thread(target=self._drain, args=(slot,), name="engine-retire", daemon=True).start()

    def _drain(self, slot: Slot) -> None:
        deadline = time.monotonic() + self.settings.graceful_timeout
        while slot.jobs and time.monotonic() < deadline and not self.stopping:
            time.sleep(RETIRE_POLL_SECONDS)
        with self._lock:
            if slot not in self._retiring:  # stop() took it
                return
            self._retiring.remove(slot)
        if slot.engine is None:  # a model that never loaded
            return
        slot.engine.on_death = None  # a retired engine's end is no death
        slot.engine.shutdown()
        log.info("model unloaded", extra={"model": slot.spec.name, "jobs_cut": slot.jobs})

    def stop(self) -> list[Engine]:
        """No more connections or jobs; the engines the caller shuts down (every model's, retiring ones too)."""
        self.stopping = True
        with self._lock:
            slots = [*self._slots.values(), *self._retiring]
            self._retiring = []
            for slot in self._slots.values():
                slot.state = "stopping"
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass
        return [s.engine for s in slots if s.engine is not None]

    def _find(self, name: str) -> Slot | None:
        """Model `name`'s slot ("": the first model), or None. Callers hold _lock or accept a racy read."""
        if not name:
            return next(iter(self._slots.values()), None)
        return self._slots.get(name)

    def slot(self, name: str) -> Slot:
        with self._lock:
            slot = self._find(name)
        if slot is None:
            raise _Rejected(model_not_found(name))
        return slot

    def parsers(self, name: str = "") -> tuple[str, str]:
        return self.slot(name).parsers()

    def healthy(self) -> bool:
        """For the watchdog: not stopping, nothing failed that should serve, and every engine alive and
        advancing (a model whose reload failed has no engine: it does not make the process unhealthy)."""
        with self._lock:
            slots = list(self._slots.values())
        return not self.stopping and all(
            s.state != "failed" and s.problem() is None for s in slots if s.engine is not None
        )

    def engine_problem(self, name: str = "") -> str | None:
        with self._lock:
            slot = self._find(name)
        return slot.problem() if slot is not None else None

    def models(self) -> list[p.ModelInfo]:
        with self._lock:
            slots = list(self._slots.values())
        infos = [s.info() for s in slots]
        return [replace(i, state="stopping") for i in infos] if self.stopping else infos

    # ---- connections
    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None, "start() opens the listener before this thread runs"
        while not self.stopping:
            try:
                conn = listener.accept()
                threading.Thread(target=self._serve, args=(conn,), name="engine-conn", daemon=True).start()
            except Exception:  # OSError (EMFILE, ...), RuntimeError (no thread): this loop must outlive it
                if self.stopping:
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
                        try:
                            reply = self._call(op, args)
                        except _Rejected as exc:
                            reply = p.Reply(error=exc.failed)
                        conn.send(reply)
                except (EOFError, OSError):
                    return
                except Exception:  # a bug here must not take the engine process down; the worker sees EOF
                    log.exception("engine service: %s failed", op)
                    return

    def _call(self, op: str, args: list) -> p.Reply:
        if op == p.STATUS:
            return p.Reply(self.status(*args))
        if op == p.MODELS:
            return p.Reply(self.models())
        if op == p.FAULT and self._faults:
            engine = self.slot(args[1] if len(args) > 1 else "").engine
            if engine is not None:
                engine.inject_fault(args[0])
            return p.Reply()
        if op == p.RECORD_HTTP:
            r: p.HttpRecord = args[0]
            self.metrics.record_http(r.route, r.method, r.status, r.error_type)
            return p.Reply()
        if op == p.METRICS:
            with self._lock:
                slots = list(self._slots.values())
            per_model = {
                s.spec.name: (s.live_state()[0] == "ready", s.engine.stats() if s.engine else None) for s in slots
            }
            return p.Reply(self.metrics.render(per_model))
        if op == p.TOKENIZE:
            name, texts = args
            slot = self.slot(name)
            if slot.engine is None or slot.state != "ready":
                return p.Reply(error=_not_ready(slot.state))
            return p.Reply([slot.engine.tokenizer.encode(text, add_special_tokens=True) for text in texts])
        if op == p.RELOAD:
            if self.reloader is None:
                return p.Reply(error=p.Failed(400, "no config file: start the server with --config to reload it"))
            return self.reloader()
        return p.Reply(error=p.Failed(500, f"unknown engine call {op!r}"))

    def status(self, name: str = "") -> p.EngineStatus:
        with self._lock:
            slot = self._find(name)
        if slot is None:
            return p.EngineStatus("unknown", model_not_found(name).message)
        state, error = slot.live_state()
        if self.stopping:
            state = "stopping"
        e = slot.engine
        if e is None:
            return p.EngineStatus(state, error, serial=slot.serial)
        return p.EngineStatus(
            state,
            error,
            e.max_context,
            e.manifest.vocab_size,
            e.generation_defaults,
            e.manifest.backend,
            e.manifest.weight_format,
            slot.device,
            *slot.parsers(),
            serial=slot.serial,
        )

    # ---- jobs
    def _run_job(self, conn: Connection, job: p.Job) -> bool:
        """Streams the job's events. False when the worker closed the connection (the job was cancelled)."""
        with self._lock:
            slot = self._find(job.model)
            if slot is not None:
                slot.jobs += 1
        if slot is None:
            conn.send(model_not_found(job.model))
            conn.send(p.End())
            return True
        try:
            return self._run_on(conn, job, slot)
        finally:
            with self._lock:
                slot.jobs -= 1

    def _run_on(self, conn: Connection, job: p.Job, slot: Slot) -> bool:
        if problem := slot.problem():
            conn.send(p.Failed(503, f"The engine cannot serve: {problem}", code="engine_failed"))
            conn.send(p.End())
            return True
        try:
            handles, accepted = self._submit(job, slot)
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

    def _submit(self, job: p.Job, slot: Slot | None = None) -> tuple[list, p.Accepted]:
        slot = slot or self.slot(job.model)
        engine = slot.engine
        if engine is None or slot.state != "ready":
            raise _Rejected(_not_ready("stopping" if self.stopping else slot.state))
        vocab, limits = engine.manifest.vocab_size, self.settings.limits
        bad = next((t for t in job.params.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise _Rejected(
                p.Failed(400, f"stop token id {bad} is out of the vocabulary range [0, {vocab})", "stop_token_ids")
            )
        try:
            prompts = [self._prompt_ids(spec, slot) for spec in job.prompts]
            echo = [self._echo_text(spec, engine) for spec in job.prompts] if job.echo else None
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

    @staticmethod
    def _prompt_ids(spec: p.PromptSpec, slot: Slot) -> list[int]:
        engine = slot.engine
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
                    spec.messages, spec.tools, tok.chat_template, slot.parsers()[0]
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

    @staticmethod
    def _echo_text(spec: p.PromptSpec, engine: Engine) -> str:
        if spec.text is not None:
            return spec.text
        assert spec.token_ids is not None, "a PromptSpec holds text, token ids or messages"
        return engine.tokenizer.decode(spec.token_ids)

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
    if state == "failed":
        return p.Failed(503, "The model cannot serve: it failed to load", code="model_failed")
    return p.Failed(503, "The model is not ready yet (loading)", code="model_not_ready")
