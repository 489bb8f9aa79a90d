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
* **Buffered bytes are bounded per worker and per client** (`read_budget`, edge_policy.client_budget). Past
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
from collections import Counter
from collections.abc import Callable
from concurrent import futures
from functools import partial
from typing import Any

from gunicorn import http
from gunicorn import sock as gsock
from gunicorn.http2 import negotiation
from gunicorn.workers.gthread import STOP_KEEPALIVE_LINGER, TConn, ThreadWorker

from appliance.http import edge_policy
from appliance.http.client import EngineClient, EngineUnavailable
from appliance.protocol import DROPPED_ROUTE, RECORD_HTTP, HttpRecord
from appliance.settings import ServeSettings

PROBE_THREADS = 4  # per worker: health probes and /metrics, apart from the generation threads
PROBE_PATHS = frozenset({"/v2/health/live", "/v2/health/ready", "/metrics"})
HEAD_LIMIT = 64 * 1024  # request line + headers; larger heads get 431 (gunicorn's own limits are lower)
READ_CHUNK = 64 * 1024
LINGER_SECONDS = 2.0  # graceful close: how long (and how much) we read after our FIN, as gunicorn
LINGER_BYTES = 64 * 1024
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
_HEAD_TOO_LARGE = b"HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_TOO_MANY = (
    b'{"error": {"message": "Too many generation requests at once from this API key or address: retry when one '
    b'ends", "type": "rate_limit_error", "param": null, "code": "rate_limit_exceeded"}}'
)
_GENERATION_CAP = (
    b"HTTP/1.1 429 Too Many Requests\r\nConnection: close\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n%s" % (len(_TOO_MANY), _TOO_MANY)
)
REPORT_SECONDS = 1.0  # how often a worker sends its drop counts to the engine process (/metrics)
_HTTPS_ONLY = (
    b'{"error": {"message": "This port speaks HTTPS: use https://", "type": "invalid_request_error", '
    b'"param": null, "code": "https_required"}}'
)
_PLAIN_ON_TLS = (
    b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_HTTPS_ONLY), _HTTPS_ONLY)
)


def read_budget(max_body_bytes: int) -> int:
    """Bytes of unfinished requests one worker holds at most (a few full bodies; chat bodies are kilobytes)."""
    return max(64 * 1024 * 1024, 2 * max_body_bytes)


def is_probe(path: str) -> bool:
    return path in PROBE_PATHS or (path.startswith("/v2/models/") and path.endswith("/ready"))


class Head:
    """What the event loop needs from a request head: where the body starts, how it is framed, the path; the
    `Expect: 100-continue` lines (`expect`: their spans in the buffer) that the loop answers itself; a digest of the
    Authorization header (per-key counts)."""

    def __init__(self, end: int, path: str, length: int | None, chunked: bool, hand_over: bool):
        self.end, self.path, self.length, self.chunked, self.hand_over = end, path, length, chunked, hand_over
        self.method = ""
        self.expect: list[tuple[int, int]] = []
        self.key = b""


def parse_head(buf: bytes | bytearray, max_body: int) -> Head | None:
    """The head if `buf` holds all of it, else None. Malformed framing is not judged here: such a request is handed
    over (`hand_over`) at once and gunicorn's parser answers it. `Expect: 100-continue` on an HTTP/1.1 request
    that is otherwise fine is not handed over: the loop answers it and reads the body under the request's deadline
    (any other expectation is handed over, gunicorn answers 417)."""
    start = 0
    while buf.startswith(b"\r\n", start):  # RFC 9112: empty lines before a request line are ignored
        start += 2
    end = buf.find(b"\r\n\r\n", start)
    if end < 0:
        return None
    lines = bytes(buf[start:end]).split(b"\r\n")
    parts = lines[0].split(b" ")
    path = parts[1].split(b"?", 1)[0].decode("latin-1") if len(parts) == 3 else ""
    lengths, codings, expect, odd_expect, authorization = [], [], [], len(parts) != 3, b""
    pos = start + len(lines[0]) + 2
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            lengths.append(value.strip())
        elif name == b"transfer-encoding":
            codings.append(value.strip().lower())
        elif name == b"expect":
            expect.append((pos, pos + len(line) + 2))
            odd_expect = odd_expect or value.strip().lower() != b"100-continue" or parts[2] != b"HTTP/1.1"
        elif name == b"authorization":
            authorization = value
        pos += len(line) + 2
    length, chunked, odd = 0, False, bool(expect) and odd_expect
    if codings:
        chunked = codings[-1].endswith(b"chunked")
        odd = odd or bool(lengths) or not chunked
    elif lengths:
        odd = odd or len(set(lengths)) != 1 or not lengths[0].isdigit()
        length = int(lengths[0]) if not odd else 0
        odd = odd or length > max_body
    head = Head(end + 4, path, None if chunked else length, chunked, odd)
    head.method = parts[0].decode("latin-1")
    head.expect = [] if odd else expect
    head.key = edge_policy.key_of(authorization)
    return head


def without_expect(buf: bytearray, head: Head) -> int:
    """Removes the head's Expect lines from `buf` (the loop answered them: gunicorn must not send a second 100
    Continue); how many bytes that removed. `head.end` moves with them."""
    removed = 0
    for start, end in reversed(head.expect):
        del buf[start:end]
        removed += end - start
    head.end -= removed
    head.expect = []
    return removed


def is_generation(head: Head) -> bool:
    return head.method == "POST" and head.path.endswith(("/completions", "/chat/completions"))


def chunked_end(buf: bytes | bytearray, pos: int) -> tuple[int, bool]:
    """Scans chunked framing from the chunk-size line at `pos`: (position reached, done). The position of a done
    body is its end; -1 for framing this scan cannot follow (the parser will answer it)."""
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return (pos, False) if len(buf) - pos <= 1024 else (-1, False)
        size_field = bytes(buf[pos:eol]).split(b";", 1)[0].strip()
        try:
            size = int(size_field, 16) if size_field and size_field.isalnum() else -1
        except ValueError:
            size = -1
        if size < 0:
            return -1, False
        if size == 0:
            trailers_end = buf.find(b"\r\n\r\n", eol)
            return (trailers_end + 4, True) if trailers_end >= 0 else (pos, False)
        if len(buf) < eol + 2 + size + 2:
            return pos, False
        pos = eol + 2 + size + 2


class RequestDeadline(BaseException):
    """A request thread read past its request's deadline. A BaseException, so that the app's error handlers (which
    answer every Exception with a 500) let it through to the worker, which drops the connection."""


class EdgeConn(TConn):
    """A gthread connection with the bytes read for it so far and the deadline of its request."""

    initialized: bool  # TConn's
    parser: Any  # TConn's (gunicorn's parser, None until init)

    def __init__(self, cfg, sock, client, server) -> None:
        super().__init__(cfg, sock, client, server)
        self.buf = bytearray()
        self.head: Head | None = None
        self.chunk_pos = 0
        self.deadline = 0.0
        self.reset = False  # close with RST, not gracefully: the client stopped reading
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.handshaking = self.tls  # wrapped, handshake not done yet
        self.peer = edge_policy.peer_of(client)
        self.generation: tuple | None = None  # the (address, key) counted while its generation runs
        self.on_close: Callable[[EdgeConn], None] | None = None  # once, however the connection ends

    def start_request(self, timeout: float, deadline: float | None = None) -> None:
        if self.parser is not None:  # bytes of a pipelined request, read ahead by the last one's parser
            self.buf = bytearray(self.parser.unreader.take_buffered())
        self.head, self.chunk_pos = None, 0
        self.deadline = deadline or time.monotonic() + timeout

    def init(self) -> None:
        """In the thread, before parsing: hand the buffered request to gunicorn's parser; bound any further read
        by the request's deadline (in total, not per read: a body trickled a byte at a time ends there too)."""
        fresh = self.parser is None
        if self.tls and not self.initialized:  # the event loop did the TLS handshake: gunicorn must not wrap again
            self.initialized = True
            self.parser = http.get_parser(self.cfg, self.sock, self.client)
            fresh = True
        super().init()
        if fresh and self.parser is not None and hasattr(self.parser.unreader, "sock"):
            self.parser.unreader.chunk = partial(self._bounded_chunk, self.parser.unreader.chunk)
        if self.buf:
            self.parser.unreader.unread(bytes(self.buf))
            self.buf = bytearray()
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
        self.max_body = self.budget = self.buffered = self.client_budget = 0
        self.reading: dict[EdgeConn, None] = {}  # insertion order = deadline order
        self.lingering: dict[EdgeConn, float] = {}
        self.probe_pool: futures.ThreadPoolExecutor | None = None
        self.tls_context: ssl.SSLContext | None = None
        self.held: Counter = Counter()  # bytes of unfinished requests per client address
        self.connections = edge_policy.PeerCounts(0)  # open connections per client address
        self.generations = edge_policy.PeerCounts(0)  # running generation requests per address and per key
        self.drops = edge_policy.Drops()
        self.engine: EngineClient | None = None

    def init_process(self):
        """In the forked worker (gunicorn builds the worker object in the arbiter)."""
        settings = ServeSettings.load()
        self.request_timeout, self.send_timeout = settings.request_timeout, settings.send_timeout
        self.max_body, self.budget = settings.max_body_bytes, read_budget(settings.max_body_bytes)
        self.client_budget = edge_policy.client_budget(self.budget, self.max_body)
        self.connections = edge_policy.PeerCounts(
            settings.client_max_connections or max(1, self.cfg.worker_connections - edge_policy.RESERVED_CONNECTIONS)
        )
        self.generations = edge_policy.PeerCounts(settings.client_max_generations)
        self.probe_pool = futures.ThreadPoolExecutor(max_workers=PROBE_THREADS, thread_name_prefix="probe")
        self.tls_context = gsock.ssl_context(self.cfg) if self.cfg.is_ssl else None
        self.engine = EngineClient(settings.socket_path, settings.authkey(), max_idle=0)  # no idle connection
        threading.Thread(target=self._report_drops, name="edge-report", daemon=True).start()
        super().init_process()

    def load_wsgi(self):
        """The app, its response bodies paced (edge_policy.PacedBody: a response's total wait on its reader)."""
        super().load_wsgi()
        self.wsgi = edge_policy.paced(self.wsgi, self.send_timeout)

    def _report_drops(self) -> None:
        """Drop counts to the engine process (appliance_http_dropped_total), in batches: never from the loop."""
        while True:
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
                client_sock.send(_BUSY)
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
        oldest = next(iter(self.reading), None)
        if oldest is not None:
            self._dropped(oldest, "connections_full", held=len(oldest.buf))
            self._drop(oldest, _BUSY)

    def _on_conn_closed(self, conn: EdgeConn) -> None:
        self.connections.release(conn.peer)
        self._end_generation(conn)

    def enqueue_req(self, conn):
        if conn.is_http2 or negotiation.prior_knowledge_allowed(self.cfg, conn.client):
            conn.deadline = time.monotonic() + self.request_timeout
            return self._dispatch(conn, self.tpool)
        if conn.handshaking:
            conn.deadline = time.monotonic() + self.request_timeout
            self.reading[conn] = None
            self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_handshake, conn))
            return
        self._read_request(conn)

    def _read_request(self, conn: EdgeConn, deadline: float | None = None) -> None:
        conn.start_request(self.request_timeout, deadline)
        conn.sock.setblocking(False)
        self._hold(conn, len(conn.buf))
        self.reading[conn] = None
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_readable, conn))
        if conn.tls:  # decrypted bytes may wait in the SSL object, where the poller cannot see them
            self._on_readable(conn, None)
        elif conn.buf:  # a pipelined request may be complete already
            self._advance(conn)

    def _hold(self, conn: EdgeConn, nbytes: int) -> None:
        """Counts `nbytes` more (or fewer) buffered for `conn`: the worker's total and its address's share."""
        self.buffered += nbytes
        self.held[conn.peer] += nbytes
        if self.held[conn.peer] <= 0:
            del self.held[conn.peer]

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
            return self._drop(conn, _PLAIN_ON_TLS if exc.reason == "HTTP_REQUEST" else b"", clear=True)
        except OSError:
            return self._drop(conn)
        conn.handshaking = False
        self._stop_reading(conn)
        self._read_request(conn, conn.deadline)  # one deadline for handshake and request

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
            if not self._make_room(conn, len(data)):
                return
            conn.buf += data
            self._hold(conn, len(data))
            if len(data) < READ_CHUNK and not conn.tls:  # TLS: read on until the SSL object is empty too
                break
        self._advance(conn)

    def _make_room(self, conn: EdgeConn, incoming: int) -> bool:
        """Room for `incoming` more bytes of `conn`: within its address's share, then within the worker's budget.
        Over either, the largest unfinished requests (of that address, or of anyone) are closed with 503 until it
        fits, which is `conn` itself only when it is the largest. False when `conn` was closed."""
        for reason, same_peer in (("client_bytes", True), ("budget_shed", False)):
            if same_peer:
                need = self.held[conn.peer] + incoming - self.client_budget
            else:
                need = self.buffered + incoming - self.budget
            if need <= 0:
                continue
            sizes: dict[Any, int] = {c: len(c.buf) for c in self.reading if not same_peer or c.peer == conn.peer}
            sizes[conn] = len(conn.buf) + incoming
            for victim in edge_policy.pick_victims(sizes, need):
                self._dropped(victim, reason, held=sizes[victim])
                self._drop(victim, _BUSY)
                if victim is conn:
                    return False
        return True

    def _advance(self, conn: EdgeConn) -> None:
        """Hands the connection to a thread once its request is complete (or must be judged by the parser)."""
        if conn.head is None:
            conn.head = parse_head(conn.buf, self.max_body)
            if conn.head is None:
                if len(conn.buf) > HEAD_LIMIT:
                    self._dropped(conn, "head_too_large")
                    self._drop(conn, _HEAD_TOO_LARGE)
                return
            if conn.head.expect and not self._continue(conn):
                return
            conn.chunk_pos = conn.head.end
        head = conn.head
        if not head.hand_over:
            if head.chunked:
                conn.chunk_pos, done = chunked_end(conn.buf, conn.chunk_pos)
                if not done and conn.chunk_pos >= 0 and len(conn.buf) - head.end <= self.max_body:
                    return
            elif len(conn.buf) < head.end + (head.length or 0):  # not chunked: length is set
                return
        if not is_probe(head.path) and is_generation(head):
            if not self.generations.acquire(("address", conn.peer), ("key", head.key) if head.key else None):
                self._dropped(conn, "generation_cap", cap=self.generations.cap)
                return self._drop(conn, _GENERATION_CAP)
            conn.generation = (("address", conn.peer), ("key", head.key) if head.key else None)
        self._stop_reading(conn)
        self._dispatch(conn, self.probe_pool if is_probe(head.path) else self.tpool)

    def _continue(self, conn: EdgeConn) -> bool:
        """`Expect: 100-continue`: answered here, and the body is read here, under the request's deadline like any
        other (a thread would wait on it with a per-read timeout only). False when the connection was closed."""
        head = conn.head
        assert head is not None
        self._hold(conn, -without_expect(conn.buf, head))
        body_sent = len(conn.buf) > head.end
        if (head.chunked or head.length) and not body_sent:
            try:
                if conn.sock.send(_CONTINUE) != len(_CONTINUE):
                    raise BlockingIOError
            except (OSError, ssl.SSLError):
                self._drop(conn)
                return False
        return True

    def _end_generation(self, conn: EdgeConn) -> None:
        generation, conn.generation = conn.generation, None
        if generation is not None:
            self.generations.release(*generation)

    def _stop_reading(self, conn: EdgeConn) -> None:
        if self.reading.pop(conn, False) is None:
            self._hold(conn, -len(conn.buf))
        try:
            self.poller.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass

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
        super().murder_pending()
        now = time.monotonic()
        for conn in list(self.reading):
            if not self.alive and not conn.buf:
                conn.deadline = now  # stopping: nothing started on this connection
            elif not self.alive:
                conn.deadline = min(conn.deadline, now + STOP_KEEPALIVE_LINGER)
            if conn.deadline <= now:
                if conn.buf and self.alive:  # an idle connection that never sent a byte is no attack to report
                    self._dropped(conn, "request_timeout", held=len(conn.buf), timeout=self.request_timeout)
                self._drop(conn)
        for conn, until in list(self.lingering.items()):
            if until <= now:
                self._closed(conn)

    # ---- after the response
    def handle_request(self, req, conn):
        """In the thread: the request is parsed; its response's sends get `send_timeout` (each write) and, in
        total, edge_policy.PacedBody's bound."""
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

    def finish_request(self, conn, fs):
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
        bounded, non-blocking read until the peer closes (RFC 9112 9.6: no RST truncating our last response)."""
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
        self.lingering[conn] = time.monotonic() + LINGER_SECONDS
        conn.buf = bytearray()
        conn.chunk_pos = 0  # counts drained bytes from here on

    def _on_lingering(self, conn: EdgeConn, _fileobj) -> None:
        while conn.chunk_pos < LINGER_BYTES:
            try:
                data = conn.sock.recv(READ_CHUNK)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                break
            if not data:
                break
            conn.chunk_pos += len(data)
        self._closed(conn)

    def _closed(self, conn: EdgeConn) -> None:
        self.lingering.pop(conn, None)
        try:
            self.poller.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        conn.sock.close()

    def handle_quit(self, sig, frame):
        if self.probe_pool is not None:
            self.probe_pool.shutdown(wait=False)
        super().handle_quit(sig, frame)
