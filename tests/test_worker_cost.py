"""What the edge worker saves per request (appliance/http/worker.py), with gunicorn's behaviour otherwise kept:

- EdgeResponse: a small non-streamed response goes out in one send, the same bytes as gunicorn's own Response
  writes in two; chunked, large and bodiless responses are written as gunicorn writes them (a real gunicorn
  request parsed from bytes, a socket that records its sends);
- EdgeWorker.notify: the heartbeat to the arbiter at most once a second, not on every pass of the loop."""

from __future__ import annotations

import re

import pytest
from gunicorn.config import Config
from gunicorn.http import wsgi
from gunicorn.http.parser import RequestParser

from appliance.http.worker import COALESCE_BYTES, HEARTBEAT_SECONDS, EdgeResponse, EdgeWorker


class Sock:
    def __init__(self) -> None:
        self.sends: list[bytes] = []

    def sendall(self, data) -> None:
        self.sends.append(bytes(data))


def respond(response_class, method: str, headers: list[tuple[str, str]], pieces: list[bytes]) -> list[bytes]:
    cfg = Config()
    raw = f"{method} /v3/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n".encode()
    req = next(iter(RequestParser(cfg, iter([raw]), ("127.0.0.1", 5000))))
    sock = Sock()
    resp, _ = wsgi.create(req, sock, ("127.0.0.1", 5000), ("127.0.0.1", 8000), cfg, response_class=response_class)
    resp.start_response("200 OK", headers)
    for piece in pieces:
        resp.write(piece)
    resp.close()
    return sock.sends


def test_a_small_unchunked_body_goes_with_its_head_in_one_send():
    body = b'{"object": "list", "data": []}'
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    ours, theirs = respond(EdgeResponse, "POST", headers, [body]), respond(wsgi.Response, "POST", headers, [body])
    assert len(ours) == 1 and len(theirs) == 2
    assert ours[0].endswith(b"\r\n\r\n" + body)
    assert undated(ours[0]) == undated(b"".join(theirs))


@pytest.mark.parametrize(
    ("method", "headers", "pieces"),
    [
        ("POST", [("Content-Type", "text/event-stream")], [b"data: 1\n\n", b"data: 2\n\n"]),  # chunked: a stream
        ("POST", [("Content-Length", str(COALESCE_BYTES + 1))], [b"x" * (COALESCE_BYTES + 1)]),  # large
        ("HEAD", [("Content-Length", "5")], [b"hello"]),  # no body on the wire
    ],
)
def test_other_responses_are_written_as_gunicorn_writes_them(method, headers, pieces):
    ours, theirs = respond(EdgeResponse, method, headers, pieces), respond(wsgi.Response, method, headers, pieces)
    if method == "HEAD":
        assert len(ours) == 1 and ours[0].endswith(b"\r\n\r\n")
    else:
        assert len(ours) == len(theirs) > 1
    assert [undated(s) for s in ours] == [undated(s) for s in theirs]


def undated(data: bytes) -> bytes:
    """The bytes without the head's Date line (the two responses may be a second apart)."""
    return re.sub(rb"\r\nDate: [^\r]*", b"", data)


def test_the_heartbeat_is_touched_at_most_once_a_second():
    class Tmp:
        beats = 0

        def notify(self) -> None:
            self.beats += 1

    worker = EdgeWorker.__new__(EdgeWorker)  # only what notify reads: no process, no sockets
    worker.tmp, worker.last_beat = Tmp(), float("-inf")
    for _ in range(100):  # a loop's passes within a second
        worker.notify()
    assert worker.tmp.beats == 1
    worker.last_beat -= HEARTBEAT_SECONDS  # a second later
    worker.notify()
    assert worker.tmp.beats == 2
