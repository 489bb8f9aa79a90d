"""The engine process's side of the socket: the listener, one thread per worker connection, and the calls a
worker makes (status, models, metrics, tokenize, reload). The served models are `Models` (slots.py); a job goes to
the `JobRunner` (jobs.py), which streams its chunks back on the connection's thread.

Liveness: the accept loop only accepts; the HMAC handshake runs in the connection's own thread with a timeout, so
a worker killed mid-handshake, a stalled peer or a wrong key costs that connection alone and never ends or
blocks accepting. `status()` is computed on every call from the engine loop's heartbeat: a dead engine thread or
one stuck in a step for ENGINE_STALL_SECONDS (slots.py) reads as not ready (the supervisor exits on a dead one).

Load on demand: a job (every client API's) for a model the residency policy unloaded asks `loader` (the
supervisor's, which loads on its own thread) and waits on its connection's thread, so the engine loops never wait
on a load; LOAD (Ollama's empty request) does the same, or with keep_alive 0 unloads.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener
from typing import TYPE_CHECKING

from appliance import protocol as p
from appliance.runtime.tokenizer import TextTooLong
from appliance.server.encoders.embeddings import EncoderService, run_encode
from appliance.server.jobs import JobRunner
from appliance.server.metrics import ServerMetrics
from appliance.server.slots import Models, Rejected, Slot, model_not_found, not_ready, single_spec
from appliance.settings import ModelSpec, ServeSettings

if TYPE_CHECKING:
    from appliance.runtime.engine import Engine

log = logging.getLogger(__name__)

# a call no one registered (EngineService.calls): a service without a supervisor (tests, bench)
NOT_SERVED = {
    p.LOAD: p.Failed(500, "this server cannot load models on demand"),
    p.RELOAD: p.Failed(400, "no config file: start the server with --config to reload it"),
}
# METRICS waits at most this long for the HTTP records sent before it (a record is counted microseconds after its
# thread wakes; a loaded box delays the wake by milliseconds, a 2-core box running a test suite beside the server
# by up to a few hundred, and once, in a full CI run on a 2-vCPU VM, past 1 s). It waits only while a record is
# pending (unread on a listened connection, being read, or being counted): a scrape with none pays nothing. A thread
# is "reading" from the moment its socket turns readable until its message is taken apart, so the moment between
# the bytes leaving the socket and the record being counted is covered too (a full CI run hit that gap). A thread that
# has not woken for the bound is wedged, not slow, and a worker that stops mid-message (it is authenticated: ours)
# holds a scrape no longer than that.
SETTLE_SECONDS = 5.0
SETTLE_POLL_SECONDS = 0.001
LISTEN_BACKLOG = 128  # workers x their pools reconnecting at once after a restart
ACCEPT_BACKOFF_SECONDS = 0.05


class EngineService:
    def __init__(self, settings: ServeSettings, metrics: ServerMetrics):
        self.settings = settings
        self.metrics = metrics
        self.registry = Models(
            settings.models or [single_spec(settings)], settings.graceful_timeout, settings.keep_alive
        )
        self.jobs = JobRunner(self.registry, metrics, settings.limits)
        # the calls the supervisor answers, by op name, each (*args) -> Reply (or Rejected): RELOAD, LOAD and the
        # pulled models' SERVE_PULLED and DELETE_PULLED; until it registers them, `NOT_SERVED`'s answers
        self.calls: dict[str, Callable[..., p.Reply]] = {}
        self._listener: Listener | None = None
        # connection threads waiting for their next message, those reading one, and HTTP records being counted:
        # what METRICS waits for (_settle)
        self._listening: set[Connection] = set()
        self._reading = 0
        self._recording = 0
        self._conns_lock = threading.Lock()
        self._authkey = b""
        self._faults = os.environ.get(p.FAULT_INJECTION_ENV) == "1"

    # ---- lifecycle (supervisor thread)
    def start(self) -> None:
        """Listen before the models load, so workers can answer 503 "loading" instead of failing to connect.
        No authkey on the Listener: its accept() would run the handshake in the accept thread (see _serve)."""
        self._authkey = self.settings.authkey()
        self._listener = Listener(self.settings.socket_path, "AF_UNIX", backlog=LISTEN_BACKLOG)
        os.chmod(self.settings.socket_path, 0o600)
        threading.Thread(target=self._accept_loop, name="engine-accept", daemon=True).start()

    def stop(self) -> list[Engine]:
        """No more connections or jobs; the engines the caller shuts down (every model's, retiring ones too)."""
        engines = self.registry.stop()
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass
        return engines

    @property
    def stopping(self) -> bool:
        return self.registry.stopping

    # the supervisor's view of the models (Models in slots.py does the work)
    def attach(self, engine: Engine, device: str, name: str = "", spec: ModelSpec | None = None) -> None:
        self.registry.attach(engine, device, name, spec)

    def unload(self, name: str) -> Engine | None:
        """Detach model `name`'s engine if it is idle (Models.unload; the caller shuts it down), first keeping what
        its status says (its facts: what the slot answers status with while unloaded; the same for every load of
        these settings)."""
        slot = self.registry.find(name)
        if slot is None or slot.engine is None:
            return None
        if slot.facts is None:
            slot.facts = self._engine_status(slot, "ready", None)
        return self.registry.unload(name)

    def add(self, spec: ModelSpec) -> None:
        self.registry.add(spec)

    def fail(self, message: str, name: str | None = None) -> None:
        self.registry.fail(message, name)

    def remove(self, names: list[str]) -> None:
        self.registry.remove(names)

    def order(self, names: list[str]) -> None:
        self.registry.order(names)

    def specs(self) -> dict[str, tuple[ModelSpec, str]]:
        return self.registry.specs()

    def healthy(self) -> bool:
        return self.registry.healthy()

    def models(self) -> list[p.ModelInfo]:
        return self.registry.infos()

    def parsers(self, name: str = "") -> tuple[str, str]:
        return self.registry.slot(name).parsers()

    # ---- connections
    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None, "start() opens the listener before this thread runs"
        while not self.stopping:
            try:
                conn = listener.accept()
                with self._conns_lock:  # listened to from its accept on: a record may follow the handshake at once
                    self._listening.add(conn)
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
                with self._conns_lock:
                    self._listening.discard(conn)
                log.warning("engine socket: handshake failed", extra={"error": repr(exc)})
                return
            while True:
                with self._conns_lock:
                    self._listening.add(conn)
                try:  # readable: the next message's bytes sit on the socket, where _settle sees them
                    conn.poll(None)
                except (EOFError, OSError):
                    pass
                with self._conns_lock:  # never neither listening nor reading: _settle sees every record
                    self._listening.discard(conn)
                    self._reading += 1
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    message = None
                with self._conns_lock:  # never neither reading nor counted
                    self._reading -= 1
                    recording = message is not None and message[0] == p.RECORD_HTTP
                    self._recording += recording
                if message is None:
                    return
                op, *args = message
                try:
                    if op == p.JOB:
                        if not self.jobs.run(conn, args[0]):
                            return
                    elif op == p.ENCODE:  # embeddings / rerank: appliance/server/encoders/embeddings.py
                        if not run_encode(
                            self.registry, conn, args[0], self.settings.limits, self.metrics, self.jobs.ensure
                        ):
                            return
                    else:
                        try:
                            reply = self._call(op, args)
                        except Rejected as exc:
                            reply = p.Reply(error=exc.failed)
                        conn.send(reply)
                except (EOFError, OSError):
                    return
                except Exception:  # a bug here must not take the engine process down; the worker sees EOF
                    log.exception("engine service: %s failed", op)
                    return
                finally:
                    if recording:
                        with self._conns_lock:
                            self._recording -= 1

    def _settle(self) -> None:
        """Before METRICS answers: every HTTP record a worker sent before asking is counted. Workers do not wait
        for a record's reply (http/client.py record_http), so one may still sit unread on another connection, or be
        in its thread's hands: wait while one does, at most SETTLE_SECONDS."""
        deadline = time.monotonic() + SETTLE_SECONDS
        while True:
            with self._conns_lock:
                busy = self._reading + self._recording > 0
                fds = [c.fileno() for c in self._listening if not c.closed]
            if not busy:
                waiting = select.poll()
                for fd in fds:
                    waiting.register(fd, select.POLLIN)
                if not waiting.poll(0):  # (a closed peer reads as ready too: its thread is about to leave)
                    return
            if time.monotonic() >= deadline:
                return
            time.sleep(SETTLE_POLL_SECONDS)

    def _call(self, op: str, args: list) -> p.Reply:
        if op == p.STATUS:
            return p.Reply(self.status(*args))
        if op == p.MODELS:
            return p.Reply(self.models())
        if op == p.FAULT and self._faults:
            engine = self.registry.slot(args[1] if len(args) > 1 else "").engine
            if engine is not None:
                engine.inject_fault(args[0])
            return p.Reply()
        if op == p.RECORD_HTTP:  # one record, or a worker's batch of them
            for r in args:
                self.metrics.record_http(r.route, r.method, r.status, r.error_type)
            return p.Reply()
        if op == p.METRICS:
            self._settle()
            slots = self.registry.all()
            per_model = {
                s.spec.name: (s.live_state()[0] == "ready", s.engine.stats() if s.engine else None) for s in slots
            }
            return p.Reply(self.metrics.render(per_model))
        if op == p.TOKENIZE:  # an unloaded model tokenizes with the tokenizer it kept: no load for this
            name, texts = args
            slot = self.registry.slot(name)
            engine, facts = slot.engine, slot.facts  # a loaded model answers from its engine, an unloaded from facts
            if slot.tokenizer is None or (engine is None and facts is None) or slot.state != "ready":
                return p.Reply(error=not_ready(slot.state))
            if isinstance(engine, EncoderService):  # an encoder's own ids ([CLS] ... [SEP])
                return p.Reply([list(ids) for ids in engine.encoder.tokenize(list(texts))])
            if engine is None and facts is not None and facts.task != "generate":  # an unloaded encoder
                return p.Reply(error=not_ready("unloaded"))
            limit = engine.max_context if engine is not None else facts.max_context if facts is not None else 0
            ids = tokenize(slot.tokenizer, limit, texts)
            return p.Reply(error=ids) if isinstance(ids, p.Failed) else p.Reply(ids)
        call = self.calls.get(op)
        if call is not None:
            return call(*args)
        return p.Reply(error=NOT_SERVED.get(op) or p.Failed(500, f"unknown engine call {op!r}"))

    def status(self, name: str = "") -> p.EngineStatus:
        slot = self.registry.find(name)
        if slot is None:
            return p.EngineStatus("unknown", model_not_found(name).message)
        state, error = slot.live_state()
        if self.stopping:
            state = "stopping"
        if slot.engine is None:
            if slot.facts is not None and state == "ready":  # unloaded: its next job loads it
                return replace(slot.facts, error=error)
            return p.EngineStatus(state, error, serial=slot.serial)
        return self._engine_status(slot, state, error)

    @staticmethod
    def _engine_status(slot: Slot, state: str, error: str | None) -> p.EngineStatus:
        e = slot.engine
        assert e is not None, "a loaded slot"
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
            task=getattr(e, "task", "generate"),
            dimensions=getattr(e, "dimensions", 0),
            normalized=getattr(e, "normalized", False),
        )


def tokenize(tok, limit: int, texts: list[str]) -> list[list[int]] | p.Failed:
    """/tokenize's ids, as a prompt is tokenized (BOS included): without holding the GIL, and refused (400) before
    anything is encoded when the texts together cannot fit the model's context (a text that could not be a prompt;
    and a list is bounded as one prompt is, since an encoding costs ~150 bytes a token while it is built: 7 texts
    of 600,000 digits took 9 s and 857 MB, one 120 MB)."""
    try:
        tok.check_length(texts[0] if len(texts) == 1 else "".join(texts), limit)  # together, as one prompt
    except TextTooLong as exc:
        where = "the prompts together" if len(texts) > 1 else "the prompt"
        return p.Failed(400, f"{where} cannot fit the model max length: {limit}: {exc}", "prompt")
    return tok.encode_many(texts, add_special_tokens=True)
