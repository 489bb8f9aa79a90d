"""How the HTTP edge reads a request in the worker's event loop, before any thread sees it: where a request head
ends and what it says, how its body is framed, when it is complete, how many bytes unfinished requests may hold
(per worker and per client address) and whom to shed past that, when a request is past its deadline, and how long
a closing connection lingers. Bytes, clocks and counters only: no sockets and no gunicorn.

Why a module of its own: the worker class (appliance/http/worker.py) subclasses gunicorn's gthread worker and
overrides its private methods, so a gunicorn upgrade (pinned exactly, in pyproject.toml) can move what it stands
on. Everything that does not need gunicorn lives here, tested with byte strings and a fake clock
(tests/http/test_edge_intake.py); worker.py keeps only the socket I/O and the wiring into gthread's loop, and
tests/http/test_gunicorn_contract.py names each gunicorn internal that wiring uses.

The bounds: a head may be 64 KiB (HEAD_LIMIT; gunicorn's own parser limits are lower and answer the rest); a
worker buffers at most `read_budget` bytes of unfinished requests (64 MiB, or two bodies if --max-body-bytes is
larger: chat bodies are kilobytes, so this is a few full bodies), one address at most its `client_budget` share
(edge_policy). Past either, the largest unfinished requests are shed (edge_policy.pick_victims).
"""

from __future__ import annotations

import enum
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from appliance import error_shapes
from appliance.http import edge_policy

HEAD_LIMIT = 64 * 1024  # request line + headers; larger heads get 431 (gunicorn's own limits are lower)
# The routes that make the engine work, counted per key and address (--client-max-generations) when POSTed:
# OpenAI's/OVMS's completions and chat (".../completions"), Responses (POST .../responses creates one),
# embeddings, rerank and tokenize, Anthropic's messages and count_tokens, Ollama's generate, chat, embed and
# embeddings. Matched on the canonical path (`canonical_path`: what Flask routes), by suffix, so every prefix
# (/v3, /v1, /v3/v1, /api) is one; tests/http/test_edge_intake.py checks every POST route of the app against it.
ENGINE_WORK_SUFFIXES = (
    "/completions",
    "/responses",
    "/embeddings",
    "/rerank",
    "/tokenize",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/api/generate",
    "/api/chat",
    "/api/embed",
)
PROBE_PATHS = frozenset({"/v2/health/live", "/v2/health/ready", "/metrics"})
LINGER_SECONDS = 2.0  # graceful close: how long (and how much) we read after our FIN, as gunicorn
LINGER_BYTES = 64 * 1024

# The edge's own answers, written on the raw socket before the connection is closed. A refusal is rendered in the
# error shape of the API its request path belongs to (appliance/error_shapes.py): OpenAI's routes keep OVMS's
# bodies (empty for 503 and 431), Anthropic's and Ollama's get their own JSON, with a message their users read.
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class Refusal(enum.Enum):
    """(status line, message, OpenAI's type and code, whether OpenAI's routes get a body, extra headers)"""

    BUSY = (
        b"503 Service Unavailable",
        "The server is busy: too many unfinished requests; retry",
        "server_error",
        "service_unavailable",
        False,
        b"",
    )
    HEAD_TOO_LARGE = (
        b"431 Request Header Fields Too Large",
        f"The request head is over {HEAD_LIMIT // 1024} KiB",
        "invalid_request_error",
        "request_header_fields_too_large",
        False,
        b"",
    )
    GENERATION_CAP = (
        b"429 Too Many Requests",
        "Too many generation requests at once from this API key or address: retry when one ends",
        "rate_limit_error",
        "rate_limit_exceeded",
        True,
        b"Retry-After: 1\r\n",
    )


def answer(refusal: Refusal, api: str = error_shapes.OPENAI) -> bytes:
    """The raw response refusing a request of `api` (error_shapes.api_of its path)."""
    status, message, kind, code, openai_body, headers = refusal.value
    body = b""
    if api != error_shapes.OPENAI or openai_body:
        body = error_shapes.body(api, int(status[:3]), message, kind, code)
    content_type = b"Content-Type: application/json\r\n" if body else b""
    return b"HTTP/1.1 %s\r\nConnection: close\r\n%s%sContent-Length: %d\r\n\r\n%s" % (
        status,
        content_type,
        headers,
        len(body),
        body,
    )


BUSY = answer(Refusal.BUSY)  # before any request: a connection over its address's share
_HTTPS_ONLY = (
    b'{"error": {"message": "This port speaks HTTPS: use https://", "type": "invalid_request_error", '
    b'"param": null, "code": "https_required"}}'
)
PLAIN_ON_TLS = (
    b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_HTTPS_ONLY), _HTTPS_ONLY)
)

K = TypeVar("K", bound=Hashable)


def read_budget(max_body_bytes: int) -> int:
    """Bytes of unfinished requests one worker holds at most (a few full bodies; chat bodies are kilobytes)."""
    return max(64 * 1024 * 1024, 2 * max_body_bytes)


def canonical_path(target: str) -> str:
    """The path of a request target as routing sees it: gunicorn's PATH_INFO (gunicorn/util.py split_request_uri,
    then unquote_to_wsgi_str, which gunicorn/http/wsgi.py applies): the query and fragment cut, an absolute URI's
    path taken, percent escapes decoded (%2F too) as latin-1. The edge classifies this, not the raw target, so a
    spelling Flask routes to a route (`/v3/chat/completion%73`, `/v3/chat%2Fcompletions`) is counted as that
    route; tests/http/test_edge_intake.py holds it to gunicorn's own functions. A target urlsplit refuses is
    returned as it is (gunicorn answers it 400)."""
    try:
        if target.startswith("//"):  # gunicorn: an abs_path, not a network-path reference
            path = urllib.parse.urlsplit("." + target).path[1:]
        else:
            path = urllib.parse.urlsplit(target).path
    except ValueError:
        return target
    return urllib.parse.unquote_to_bytes(path).decode("latin-1")


def request_path(line: bytes) -> str:
    """The canonical path of a request line (`canonical_path`), "" when it is not METHOD TARGET VERSION."""
    parts = line.split(b" ")
    return canonical_path(parts[1].decode("latin-1")) if len(parts) == 3 else ""


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
    path = request_path(lines[0])
    lengths, codings, expect, odd_expect, authorization, api_key = [], [], [], len(parts) != 3, b"", b""
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
        elif name == b"x-api-key":  # Anthropic's header: counted as the same key sent as a bearer token
            api_key = value.strip()
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
    head.key = edge_policy.key_of(authorization if authorization.strip() or not api_key else b"Bearer " + api_key)
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


def is_engine_work(head: Head) -> bool:
    """Whether the request is counted against --client-max-generations: a POST to an ENGINE_WORK_SUFFIXES route."""
    return head.method == "POST" and head.path.endswith(ENGINE_WORK_SUFFIXES)


def api_of(request: Request) -> str:
    """The API (error shape) of a request being read: from its parsed head, else from its request line if that
    arrived (a head too large, a request shed half-read); OpenAI's before that."""
    if request.head is not None:
        return error_shapes.api_of(request.head.path)
    start = 0
    while request.buf.startswith(b"\r\n", start):
        start += 2
    eol = request.buf.find(b"\r\n", start, start + HEAD_LIMIT)
    return error_shapes.api_of(request_path(bytes(request.buf[start:eol])) if eol >= 0 else "")


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


class Request:
    """One request being read in the event loop: its bytes so far, its head once complete, how far a chunked body
    was scanned, its deadline, the client address its bytes count against, and the (address, key) counted while
    it runs if it is a generation."""

    def __init__(self, peer: str, deadline: float, pipelined: bytes = b""):
        self.peer, self.deadline = peer, deadline
        self.buf = bytearray(pipelined)
        self.head: Head | None = None
        self.chunk_pos = 0
        self.generation: tuple | None = None


class Step(enum.Enum):
    """What the event loop does next with a request (Intake.advance)."""

    MORE = "more"  # wait for more bytes
    CONTINUE = "continue"  # send `100 Continue`, then advance again (the body is read here too)
    HEAD_TOO_LARGE = "head_too_large"  # answer HEAD_TOO_LARGE and close
    GENERATION_CAP = "generation_cap"  # answer GENERATION_CAP and close: the address or key runs its share
    READY = "ready"  # complete, or for gunicorn's parser to judge: stop reading, hand it to a thread


class Intake(Generic[K]):
    """The requests one worker is reading in its event loop, by connection (any hashable key): their bytes, the
    worker's total and each address's share of them, their deadlines, and the generations running per address and
    per API key. The worker does the I/O and acts on what this returns; a request it stops reading (handed to a
    thread, or closed) leaves with `stop`, and its bytes no longer count. Insertion order is deadline order."""

    def __init__(
        self,
        request_timeout: float,
        max_body: int,
        generations: edge_policy.PeerCounts,
        budget: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.request_timeout, self.max_body, self.generations, self.clock = (
            request_timeout,
            max_body,
            generations,
            clock,
        )
        self.budget = read_budget(max_body) if budget is None else budget
        self.client_budget = edge_policy.client_budget(self.budget, max_body)
        self.requests: dict[K, Request] = {}
        self.buffered = 0  # bytes held by all requests being read
        self.held: Counter = Counter()  # the same, per client address

    def deadline(self) -> float:
        """The deadline of a request starting now (also bounds the TLS handshake before it)."""
        return self.clock() + self.request_timeout

    def start(self, key: K, peer: str, pipelined: bytes = b"", deadline: float | None = None) -> Request:
        """Starts reading a request on `key`, with the bytes its connection already read ahead (`pipelined`), under
        `deadline` (default: `request_timeout` from now)."""
        request = Request(peer, deadline or self.deadline(), pipelined)
        self.requests[key] = request
        self._hold(peer, len(request.buf))
        return request

    def stop(self, key: K) -> Request | None:
        """No longer read here (handed over or closed): the request, or None if it was not being read."""
        request = self.requests.pop(key, None)
        if request is not None:
            self._hold(request.peer, -len(request.buf))
        return request

    def oldest(self) -> tuple[K, Request] | None:
        return next(iter(self.requests.items()), None)

    def received(self, key: K, data: bytes) -> list[tuple[K, str, int, str]]:
        """Adds `data` to `key`'s request, first making room for it: within its address's share, then within the
        worker's budget. Over either, the largest unfinished requests (of that address, or of anyone) are stopped
        until it fits. Returns them, for the worker to answer 503 and close, each with the reason, the bytes it
        held and its API (api_of: the answer's error shape); `key` is among them (last, its `data` not added) only
        when it was the largest."""
        request = self.requests[key]
        victims: list[tuple[K, str, int, str]] = []
        for reason, same_peer in (("client_bytes", True), ("budget_shed", False)):
            if same_peer:
                need = self.held[request.peer] + len(data) - self.client_budget
            else:
                need = self.buffered + len(data) - self.budget
            if need <= 0:
                continue
            sizes = {k: len(r.buf) for k, r in self.requests.items() if not same_peer or r.peer == request.peer}
            sizes[key] = len(request.buf) + len(data)
            for victim in edge_policy.pick_victims(sizes, need):
                victims.append((victim, reason, sizes[victim], api_of(self.requests[victim])))
                self.stop(victim)
                if victim is key:
                    return victims
        request.buf += data
        self._hold(request.peer, len(data))
        return victims

    def advance(self, key: K) -> Step:
        """What to do with `key`'s request given the bytes read so far. A request is READY once complete (head, and
        a body framed by Content-Length or chunked encoding up to `max_body`), or at the end of its head if the
        parser must see it early (a body over the limit, framing this scan cannot follow, other expectations).
        A generation request is counted against its address's and key's share here (GENERATION_CAP past it)."""
        request = self.requests[key]
        if request.head is None:
            request.head = parse_head(request.buf, self.max_body)
            if request.head is None:
                return Step.HEAD_TOO_LARGE if len(request.buf) > HEAD_LIMIT else Step.MORE
            head, expects = request.head, bool(request.head.expect)
            if expects:  # answered here, not by gunicorn: its thread would wait on the body per read only
                self._hold(request.peer, -without_expect(request.buf, head))
            request.chunk_pos = head.end
            if expects and (head.chunked or head.length) and len(request.buf) <= head.end:
                return Step.CONTINUE
        head = request.head
        if not head.hand_over:
            if head.chunked:
                request.chunk_pos, done = chunked_end(request.buf, request.chunk_pos)
                if not done and request.chunk_pos >= 0 and len(request.buf) - head.end <= self.max_body:
                    return Step.MORE
            elif len(request.buf) < head.end + (head.length or 0):  # not chunked: length is set
                return Step.MORE
        if not is_probe(head.path) and is_engine_work(head):
            generation = (("address", request.peer), ("key", head.key) if head.key else None)
            if not self.generations.acquire(*generation):
                return Step.GENERATION_CAP
            request.generation = generation
        return Step.READY

    def expired(self, stopping: bool, linger: float) -> list[tuple[K, Request]]:
        """The requests past their deadline, stopped. A stopping worker gives a connection that sent nothing no
        more time, and a request under way `linger` seconds at most."""
        now = self.clock()
        out = []
        for key, request in list(self.requests.items()):
            if stopping:
                request.deadline = now if not request.buf else min(request.deadline, now + linger)
            if request.deadline <= now:
                self.stop(key)
                out.append((key, request))
        return out

    def _hold(self, peer: str, nbytes: int) -> None:
        self.buffered += nbytes
        self.held[peer] += nbytes
        if self.held[peer] <= 0:
            del self.held[peer]


class Lingering(Generic[K]):
    """Connections closing gracefully: after our FIN, what the peer still sends is read and dropped until it
    closes, for LINGER_SECONDS and LINGER_BYTES at most (RFC 9112 9.6: no RST truncating our last response), as
    gunicorn's graceful close does, but by the event loop without blocking it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._until: dict[K, float] = {}
        self._drained: Counter = Counter()

    def add(self, key: K) -> None:
        self._until[key] = self.clock() + LINGER_SECONDS
        self._drained[key] = 0

    def drained(self, key: K, nbytes: int) -> bool:
        """Counts `nbytes` read from `key` after our FIN: True when that is enough, close it now."""
        self._drained[key] += nbytes
        return self._drained[key] >= LINGER_BYTES

    def remove(self, key: K) -> None:
        self._until.pop(key, None)
        self._drained.pop(key, None)

    def expired(self) -> list[K]:
        now = self.clock()
        return [key for key, until in self._until.items() if until <= now]
