"""What the HTTP edge (appliance/http/worker.py) allows one client, as plain classes with no gunicorn in them, so
each rule is tested with bytes and numbers: which unfinished request to shed when a worker's read budget is full,
how many connections and concurrent generations one client may hold, how long a response may wait on its reader,
and how drops are logged and counted.

Why these rules:
* **Shed the largest, not the newcomer.** A worker buffers unfinished requests up to a byte budget. Refusing
  whichever read crosses it let a few clients holding big unfinished bodies make every newcomer (health probes
  included: their path is known only after the head) get 503. The largest holders are the ones that made the
  budget full; a probe or a small request (hundreds of bytes) is never the largest while megabytes are held.
  The same rule applies within one client's own share (`client_budget`), so one address cannot take the whole
  budget and then lose nothing but its newest request.
* **A response's total wait on its reader is bounded.** A socket timeout bounds one write; a client that reads a
  little before each timeout kept a generation thread (and its KV) for as long as it liked. `paced` bounds the
  sum of the time a response's writes wait, with an allowance per byte sent (a minimum average rate while the
  client is the bottleneck): a reader at network speed never comes near it, a trickling reader is cut after about
  `send_timeout` seconds of waiting. The generation's own pace does not count: only time spent in writes does.
* **Per-client counts.** Connections per peer address (a client cannot take the worker's last connections) and,
  when the operator sets it, concurrent generation requests per API key and per address (a 429 otherwise).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

from appliance.auth import bearer_token

log = logging.getLogger("appliance.edge")

# While the client is what a response waits on, it must take at least this many bytes per second on average: a
# 2 MB stream (8k tokens of SSE) may then wait up to ~30 s more than --send-timeout, a client reading a few KB/s
# gets almost nothing on top of it.
MIN_SEND_RATE = 64 * 1024
# connections of a worker that one client address can never take (probes and other clients keep them)
RESERVED_CONNECTIONS = 64
WARN_EVERY_SECONDS = 1.0  # at most one warning per drop reason per second (the counter has them all)

K = TypeVar("K", bound=Hashable)


def peer_of(client: Any) -> str:
    """The client address of a connection (gunicorn's `client`: (host, port) for TCP, else a path or "")."""
    if isinstance(client, tuple) and client:
        return str(client[0])
    return "local"


def key_of(authorization: bytes) -> bytes:
    """What identifies an API key in the edge's counts: a digest of the key the Authorization header carries, read
    as the key checks read it (auth.bearer_token: the scheme in any case, the token stripped), so `bearer KEY`,
    `BEARER KEY` and `Bearer  KEY` are one key; b"" for none. Never the key itself."""
    token = bearer_token(authorization.decode("latin-1"))
    return hashlib.blake2b(token.encode("latin-1"), digest_size=16).digest() if token else b""


def pick_victims(sizes: Mapping[K, int], need: int) -> list[K]:
    """Which unfinished requests to close so that `need` bytes are freed: the largest first, the oldest first among
    equals (`sizes` in arrival order). Empty when nothing is needed; all of them when even that is not enough."""
    if need <= 0:
        return []
    order = sorted(sizes, key=lambda k: -sizes[k])  # stable: arrival order among equal sizes
    victims: list[K] = []
    freed = 0
    for k in order:
        if freed >= need:
            break
        victims.append(k)
        freed += sizes[k]
    return victims


def client_budget(budget: int, max_body: int) -> int:
    """Bytes of unfinished requests one client address may hold in a worker: a quarter of the budget (so at least
    four clients fill it), and never less than two whole bodies."""
    return max(budget // 4, 2 * max_body)


class PeerCounts:
    """Counts per key (connections per address, generations per key / address) against one cap (0: none)."""

    def __init__(self, cap: int):
        self.cap = cap
        self._counts: Counter = Counter()
        self._lock = threading.Lock()

    def acquire(self, *keys: Hashable) -> bool:
        """Counts one more for every key, unless one of them is at the cap (then nothing is counted)."""
        keys = tuple(dict.fromkeys(k for k in keys if k is not None))
        with self._lock:
            if self.cap and any(self._counts[k] >= self.cap for k in keys):
                return False
            for k in keys:
                self._counts[k] += 1
        return True

    def release(self, *keys: Hashable) -> None:
        keys = tuple(dict.fromkeys(k for k in keys if k is not None))
        with self._lock:
            for k in keys:
                self._counts[k] -= 1
                if self._counts[k] <= 0:
                    del self._counts[k]

    def __getitem__(self, key: Hashable) -> int:
        return self._counts.get(key, 0)


class Drops:
    """Edge drops: a warning per reason at most every WARN_EVERY_SECONDS (with how many were not logged), and
    counts for appliance_http_dropped_total, taken by the worker's reporter. Thread-safe (send timeouts are seen
    in request threads, the rest in the event loop). No request content is logged: the reason and the address."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: Counter = Counter()  # not yet reported to /metrics
        self._quiet: Counter = Counter()  # not logged since the last warning
        self._last: dict[str, float] = {}
        self.waiting = threading.Event()  # set while counts wait to be taken: the reporter sleeps otherwise

    def note(self, reason: str, client: str, **detail: Any) -> None:
        now = self._clock()
        with self._lock:
            self._pending[reason] += 1
            self.waiting.set()
            if now - self._last.get(reason, -WARN_EVERY_SECONDS) < WARN_EVERY_SECONDS:
                self._quiet[reason] += 1
                return
            self._last[reason] = now
            unlogged = self._quiet.pop(reason, 0)
        log.warning(
            "edge drop: %s",
            reason,
            extra={"event": "edge_drop", "reason": reason, "client": client, "unlogged": unlogged, **detail},
        )

    def take(self) -> dict[str, int]:
        with self._lock:
            counts, self._pending = dict(self._pending), Counter()
            self.waiting.clear()
        return counts


class PacedBody:
    """A WSGI response body whose writes may wait on the client for `send_timeout` seconds in total, plus one
    second per MIN_SEND_RATE bytes sent: before each item the socket's timeout is set to what is left, and the time
    from handing an item to the server to being asked for the next one (the server's write) is what it waited.
    A write past it raises TimeoutError in the server, which abandons the response (worker.py)."""

    def __init__(self, body: Iterable, sock: Any, send_timeout: float, min_rate: float = MIN_SEND_RATE):
        self.body, self.sock, self.send_timeout, self.min_rate = body, sock, send_timeout, min_rate
        self.waited = 0.0
        self.sent = 0

    def __iter__(self) -> Iterator:
        for item in self.body:
            size = len(item)
            left = self.send_timeout + (self.sent + size) / self.min_rate - self.waited
            self.sock.settimeout(max(0.001, left))
            started = time.monotonic()
            yield item
            self.waited += time.monotonic() - started
            self.sent += size

    def close(self) -> None:
        close = getattr(self.body, "close", None)
        if close is not None:
            close()


def paced(app: Callable, send_timeout: float, min_rate: float = MIN_SEND_RATE) -> Callable:
    """WSGI middleware: every response body is a PacedBody on the request's socket (gunicorn's `gunicorn.socket`)."""

    def wrapped(environ: dict, start_response: Callable) -> Iterable:
        body = app(environ, start_response)
        sock = environ.get("gunicorn.socket")
        return body if sock is None else PacedBody(body, sock, send_timeout, min_rate)

    return wrapped
