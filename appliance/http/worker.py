"""The gunicorn worker class of `appliance serve`: gthread, with edge timeouts so slow or stalled clients cannot
take the threads that run generations (`worker_class = "appliance.http.worker.EdgeWorker"` in gunicorn_conf).

Why a worker class and not gunicorn settings: gunicorn 27's gthread worker hands a connection to a thread as soon
as its first byte arrives (it only defers connections that send nothing for 5 s), and the thread then reads the
request head and body with blocking `recv`s and no deadline. A client that sends half a header and trickles a
byte a second holds that thread forever; `--threads` such clients and the worker answers nothing, health probes
included. A streaming response written to a client that stopped reading blocks in `sendall` forever too, and the
generation behind it keeps its KV blocks. gunicorn has no setting for either.

What this class changes, all in gthread's own event loop (`enqueue_req` is the one door every connection goes
through: new, kept-alive, or with pipelined bytes left in its parser):

* **Requests are read without a thread.** The head, and a body framed by Content-Length or chunked encoding up
  to `max_body_bytes`, are read with non-blocking `recv`s in the event loop. Only a complete request is handed to
  a thread; its bytes are given back to gunicorn's parser (`unreader.unread`), which parses them as if it had read
  them itself. A request not complete `request_timeout` seconds after its connection opened (or, on a kept-alive
  connection, after its first byte) is closed without ever touching a thread. `Expect: 100-continue` is answered
  here and its body read here too. Requests the parser must see early (a body over the limit, framing we cannot
  follow, other expectations) are handed over at the end of their head; the thread's reads of them stay under
  the same deadline, in total (`RequestDeadline`), gunicorn's drain of an unread body after the response too.
* **Buffered bytes are bounded per worker and per client** (edge.read_budget, edge_policy.client_budget). Past
  either, the largest unfinished requests are closed with 503 (edge_policy.pick_victims), never a small
  newcomer: probes and small requests are not refused because of others' bodies. One client address may hold
  only so many connections (--client-max-connections), and, if the operator sets it, run so many generations at
  once per address and per API key (--client-max-generations, 429 past it). A worker about to reach
  `worker_connections` (where gthread stops accepting) closes its oldest idle or unfinished connection first.
* **Probes have their own threads.** The path is known before dispatch, so `/v2/health/*`, `/v2/models/*/ready`
  and `/metrics` go to a small separate pool (`PROBE_THREADS`): they answer while every generation thread is busy.
* **Sends are bounded.** A request's socket gets a `send_timeout` timeout; Python's `sendall` with a timeout
  bounds the whole call, and the time all writes of one response wait on its client is bounded too
  (edge_policy.PacedBody: `send_timeout` plus one second per 64 KiB sent), so a client that reads a little
  before each write would time out is cut off like one that stopped. When it fires, gunicorn closes the response
  iterator (for a stream: the SSE generator, which closes the job and so cancels its sequences engine-side,
  freeing their KV), the thread is free again and the connection is reset. Streaming responses also get a small
  send buffer (`streaming.bound_send_buffer`), so a client that stopped reading is noticed after a bounded amount
  of data, not after the kernel's autotuned megabytes.
* **Closing never blocks the loop.** gunicorn closes a non-kept-alive connection gracefully (FIN, then read until
  the peer closes, up to 2 s) on the event-loop thread: a peer that never closes stalls every connection of the
  worker. Here the lingering read is non-blocking, in the loop, with the same bounds.

* **TLS handshakes too** (--tls-certfile). gunicorn wraps the socket in the thread and handshakes with a blocking
  socket and no timeout: a client that opens a connection and sends part of a ClientHello (or nothing, after the
  first byte) holds a thread forever. Here the handshake is non-blocking in the event loop, under the same
  `request_timeout` as the request it precedes (one deadline from the connection's start), and the request is
  then read as above, decrypted. A plain-HTTP request to the TLS port is answered 400 in clear text ("use
  https://") and closed. One SSL context per worker (gunicorn builds one per connection, reloading the key).
  Python's `SSLSocket.sendall` applies a timeout to each record written, not to the whole call: a stream (an
  event per record) is bounded in total by PacedBody as on plain sockets, a large unary body per record only.

* **Drops are visible.** Each shed, timeout or cap is a warning in the log (structured, rate-limited per reason,
  the reason and the client address only) and counts in `appliance_http_dropped_total{reason}` (reported to the
  engine process once a second by a thread, never from the loop).

The rules (what is read, when a request is complete, budgets, deadlines, whom to shed) are in appliance/http/edge.py
and edge_policy.py, with no gunicorn in them; this module is only the socket I/O and the wiring into gthread's
loop. It overrides gunicorn internals (pinned exactly, gunicorn 27.0.1 in pyproject.toml): each override says which
gunicorn behaviour it replaces, and tests/http/test_gunicorn_contract.py lists every internal used here and fails,
naming it, when an upgrade moves one.

The heartbeat: gthread touches its heartbeat file (a `utime` syscall, 2 us) on every pass of its loop, 3-4 per
request; here at most once a second (`notify`), which the arbiter's 60 s `timeout` never notices. (Sending a small
response's head and body in one `sendall` instead of gunicorn's two was measured and left: the same worker CPU,
in process and served, bench/http_cost.py and docs/performance.md.)

Idle kept-alive connections stay in gunicorn's poller, without a thread, for `keepalive` seconds. Connections per
worker stay bounded by `worker_connections` (the loop stops accepting there). HTTP/2 (prior knowledge, h2c, ALPN)
is not used by the appliance; if configured, connections take gunicorn's own path.
"""

from __future__ import annotations

import errno
import selectors
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from concurrent import futures
from functools import partial
from typing import Any

from gunicorn import http
from gunicorn import sock as gsock
from gunicorn.http2 import negotiation
from gunicorn.workers.gthread import STOP_KEEPALIVE_LINGER, TConn, ThreadWorker

from appliance.http import edge, edge_policy, tracing
from appliance.http.client import EngineClient, EngineUnavailable
from appliance.protocol import DROPPED_ROUTE, RECORD_HTTP, HttpRecord
from appliance.settings import ServeSettings

PROBE_THREADS = 4  # per worker: health probes and /metrics, apart from the generation threads
READ_CHUNK = 64 * 1024
REPORT_SECONDS = 1.0  # how often a worker sends its drop counts to the engine process (/metrics)
HEARTBEAT_SECONDS = 1.0  # the worker's heartbeat to the arbiter, at most this often (gunicorn_conf: timeout 60)


class RequestDeadline(BaseException):
    """A request thread read past its request's deadline. A BaseException, so that the app's error handlers (which
    answer every Exception with a 500) let it through to the worker, which drops the connection."""


class EdgeConn(TConn):
    """A gthread connection with its request's bytes (read by the event loop, for the parser) and deadline."""

    initialized: bool  # TConn's
    parser: Any  # TConn's (gunicorn's parser, None until init)

    def __init__(self, cfg, sock, client, server) -> None:
        super().__init__(cfg, sock, client, server)
        self.pending = bytearray()  # the request read by the event loop, for the parser
        self.deadline = 0.0
        self.reset = False  # close with RST, not gracefully: the client stopped reading
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.handshaking = self.tls  # wrapped, handshake not done yet
        self.peer = edge_policy.peer_of(client)
        self.generation: tuple | None = None  # the (address, key) counted while its generation runs
        self.on_close: Callable[[EdgeConn], None] | None = None  # once, however the connection ends

    def init(self) -> None:
        """In the thread, before parsing: hand the buffered request to gunicorn's parser; bound any further read
        by the request's deadline (in total, not per read: a body trickled a byte at a time ends there too)."""
        # gunicorn 27.0.1: wraps the socket in TLS here, in the thread, and handshakes blocking with no timeout;
        # the loop did the handshake, so mark it initialized (TConn.init then returns at once) with a plain parser.
        fresh = self.parser is None
        if self.tls and not self.initialized:
            self.initialized = True
            self.parser = http.get_parser(self.cfg, self.sock, self.client)
            fresh = True
        super().init()
        if fresh and self.parser is not None and hasattr(self.parser.unreader, "sock"):
            self.parser.unreader.chunk = partial(self._bounded_chunk, self.parser.unreader.chunk)
        if self.pending:
            self.parser.unreader.unread(bytes(self.pending))
            self.pending = bytearray()
        self.sock.settimeout(max(0.5, self.deadline - time.monotonic()))

    def _bounded_chunk(self, read: Callable, size_hint=None) -> bytes:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RequestDeadline()
        before = self.sock.gettimeout()
        self.sock.settimeout(left)
        try:
            return read(size_hint)
        except TimeoutError:
            raise RequestDeadline() from None
        finally:
            self.sock.settimeout(before)

    def close(self, graceful: bool = False) -> None:
        # gunicorn 27.0.1: closes the socket only; here the connection's counts are released first (on_close).
        self.closed()
        super().close(graceful)

    def closed(self) -> None:
        on_close, self.on_close = self.on_close, None
        if on_close is not None:
            on_close(self)


class EdgeWorker(ThreadWorker):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.request_timeout = self.send_timeout = 0.0
        self.intake: edge.Intake[EdgeConn] = edge.Intake(0.0, 0, edge_policy.PeerCounts(0))
        self.lingering: edge.Lingering[EdgeConn] = edge.Lingering()
        self.probe_pool: futures.ThreadPoolExecutor | None = None
        self.tls_context: ssl.SSLContext | None = None
        self.connections = edge_policy.PeerCounts(0)  # open connections per client address
        self.drops = edge_policy.Drops()
        self.engine: EngineClient | None = None
        self.tracing: tracing.HttpTracing | None = None  # OpenTelemetry, when configured (http/tracing.py)
        self.last_beat = float("-inf")

    def init_process(self):
        """In the forked worker (gunicorn builds the worker object in the arbiter)."""
        # gunicorn 27.0.1: builds the thread pool, poller and method queue, then runs the loop; here the edge's
        # settings, pools and TLS context come first.
        settings = ServeSettings.load()
        self.request_timeout, self.send_timeout = settings.request_timeout, settings.send_timeout
        self.intake = edge.Intake(
            settings.request_timeout,
            settings.max_body_bytes,
            edge_policy.PeerCounts(settings.client_max_generations),
        )
        self.connections = edge_policy.PeerCounts(
            settings.client_max_connections or max(1, self.cfg.worker_connections - edge_policy.RESERVED_CONNECTIONS)
        )
        self.probe_pool = futures.ThreadPoolExecutor(max_workers=PROBE_THREADS, thread_name_prefix="probe")
        self.tls_context = gsock.ssl_context(self.cfg) if self.cfg.is_ssl else None
        self.engine = EngineClient(settings.socket_path, settings.authkey(), max_idle=0)  # no idle connection
        self.tracing = tracing.setup(settings)  # after the fork: its export thread is this process's own
        threading.Thread(target=self._report_drops, name="edge-report", daemon=True).start()
        super().init_process()

    def load_wsgi(self):
        """The app, its response bodies paced (edge_policy.PacedBody: a response's total wait on its reader);
        with tracing on, a span per request around it all (http/tracing.py)."""
        # gunicorn 27.0.1: loads the app as is; here it is wrapped so each response's writes are bounded in total.
        super().load_wsgi()
        if self.tracing is not None:  # the route and error type from the app; the span around everything
            self.wsgi.after_request(self.tracing.after_request)
        self.wsgi = edge_policy.paced(self.wsgi, self.send_timeout)
        if self.tracing is not None:
            self.wsgi = self.tracing.wrap(self.wsgi)

    def notify(self):
        # gunicorn 27.0.1: touches the heartbeat file on every pass of the loop (several per request); here at
        # most once every HEARTBEAT_SECONDS (the loop passes at least once a second, idle or not).
        now = time.monotonic()
        if now - self.last_beat >= HEARTBEAT_SECONDS:
            self.last_beat = now
            super().notify()

    def _report_drops(self) -> None:
        """Drop counts to the engine process (appliance_http_dropped_total), in batches: never from the loop. Asleep
        until a drop is counted (a timer beside the engine's threads costs a wakeup on a busy core)."""
        while True:
            self.drops.waiting.wait()
            time.sleep(REPORT_SECONDS)
            counts = self.drops.take()
            if counts and self.engine is not None:
                try:
                    self.engine.call(RECORD_HTTP, *(HttpRecord(DROPPED_ROUTE, r, n, 0.0) for r, n in counts.items()))
                except EngineUnavailable:
                    pass

    def _dropped(self, conn: EdgeConn, reason: str, **detail) -> None:
        self.drops.note(reason, conn.peer, **detail)

    # ---- every connection enters here
    def accept(self, listener):
        # gunicorn 27.0.1: accepts every connection, blocking, and hands it to enqueue_req; here connections per
        # address are capped, TLS is wrapped without handshaking, and the oldest connection goes when nearly full.
        try:
            client_sock, client_addr = listener.accept()
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return
        peer = edge_policy.peer_of(client_addr)
        if not self.connections.acquire(peer):  # this address holds its share of the worker's connections
            self.drops.note("client_connections", peer, open=self.connections[peer])
            try:
                client_sock.setblocking(False)
                client_sock.send(edge.BUSY)
            except OSError:
                pass
            client_sock.close()
            return
        if self.tls_context is not None:
            try:
                client_sock = self.tls_context.wrap_socket(
                    client_sock,
                    server_side=True,
                    do_handshake_on_connect=False,
                    suppress_ragged_eofs=self.cfg.suppress_ragged_eofs,
                )
            except OSError:
                self.connections.release(peer)
                client_sock.close()
                return
        if self.nr_conns + 1 >= self.worker_connections:
            self._shed_a_connection()
        self.nr_conns += 1
        conn = EdgeConn(self.cfg, client_sock, client_addr, listener.getsockname())
        conn.on_close = self._on_conn_closed
        self.enqueue_req(conn)

    def _shed_a_connection(self) -> None:
        """The worker is about to hold `worker_connections`, where gthread stops accepting (probes included):
        the oldest idle kept-alive connection goes, else the oldest unfinished request, so that a newcomer is
        never the one left out."""
        if self.keepalived_conns:
            conn = self.keepalived_conns.popleft()
            try:
                self.poller.unregister(conn.sock)
            except (OSError, KeyError, ValueError):
                pass
            self.nr_conns -= 1
            conn.close()
            return
        oldest = self.intake.oldest()
        if oldest is not None:
            self._dropped(oldest[0], "connections_full", held=len(oldest[1].buf))
            self._drop(oldest[0], edge.answer(edge.Refusal.BUSY, edge.api_of(oldest[1])))

    def _on_conn_closed(self, conn: EdgeConn) -> None:
        self.connections.release(conn.peer)
        self._end_generation(conn)

    def enqueue_req(self, conn):
        # gunicorn 27.0.1: submits the connection to the thread pool at once (new, kept-alive, or with pipelined
        # bytes); here the request is read in the loop first and only a complete one goes to a thread.
        if conn.is_http2 or negotiation.prior_knowledge_allowed(self.cfg, conn.client):
            conn.deadline = self.intake.deadline()
            return self._dispatch(conn, self.tpool)
        if conn.handshaking:
            self.intake.start(conn, conn.peer)
            self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_handshake, conn))
            return
        self._read_request(conn)

    def _read_request(self, conn: EdgeConn, deadline: float | None = None) -> None:
        # bytes of a pipelined request, read ahead by the last one's parser
        pipelined = conn.parser.unreader.take_buffered() if conn.parser is not None else b""
        request = self.intake.start(conn, conn.peer, pipelined, deadline)
        conn.sock.setblocking(False)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_readable, conn))
        if conn.tls:  # decrypted bytes may wait in the SSL object, where the poller cannot see them
            self._on_readable(conn, None)
        elif request.buf:  # a pipelined request may be complete already
            self._advance(conn)

    # ---- the TLS handshake in the event loop
    def _on_handshake(self, conn: EdgeConn, _fileobj) -> None:
        try:
            conn.sock.do_handshake()
        except ssl.SSLWantReadError:
            self.poller.modify(conn.sock, selectors.EVENT_READ, partial(self._on_handshake, conn))
            return
        except ssl.SSLWantWriteError:
            self.poller.modify(conn.sock, selectors.EVENT_WRITE, partial(self._on_handshake, conn))
            return
        except ssl.SSLError as exc:  # not TLS, or no common ground: nothing a thread could serve
            self._dropped(conn, "tls_handshake", error=str(exc.reason))
            return self._drop(conn, edge.PLAIN_ON_TLS if exc.reason == "HTTP_REQUEST" else b"", clear=True)
        except OSError:
            return self._drop(conn)
        conn.handshaking = False
        handshake = self._stop_reading(conn)
        self._read_request(conn, handshake.deadline if handshake else None)  # one deadline for both

    def _dispatch(self, conn, pool) -> None:
        conn.data_ready = True
        fs = pool.submit(self.handle, conn)
        fs.add_done_callback(lambda fut: self.method_queue.defer(self.finish_request, conn, fut))

    # ---- reading a request in the event loop
    def _on_readable(self, conn: EdgeConn, _fileobj) -> None:
        while True:
            try:
                data = conn.sock.recv(READ_CHUNK)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            except OSError:
                return self._drop(conn)
            if not data:
                return self._drop(conn)
            for victim, reason, held, api in self.intake.received(conn, data):  # over a budget: the largest go
                self._dropped(victim, reason, held=held)
                self._drop(victim, edge.answer(edge.Refusal.BUSY, api))
                if victim is conn:
                    return
            if len(data) < READ_CHUNK and not conn.tls:  # TLS: read on until the SSL object is empty too
                break
        self._advance(conn)

    def _advance(self, conn: EdgeConn) -> None:
        """Hands the connection to a thread once its request is complete (or must be judged by the parser)."""
        step = self.intake.advance(conn)
        if step is edge.Step.CONTINUE:
            try:
                if conn.sock.send(edge.CONTINUE) != len(edge.CONTINUE):
                    raise BlockingIOError
            except (OSError, ssl.SSLError):
                return self._drop(conn)
            step = self.intake.advance(conn)
        if step is edge.Step.MORE:
            return
        if step is edge.Step.HEAD_TOO_LARGE:
            self._dropped(conn, "head_too_large")
            return self._drop(conn, edge.answer(edge.Refusal.HEAD_TOO_LARGE, edge.api_of(self.intake.requests[conn])))
        if step is edge.Step.GENERATION_CAP:
            self._dropped(conn, "generation_cap", cap=self.intake.generations.cap)
            return self._drop(conn, edge.answer(edge.Refusal.GENERATION_CAP, edge.api_of(self.intake.requests[conn])))
        request = self._stop_reading(conn)
        assert request is not None and request.head is not None
        conn.pending, conn.deadline, conn.generation = request.buf, request.deadline, request.generation
        self._dispatch(conn, self.probe_pool if edge.is_probe(request.head.path) else self.tpool)

    def _end_generation(self, conn: EdgeConn) -> None:
        generation, conn.generation = conn.generation, None
        if generation is not None:
            self.intake.generations.release(*generation)

    def _stop_reading(self, conn: EdgeConn) -> edge.Request | None:
        request = self.intake.stop(conn)
        try:
            self.poller.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        return request

    def _drop(self, conn: EdgeConn, answer: bytes = b"", clear: bool = False) -> None:
        """Closes a connection still being read, after a short answer (`clear`: past TLS, on the raw socket)."""
        self._stop_reading(conn)
        self.nr_conns -= 1
        if answer:
            try:
                (partial(socket.socket.send, conn.sock) if clear else conn.sock.send)(answer)
            except OSError:
                pass
        self._retire(conn)

    def murder_pending(self):
        """Called by gthread's loop about once a second: requests past their deadline, expired lingering closes."""
        # gunicorn 27.0.1: closes connections deferred for sending nothing; here also requests past their deadline
        # (a stopping worker keeps one under way STOP_KEEPALIVE_LINGER at most) and lingering closes.
        super().murder_pending()
        for conn, request in self.intake.expired(not self.alive, STOP_KEEPALIVE_LINGER):
            if request.buf and self.alive:  # an idle connection that never sent a byte is no attack to report
                self._dropped(conn, "request_timeout", held=len(request.buf), timeout=self.request_timeout)
            self._drop(conn)
        for conn in self.lingering.expired():
            self._closed(conn)

    # ---- after the response
    def handle_request(self, req, conn):
        """In the thread: the request is parsed; its response's sends get `send_timeout` (each write) and, in
        total, edge_policy.PacedBody's bound."""
        # gunicorn 27.0.1: writes the response on a blocking socket with no timeout; here sends are bounded and a
        # timed-out or past-deadline request resets its connection.
        conn.sock.settimeout(self.send_timeout)
        try:
            return super().handle_request(req, conn)
        except TimeoutError:
            self._dropped(conn, "send_timeout", timeout=self.send_timeout)
            conn.reset = True
            return False
        except RequestDeadline:
            self._dropped(conn, "request_timeout", timeout=self.request_timeout)
            conn.reset = True
            return False
        finally:  # released here, in the thread, once the response is written: left to the loop's finish_request,
            # a client's next request (sent on reading this response) could meet the count still held, a 429
            self._end_generation(conn)

    def finish_request(self, conn, fs):
        # gunicorn 27.0.1: closes a finished connection with a blocking graceful close on the loop's thread; here
        # the close never blocks (_retire), and the connection's generation count is released.
        self._end_generation(conn)
        try:
            failed = fs.cancelled() or fs.exception() is not None
            keep = not failed and fs.result()
        except Exception:
            keep = False
        if keep:
            return super().finish_request(conn, fs)  # kept alive (or pipelined bytes): gthread's path
        self.nr_conns -= 1
        self._retire(conn)

    def _retire(self, conn: EdgeConn) -> None:
        """Closes a connection without blocking the loop: RST for a client that stopped reading, else FIN and a
        bounded, non-blocking read until the peer closes (edge.Lingering)."""
        conn.closed()
        sock = conn.sock
        try:
            if conn.reset:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return sock.close()
            sock.shutdown(socket.SHUT_WR)
            sock.setblocking(False)
            self.poller.register(sock, selectors.EVENT_READ, partial(self._on_lingering, conn))
        except (OSError, ValueError, KeyError):
            sock.close()
            return
        self.lingering.add(conn)

    def _on_lingering(self, conn: EdgeConn, _fileobj) -> None:
        while True:
            try:
                data = conn.sock.recv(READ_CHUNK)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                break
            if not data or self.lingering.drained(conn, len(data)):
                break
        self._closed(conn)

    def _closed(self, conn: EdgeConn) -> None:
        self.lingering.remove(conn)
        try:
            self.poller.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        conn.sock.close()

    def handle_quit(self, sig, frame):
        # gunicorn 27.0.1: shuts down the generation pool only; here the probe pool too.
        if self.probe_pool is not None:
            self.probe_pool.shutdown(wait=False)
        super().handle_quit(sig, frame)
