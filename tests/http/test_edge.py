"""Edge timeouts on a real server (appliance/http/worker.py): slow or stalled clients hold no generation thread,
incomplete requests are closed at their deadline, a stream whose client stopped reading is cancelled (its KV freed)
after the send timeout, probes answer while every generation thread is busy; plus `socket_closed` on an fd > 1024.

The server here has few threads and short timeouts, so what a thread-per-connection server would get wrong shows
within seconds: THREADS slow clients would take every thread of the one worker.

Timing bounds hold on a loaded 2-core box (a short completion there can take seconds) and still catch the failure
they guard, which costs about a timeout: a slow client holding a thread makes the next request wait for its
REQUEST_TIMEOUT (10 s) deadline, a stalled stream holding the engine for SEND_TIMEOUT (10 s), a probe that needs a
generation thread for a 4000-token stream (minutes). So those waits are bounded at BOUND (8 s), well under either.
The server tests are marked slow (the units at the end are not)."""

from __future__ import annotations

import fcntl
import json
import resource
import select
import socket
import threading
import time

import pytest
import requests

from appliance.http.edge import chunked_end, parse_head, without_expect
from appliance.openai_api.streaming import socket_closed
from tests.helpers import Server, one_worker_server, wait_until

THREADS = 6
REQUEST_TIMEOUT = 10.0
SEND_TIMEOUT = 10.0
BOUND = 8.0  # what a request may take beside slow clients: under the ~10 s a held thread or stream would cost


@pytest.fixture(scope="module")
def edge(model_dir, tmp_path_factory):
    with one_worker_server(
        model_dir,
        tmp_path_factory.mktemp("edge") / "serve.log",
        threads=THREADS,
        request_timeout=REQUEST_TIMEOUT,
        send_timeout=SEND_TIMEOUT,
    ) as srv:
        yield srv


def connect(srv: Server, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: it sets the window scale
    s.connect(("127.0.0.1", srv.port))
    return s


def post_bytes(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode() + data


def timed(call) -> tuple[float, object]:
    start = time.monotonic()
    result = call()
    return time.monotonic() - start, result


def closed_by_server(s: socket.socket, timeout: float) -> float:
    """Seconds until the server closes `s` (EOF or reset), reading whatever it sends meanwhile."""
    start = time.monotonic()
    s.settimeout(timeout)
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - start


class Trickler:
    """`count` connections that send a partial request head, then a header byte every `every` seconds."""

    def __init__(self, srv: Server, count: int, every: float = 0.5):
        self.socks = [connect(srv) for _ in range(count)]
        for s in self.socks:
            s.sendall(b"POST /v3/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        self.every, self.stop = every, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            for s in self.socks:
                try:
                    s.send(b"a")
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for s in self.socks:
            s.close()


def complete(srv: Server, model: str) -> requests.Response:
    return requests.post(
        srv.base + "/v3/completions",
        timeout=30,
        json={"model": model, "prompt": "The capital of France is", "max_tokens": 4},
    )


@pytest.mark.slow
def test_slow_headers_hold_no_thread(edge, model_name):
    trickler = Trickler(edge, 5 * THREADS)
    try:
        time.sleep(1.0)  # every slow connection has sent bytes more than once
        elapsed, r = timed(lambda: complete(edge, model_name))
        assert r.status_code == 200 and elapsed < BOUND, (r.status_code, elapsed)
        elapsed, r = timed(lambda: requests.get(edge.base + "/v2/health/ready", timeout=30))
        assert r.status_code == 200 and elapsed < BOUND, (r.status_code, elapsed)
    finally:
        trickler.close()


@pytest.mark.slow
def test_incomplete_request_is_closed_at_its_deadline(edge):
    trickler = Trickler(edge, 3)
    partial_body = connect(edge)
    partial_body.sendall(post_bytes("/v3/completions", {"prompt": "x" * 100})[:-50])  # head done, body not
    idle = connect(edge)  # sends nothing at all
    try:
        for s in (*trickler.socks, partial_body, idle):
            elapsed = closed_by_server(s, timeout=REQUEST_TIMEOUT + 10)
            assert elapsed < REQUEST_TIMEOUT + 5, elapsed  # (never closed: the recv times out at + 10)
        assert requests.get(edge.base + "/v2/health/live", timeout=30).status_code == 200
    finally:
        trickler.close()
        partial_body.close()
        idle.close()


@pytest.mark.slow
def test_requests_sent_in_pieces_within_the_deadline_are_served(edge, model_name):
    """Content-Length and chunked bodies arriving in parts, and two pipelined requests in one packet."""
    data = json.dumps({"model": model_name, "prompt": "Hello", "max_tokens": 2}).encode()
    head = b"POST /v3/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(data[i : i + 7]), data[i : i + 7]) for i in range(0, len(data), 7))
    for request in (
        head + b"Content-Length: %d\r\n\r\n" % len(data) + data,
        head + b"Transfer-Encoding: chunked\r\n\r\n" + chunked + b"0\r\n\r\n",
    ):
        s = connect(edge)
        try:
            for i in range(0, len(request), 40):
                s.sendall(request[i : i + 40])
                time.sleep(0.05)
            s.settimeout(30)
            reply = s.recv(65536)
            assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
        finally:
            s.close()
    s = connect(edge)
    try:
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 2)
        s.settimeout(10)
        replies = b""
        while replies.count(b"HTTP/1.1 200") < 2:
            chunk = s.recv(65536)
            assert chunk, replies
            replies += chunk
    finally:
        s.close()


@pytest.mark.slow
def test_stream_whose_client_stopped_reading_is_cancelled(edge, model_name):
    """Non-reading streams on all but two threads: probes and a normal request still answer; after the send
    timeout the streams are cancelled engine-side and their KV is freed."""
    stalled = THREADS - 2
    before = edge.metrics()
    socks = [connect(edge, rcvbuf=4096) for _ in range(stalled)]
    try:
        for s in socks:  # never read
            s.sendall(
                post_bytes(
                    "/v3/completions",
                    {
                        "model": model_name,
                        "prompt": "Once upon a time",
                        "max_tokens": 4000,
                        "ignore_eos": True,
                        "stream": True,
                    },
                )
            )
        wait_until(lambda: edge.metrics()["appliance_running_sequences"] == stalled, "the streams to run")
        elapsed, r = timed(lambda: requests.get(edge.base + "/v2/health/ready", timeout=30))
        assert r.status_code == 200 and elapsed < BOUND, (r.status_code, elapsed)
        elapsed, r = timed(lambda: complete(edge, model_name))
        assert r.status_code == 200 and elapsed < BOUND, (r.status_code, elapsed)
        was = before.get("appliance_sequences_cancelled_total", 0)
        # slots free on the engine thread, cancels are counted as the last chunks pass the pump threads: wait for both
        after = wait_until(
            lambda: (m := edge.metrics())["appliance_running_sequences"] == 0
            and m.get("appliance_sequences_cancelled_total", 0) >= was + stalled
            and m,
            "the stalled streams to be cancelled",
            timeout=90,
        )
        assert after["appliance_kv_cache_blocks_used"] == 0
        cancelled = after["appliance_sequences_cancelled_total"] - before.get("appliance_sequences_cancelled_total", 0)
        assert cancelled == stalled
        generated = after["appliance_generation_tokens_total"] - before["appliance_generation_tokens_total"]
        assert generated < stalled * 4000
    finally:
        for s in socks:
            s.close()


@pytest.mark.slow
def test_probes_answer_while_every_generation_thread_is_busy(edge, model_name):
    stop = threading.Event()

    def hold() -> None:
        with requests.post(
            edge.base + "/v3/completions",
            stream=True,
            timeout=60,
            json={
                "model": model_name,
                "prompt": "Once upon a time",
                "max_tokens": 4000,
                "ignore_eos": True,
                "stream": True,
            },
        ) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    holders = [threading.Thread(target=hold, daemon=True) for _ in range(THREADS)]
    for t in holders:
        t.start()
    try:
        wait_until(lambda: edge.metrics()["appliance_running_sequences"] == THREADS, "every thread to stream")
        for path in ("/v2/health/live", "/v2/health/ready", f"/v2/models/{model_name}/ready"):
            elapsed, r = timed(lambda url=edge.base + path: requests.get(url, timeout=30))
            # a probe waiting for a generation thread would wait for a 4000-token stream: minutes
            assert r.status_code == 200 and elapsed < BOUND, (path, r.status_code, elapsed)
    finally:
        stop.set()
        for t in holders:
            t.join(timeout=30)
    wait_until(lambda: edge.metrics()["appliance_running_sequences"] == 0, "the streams to end")


# ---------------------------------------------------------------- units
def test_socket_closed_on_a_high_fd():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    ours, peer = socket.socketpair()
    high = socket.socket(fileno=fcntl.fcntl(ours.fileno(), fcntl.F_DUPFD, 1500))
    ours.close()
    try:
        assert high.fileno() > 1024
        assert not socket_closed(high)
        high.settimeout(5)  # a response socket has the send timeout: the check must not wait for it
        elapsed, gone = timed(lambda: socket_closed(high))
        assert not gone and elapsed < 2.5  # waiting for the socket's timeout would take 5 s
        peer.sendall(b"GET / HTTP/1.1\r\n")  # pipelined bytes: alive
        assert not socket_closed(high)
        peer.close()
        high.recv(100)
        assert socket_closed(high)
    finally:
        high.close()
        peer.close()


def test_socket_closed_sees_a_close_behind_unread_bytes():
    """A TLS client that closes properly sends a close_notify alert before its FIN (an OpenSSL client, curl, ...):
    bytes the request's thread never reads. The FIN behind them still means gone; bytes alone mean alive."""
    for family in (socket.AF_INET, socket.AF_UNIX):
        if family == socket.AF_INET:
            listener = socket.create_server(("127.0.0.1", 0))
            peer = socket.create_connection(listener.getsockname())
            ours, _ = listener.accept()
            listener.close()
        else:
            ours, peer = socket.socketpair()
        try:
            peer.sendall(b"\x15\x03\x03\x00\x1a" + b"x" * 26)  # the size of a TLS 1.3 close_notify record
            wait_until(lambda s=ours: select.select([s], [], [], 0)[0], "the bytes to arrive", timeout=5)
            assert not socket_closed(ours)
            peer.shutdown(socket.SHUT_WR)
            wait_until(lambda s=ours: socket_closed(s), "the close behind the bytes to be seen", timeout=5)
        finally:
            ours.close()
            peer.close()


def test_parse_head_and_chunked_framing():
    assert parse_head(b"GET /v2/health/ready?x=1 HTTP/1.1\r\nHost: 127.0.0.1\r\n", 100) is None
    head = parse_head(b"\r\nGET /v2/health/ready?x=1 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 100)
    assert (head.path, head.length, head.hand_over) == ("/v2/health/ready", 0, False)
    assert parse_head(b"POST / HTTP/1.1\r\nContent-Length: 101\r\n\r\n", 100).hand_over  # 413 by the app
    assert parse_head(b"POST / HTTP/1.1\r\nExpect: something\r\n\r\n", 100).hand_over  # 417 by gunicorn
    assert parse_head(b"POST / HTTP/1.0\r\nExpect: 100-continue\r\n\r\n", 100).hand_over
    assert parse_head(b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 101\r\n\r\n", 100).hand_over
    buf = bytearray(b"POST / HTTP/1.1\r\nExpect: 100-Continue\r\nContent-Length: 2\r\n\r\nab")
    head = parse_head(buf, 100)
    assert not head.hand_over and head.expect and head.length == 2  # answered and read by the event loop
    assert without_expect(buf, head) == len(b"Expect: 100-Continue\r\n")
    assert buf == b"POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\nab" and buf[head.end :] == b"ab"
    assert parse_head(buf, 100).expect == []
    assert parse_head(b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 100).hand_over
    head = parse_head(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 100)
    assert head.chunked and not head.hand_over
    body = b"3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\nTrailer: x\r\n\r\nNEXT"
    assert chunked_end(body, 0) == (len(body) - 4, True)
    assert chunked_end(body[:12], 0) == (8, False)  # waits at the second chunk
    assert chunked_end(b"zz\r\n", 0) == (-1, False)
