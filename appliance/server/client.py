"""An HTTP worker's handle on the engine process: pooled socket connections for calls and jobs.

Thread-safe (gthread workers serve many requests at once). A connection goes back to the pool only after a
call's reply or a job's `End`; a job abandoned half-way closes its connection, which cancels it engine-side.
"""
from __future__ import annotations

import threading
from multiprocessing.connection import Client, Connection

from appliance.server import protocol as p


POOL_SIZE = 8   # idle engine connections a worker keeps; the engine has one thread per open connection


class EngineUnavailable(Exception):
    """The engine process cannot be reached (not started yet, or gone)."""


class EngineClient:
    def __init__(self, socket_path: str, authkey: bytes, max_idle: int = POOL_SIZE):
        self._address, self._authkey = socket_path, authkey
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._max_idle = max_idle
        self._ready_status: p.EngineStatus | None = None

    # ---- connections
    def _take(self) -> Connection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        try:
            return Client(self._address, "AF_UNIX", authkey=self._authkey)
        except (OSError, EOFError) as exc:
            raise EngineUnavailable(f"engine unreachable: {exc}") from None

    def _give_back(self, conn: Connection) -> None:
        with self._lock:
            if len(self._idle) < self._max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def call(self, op: str, *args):
        """One request, one reply. Retries once on a fresh connection: a pooled one may have gone stale."""
        for attempt in (0, 1):
            conn = self._take()
            try:
                conn.send((op, *args))
                reply: p.Reply = conn.recv()
            except (OSError, EOFError) as exc:
                conn.close()
                if attempt:
                    raise EngineUnavailable(f"engine connection lost: {exc}") from None
                continue
            self._give_back(conn)
            return reply

    # ---- typed calls
    def status(self) -> p.EngineStatus:
        """Cached once ready: readiness does not go back (shutdown ends the workers first)."""
        if self._ready_status is not None:
            return self._ready_status
        status = self.call(p.STATUS).value
        if status.ready:
            self._ready_status = status
        return status

    def metrics(self) -> str:
        return self.call(p.METRICS).value

    def tokenize(self, texts: list[str]) -> p.Reply:
        return self.call(p.TOKENIZE, texts)

    def record_http(self, record: p.HttpRecord) -> None:
        """A round trip, so /metrics read after a response always includes it; never fails the request."""
        try:
            self.call(p.RECORD_HTTP, record)
        except EngineUnavailable:
            pass

    def open_job(self, job: p.Job) -> "JobStream":
        conn = self._take()
        try:
            conn.send((p.JOB, job))
        except OSError:
            conn.close()
            conn = self._take()   # a stale pooled connection: one retry on a fresh one
            try:
                conn.send((p.JOB, job))
            except OSError as exc:
                conn.close()
                raise EngineUnavailable(f"engine connection lost: {exc}") from None
        return JobStream(self, conn)


class JobStream:
    """The events of one job. `close()` before `End` cancels the job (the engine sees the socket close)."""

    def __init__(self, client: EngineClient, conn: Connection):
        self._client, self._conn = client, conn
        self.ended = False

    def next(self, timeout: float | None):
        """The next event, or None if `timeout` seconds passed without one."""
        if timeout is not None and not self._conn.poll(max(timeout, 0.0)):
            return None
        try:
            event = self._conn.recv()
        except (OSError, EOFError):
            self.close()
            raise EngineUnavailable("engine connection lost during a request") from None
        if isinstance(event, p.End):
            self.ended = True
            self._client._give_back(self._conn)
            self._conn = None
        return event

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
