"""--keepalive-timeout on a real server (gunicorn's `keepalive`, appliance/http/gunicorn_conf.py): a kept-alive
connection left idle is closed once the timeout has passed, not before; one that keeps sending requests, each
within the timeout of the last, stays open for as long as it is used, far past the timeout; with 0 there is no
keep-alive (each answer says `Connection: close` and the connection ends).

Raw sockets, so that what is seen is the server's connection and not a client pool's. KEEPALIVE is above
gunicorn's default of 5 s, so a server that ignored the flag closes the idle connection too early. The checks
that could meet a busy machine are lower bounds (not closed before the timeout; requests a second apart);
upper bounds are hang guards. Marked slow: it waits out the timeout, twice over for the busy connection."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from tests.helpers import one_worker_server

pytestmark = pytest.mark.slow

KEEPALIVE = 8  # seconds; gunicorn's default is 5
EARLY = 1.0  # the server starts the timeout when it has sent the answer, a little before the client has read it
GUARD = 30  # hang guard: seconds past the timeout to wait for the close
BUSY_EVERY = 1.0  # seconds between the busy connection's requests
BUSY_FOR = 2 * KEEPALIVE  # seconds the busy connection is used


@pytest.fixture(scope="module")
def tiny_export(exported):
    return exported("llama", "openvino", "fp32")[0]


@pytest.fixture(scope="module")
def kept(tiny_export, tmp_path_factory):
    with one_worker_server(
        tiny_export, tmp_path_factory.mktemp("keepalive") / "serve.log", keepalive_timeout=KEEPALIVE
    ) as srv:
        yield srv


def completion(model: str) -> bytes:
    data = json.dumps({"model": model, "prompt": "The appliance serves", "max_tokens": 2}).encode()
    head = "POST /v3/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(data)}"
    return (head + "\r\n\r\n").encode() + data


def answer(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP response read off `s` (framed by Content-Length): status, headers (lower-case names), body."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        more = s.recv(65536)
        assert more, f"closed by the server before an answer: {buf!r}"
        buf += more
    head, _, body = buf.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    while len(body) < int(headers["content-length"]):
        more = s.recv(65536)
        assert more, "closed by the server mid-answer"
        body += more
    return int(status_line.split()[1]), headers, body


def seconds_until_closed(s: socket.socket, timeout: float) -> float:
    """Seconds until the server closes `s` (EOF or reset); fails if it sends anything or is still open after
    `timeout`."""
    start = time.monotonic()
    s.settimeout(timeout)
    try:
        data = s.recv(4096)
    except ConnectionResetError:
        data = b""
    except TimeoutError:
        pytest.fail(f"an idle kept-alive connection still open after {timeout:.0f}s")
    assert data == b"", data
    return time.monotonic() - start


def test_idle_connection_closed_after_the_timeout_busy_one_kept(kept):
    model = kept.model_id()
    busy_log: list = []  # (seconds since its first answer, status, Connection header) per request, or an error

    def busy() -> None:  # a request every BUSY_EVERY seconds on one connection, for BUSY_FOR seconds
        try:
            with socket.create_connection(("127.0.0.1", kept.port)) as s:
                s.settimeout(60)
                start = end = None
                while end is None or time.monotonic() < end:
                    s.sendall(completion(model))
                    status, headers, _ = answer(s)
                    if start is None:
                        start, end = time.monotonic(), time.monotonic() + BUSY_FOR
                    busy_log.append((time.monotonic() - start, status, headers.get("connection")))
                    time.sleep(BUSY_EVERY)
        except Exception as exc:  # closed under it, or an answer that did not come: reported below
            busy_log.append(exc)

    worker = threading.Thread(target=busy)
    worker.start()
    with socket.create_connection(("127.0.0.1", kept.port)) as idle:
        idle.settimeout(60)
        idle.sendall(completion(model))
        status, headers, body = answer(idle)
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2
        assert headers.get("connection", "keep-alive").lower() != "close", headers  # kept alive
        waited = seconds_until_closed(idle, KEEPALIVE + GUARD)
    worker.join(BUSY_FOR + 120)
    print(f"\nidle kept-alive connection closed after {waited:.2f}s (--keepalive-timeout {KEEPALIVE})")
    assert waited >= KEEPALIVE - EARLY, f"closed after {waited:.2f}s, before the {KEEPALIVE}s timeout"
    # the busy connection was used past the timeout (twice over), every request answered on it
    assert not worker.is_alive() and all(isinstance(e, tuple) for e in busy_log), busy_log
    assert busy_log[-1][0] > KEEPALIVE + BUSY_EVERY, busy_log
    assert all(status == 200 and (c or "").lower() != "close" for _, status, c in busy_log), busy_log


@pytest.fixture(scope="module")
def unkept(tiny_export, tmp_path_factory):
    with one_worker_server(
        tiny_export, tmp_path_factory.mktemp("no-keepalive") / "serve.log", keepalive_timeout=0
    ) as srv:
        yield srv


def test_zero_means_no_keepalive(unkept):
    with socket.create_connection(("127.0.0.1", unkept.port)) as s:
        s.settimeout(60)
        s.sendall(completion(unkept.model_id()))
        status, headers, _ = answer(s)
        assert status == 200 and headers.get("connection", "").lower() == "close", headers
        assert seconds_until_closed(s, GUARD) < GUARD
