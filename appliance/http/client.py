"""An HTTP worker's handle on the engine process: pooled socket connections for calls and jobs.

Thread-safe (gthread workers serve many requests at once). A connection goes back to the pool only after a
call's reply or a job's `End`; a job abandoned half-way closes its connection, which cancels it engine-side.
Nothing here waits on the engine without a bound: connecting and the handshake take at most
protocol.HANDSHAKE_SECONDS, a call's reply protocol.CALL_SECONDS (a job's events are waited for by the caller,
with its own deadline), a reload's protocol.RELOAD_SECONDS (it answers once the new models have loaded).

Several models: status and the kept ready status (serving_status) are per model name. A kept status is dropped when
a probe sees the model not ready, when a job's answer says the model is gone (404 model_not_found), or when a job
ran on a newer load of the model than the kept status describes (a reload changed its settings: the Accepted
event's serial differs), so the next request asks again.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection
from typing import ClassVar, cast

from appliance import protocol as p

POOL_SIZE = 8  # idle engine connections a worker keeps; the engine has one thread per open connection
# HTTP records sent in batches, not one round trip each: the probes (and every 401, whatever its route)
DEFERRED_ROUTES = frozenset({"/v2/health/live", "/v2/health/ready", "/v2/models/<path:name>/ready"})
DEFER_SECONDS = 0.5
ENCODE_POLL_SECONDS = 0.1  # how often a waiting embeddings request checks its client is still there
DEFERRED_KINDS = 1024  # distinct (route, method, status, type) kept between two batches


class EngineUnavailable(Exception):
    """The engine process cannot be reached (not started yet, or gone)."""


class EngineClient:
    # Tracing on (appliance/http/tracing.py): called with each job before it is sent, to give it the trace
    # context of its request's span. None when tracing is off: one attribute read per job.
    on_job: ClassVar[Callable[[p.Job], None] | None] = None

    def __init__(self, socket_path: str, authkey: bytes, max_idle: int = POOL_SIZE):
        self._address, self._authkey = socket_path, authkey
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._max_idle = max_idle
        self._ready: dict[str, p.EngineStatus] = {}  # per model: the last ready status() answer (serving_status)
        self._deferred: dict[tuple, int] = {}  # HTTP records not sent yet: (route, method, status, type) -> count
        self._flusher: threading.Thread | None = None
        self._pending = threading.Event()  # set while deferred records wait: the flusher sleeps otherwise

    # ---- connections
    def _take(self) -> Connection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._connect()

    def _connect(self) -> Connection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(p.HANDSHAKE_SECONDS)
            sock.connect(self._address)
            sock.settimeout(None)  # Connection reads the fd with blocking os.read
        except OSError as exc:
            sock.close()
            raise EngineUnavailable(f"engine unreachable: {exc}") from None
        conn = Connection(sock.detach())
        try:
            p.handshake(conn, self._authkey, server=False)
        except (OSError, EOFError, AuthenticationError) as exc:
            conn.close()
            raise EngineUnavailable(f"engine handshake failed: {exc!r}") from None
        return conn

    def _give_back(self, conn: Connection) -> None:
        with self._lock:
            if len(self._idle) < self._max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def call(self, op: str, *args, timeout: float = p.CALL_SECONDS):
        """One request, one reply within `timeout` seconds. Retries once on a fresh connection when a pooled one
        turns out stale (closed); an engine that does not answer in time is not asked again."""
        for attempt in (0, 1):
            conn = self._take()
            try:
                conn.send((op, *args))
                answered = conn.poll(timeout)
                reply: p.Reply | None = conn.recv() if answered else None
            except (OSError, EOFError) as exc:
                conn.close()
                if attempt:
                    raise EngineUnavailable(f"engine connection lost: {exc}") from None
                continue
            if reply is None:
                conn.close()  # the late reply must not be read as the answer to another call
                raise EngineUnavailable(f"the engine did not answer {op!r} within {timeout:g} s")
            self._give_back(conn)
            return reply

    # ---- typed calls
    def status(self, model: str = "") -> p.EngineStatus:
        """Asked every time, never cached: readiness reports the engine loop's heartbeat as it is now. State
        "unknown": no such model."""
        status = self.call(p.STATUS, model).value
        with self._lock:
            if status.ready:
                self._ready[model] = status
            else:
                self._ready.pop(model, None)
        return status

    def serving_status(self, model: str = "") -> p.EngineStatus:
        """What a generation or tokenize request needs (generation defaults, parsers, backend, device): the last
        ready status of the model, asked only when there is none. No round trip per request for facts that do not
        change: a job is refused engine-side (503) when the engine cannot serve, and a not-ready answer to
        status() (a probe) drops the kept one (so do forget() and JobStream, after a reload)."""
        return self._ready.get(model) or self.status(model)

    def forget(self, model: str, serial: int | None = None) -> None:
        """Drop the kept status of `model` (only if it is not of load `serial`, when given)."""
        with self._lock:
            kept = self._ready.get(model)
            if kept is not None and (serial is None or kept.serial != serial):
                del self._ready[model]

    def models(self) -> list[p.ModelInfo]:
        return self.call(p.MODELS).value

    def metrics(self) -> str:
        return self.call(p.METRICS).value

    def tokenize(self, model: str, texts: list[str]) -> p.Reply:
        return self.call(p.TOKENIZE, model, texts)

    def load(self, model: str, keep_alive: float | None) -> p.Reply:
        """Load the model now (keep_alive 0: unload it); answers once done, with its ModelInfo."""
        return self.call(p.LOAD, model, keep_alive, timeout=p.LOAD_SECONDS)

    def reload(self) -> p.Reply:
        """The engine re-reads the config file and loads / unloads models; answers when done."""
        return self.call(p.RELOAD, timeout=p.RELOAD_SECONDS)

    def record_http(self, record: p.HttpRecord) -> None:
        """A round trip, so /metrics read after a response always includes it; never fails the request. Probes
        and 401s are recorded later, in batches (`_deferred`): they need no key, so anyone can send many, and a
        liveness probe must not wait on the engine process."""
        if record.status == 401 or record.route in DEFERRED_ROUTES:
            return self._defer(record)
        try:
            self.call(p.RECORD_HTTP, record)
        except EngineUnavailable:
            pass

    def _defer(self, record: p.HttpRecord) -> None:
        key = (record.route, record.method, record.status, record.error_type)
        with self._lock:
            if key not in self._deferred and len(self._deferred) >= DEFERRED_KINDS:
                return  # cannot happen with the bounded labels; a bound all the same
            self._deferred[key] = self._deferred.get(key, 0) + 1
            self._pending.set()
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_deferred, name="http-records", daemon=True)
                self._flusher.start()

    def _flush_deferred(self) -> None:
        """DEFER_SECONDS after a record is deferred, one call for all deferred records: the same record object
        repeated (pickled once). Asleep while none waits: a timer beside the engine's threads costs a wakeup on a
        busy core (measured by bench.http_breakdown: 2 a second, whether or not anything was deferred)."""
        while True:
            self._pending.wait()
            time.sleep(DEFER_SECONDS)
            with self._lock:
                batch, self._deferred = self._deferred, {}
                self._pending.clear()
            if not batch:
                continue
            records = []
            for (route, method, status, error_type), count in batch.items():
                records += [p.HttpRecord(route, method, status, 0.0, error_type)] * count
            try:
                self.call(p.RECORD_HTTP, *records)
            except EngineUnavailable:
                pass

    def encode(
        self, job: p.EncodeJob, timeout: float | None, client_gone: Callable[[], bool] = lambda: False
    ) -> p.Encoded | p.Failed | None:
        """An embeddings / rerank request (one answer). None when `client_gone()` turned true or `timeout` seconds
        passed first: the connection is closed, which drops the request's waiting inputs engine-side."""
        conn = self._send((p.ENCODE, job))
        deadline = time.monotonic() + timeout if timeout else None
        reader = p.EventReader(conn)  # one poll object and one read for the answer (its docstring)
        try:
            while not reader.poll(ENCODE_POLL_SECONDS):
                if client_gone() or (deadline is not None and time.monotonic() > deadline):
                    conn.close()
                    return None
            reply = cast(p.Encoded | p.Failed, reader.recv())
        except (OSError, EOFError):
            conn.close()
            raise EngineUnavailable("engine connection lost during a request") from None
        if reader.buffer:  # more than the one answer: this connection cannot serve another
            conn.close()
        else:
            self._give_back(conn)
        if isinstance(reply, p.Failed) and reply.code == "model_not_found":
            self.forget(job.model)
        return reply

    def open_job(self, job: p.Job) -> JobStream:
        hook = EngineClient.on_job  # from the class: a function stored there is not bound to self
        if hook is not None:
            hook(job)
        return JobStream(self, self._send((p.JOB, job)), job.model)

    def _send(self, message: tuple) -> Connection:
        """A pooled connection with `message` sent on it, for a request whose answer comes later on it."""
        conn = self._take()
        try:
            conn.send(message)
        except OSError:
            conn.close()
            conn = self._take()  # a stale pooled connection: one retry on a fresh one
            try:
                conn.send(message)
            except OSError as exc:
                conn.close()
                raise EngineUnavailable(f"engine connection lost: {exc}") from None
        return conn


class JobStream:
    """The events of one job. `close()` before `End` cancels the job (the engine sees the socket close). Read
    through protocol.EventReader (one poll object and one read per event, not a selector and two reads); the
    connection goes back to the pool at `End` only with nothing buffered past it."""

    def __init__(self, client: EngineClient, conn: Connection, model: str = ""):
        self._client = client
        self._conn: Connection | None = conn  # None once ended or closed
        self._reader = p.EventReader(conn)
        self._model = model
        self.ended = False

    def next(self, timeout: float | None):
        """The next event, or None if `timeout` seconds passed without one."""
        conn = self._conn
        assert conn is not None, "next() after the job ended or was closed"
        try:
            if timeout is not None and not self._reader.poll(timeout):
                return None
            event = self._reader.recv()
        except (OSError, EOFError):
            self.close()
            raise EngineUnavailable("engine connection lost during a request") from None
        if isinstance(event, p.Accepted):
            self._client.forget(self._model, event.serial)  # a reload replaced the model the kept status describes
        elif isinstance(event, p.Failed) and event.code == "model_not_found":
            self._client.forget(self._model)  # a reload removed it
        elif isinstance(event, p.End):
            self.ended = True
            self._conn = None
            if self._reader.buffer:  # more than the job's events: this connection cannot serve another
                conn.close()
            else:
                self._client._give_back(conn)
        return event

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
