"""What one client may take from the HTTP edge, on a real server (appliance/http/worker.py, edge_policy.py):
bodies trickled after `Expect: 100-continue` end at the request deadline, a stream read slowly ends after its
send budget (not only a stream that stopped reading), unfinished bodies that fill a worker's read budget cost their
holders and not the probes, a key or address past --client-max-generations gets 429, and invented HTTP methods add
no metric series. Each attack runs beside well-behaved requests, which must be served.

Clients that attack connect from other loopback addresses (127.0.0.2 and up: Linux routes all of 127/8 to lo), so
the server sees them as other clients than the victims on 127.0.0.1, as it would see hosts on a network."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import threading
import time

import pytest
import requests

from appliance.api.client_socket import STREAM_SEND_BUFFER
from appliance.http.edge_policy import MIN_SEND_RATE
from appliance.limits import IMAGE_BODY_ROOM
from tests.helpers import Server, one_worker_server, wait_until

THREADS = 4
# long enough that the budget test's probes and completion (seconds each on a loaded 2-core box) run while the
# unfinished bodies are still held
REQUEST_TIMEOUT = 8.0
SEND_TIMEOUT = 3.0
MAX_GENERATIONS = 3
MAX_CONNECTIONS = 80  # per client address (the expect test opens 72 from one)
BODY = 4 * 1024 * 1024  # --max-body-bytes: the worker's 64 MiB read budget is 16 such bodies
# murder_pending runs about once a second, a loaded 2-core box adds its own delays: how late a bound may act
MARGIN = 4.0
# The liveness probe answers in the worker: a few ms. The failures bounded here make it wait for the engine (stopped:
# forever), a generation thread or a connection slot (the 30 s request timeout): far past this, or its 10 s timeout.
LIVE_BOUND = 5.0
# The slow-reader test reads its streams at full speed until each brought this much (~30 SSE events) to measure the
# generation's pace on this box, then reads them at a third of it (at most SLOW_READ_RATE), a read every READ_EVERY s.
# A third: the reader stays the bottleneck if the pace drops meanwhile (the victim's request joins the batch, the box's
# load moves). On a loaded 2-core Zen 3 (2.3 KB/s of SSE) single writes then waited over 3 s at times (a blocked write
# waits for the kernel to drain a share of the send buffer), so there a per-write timeout alone cut them too; at half
# the pace it never did in 88 s, but that reader is not yet shown to be cut reliably by the total bound.
PACE_BYTES = 8 * 1024
SLOWER = 3
SLOW_READ_RATE = 2048  # bytes/s: on a box that generates faster, the reader stays at 2 KB/s
READ_EVERY = 0.5
# how much the generation may slow down after it was measured (the bound below assumes this pace at worst)
PACE_DROP = 0.75


@pytest.fixture(scope="module")
def srv(model_dir, tmp_path_factory):
    with one_worker_server(
        model_dir,
        tmp_path_factory.mktemp("edge-limits") / "serve.log",
        "--client-max-generations",
        str(MAX_GENERATIONS),
        "--client-max-connections",
        str(MAX_CONNECTIONS),
        "--max-body-bytes",  # the budget test's arithmetic is in bodies of BODY: a 16 MiB share per address
        str(BODY),
        "--max-image-bytes",  # the most a BODY carries (appliance serve refuses a body limit that cannot)
        str((BODY - IMAGE_BODY_ROOM) // 4 * 3),
        threads=THREADS,
        request_timeout=REQUEST_TIMEOUT,
        send_timeout=SEND_TIMEOUT,
    ) as server:
        yield server


def connect(server: Server, source: str, rcvbuf: int | None = None) -> socket.socket:
    """A connection from loopback address `source`."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind((source, 0))
    s.connect(("127.0.0.1", server.port))
    return s


def generation_body(model: str, **extra) -> bytes:
    return json.dumps({"model": model, "prompt": "Once upon a time", **extra}).encode()


def post_head(length: int, *headers: str, path: str = "/v3/completions") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json", f"Content-Length: {length}"]
    return ("\r\n".join([*lines, *headers]) + "\r\n\r\n").encode()


def is_closed(s: socket.socket) -> bool:
    """True once the server closed `s` (EOF or reset); reads and discards what it sent meanwhile."""
    s.setblocking(False)
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


def victim_served(server: Server, model: str) -> tuple[float, int]:
    """A normal completion from 127.0.0.1: (seconds, status)."""
    started = time.monotonic()
    r = requests.post(
        server.base + "/v3/completions",
        json={"model": model, "prompt": "The capital of France is", "max_tokens": 4},
        timeout=60,
    )
    return time.monotonic() - started, r.status_code


def live(server: Server) -> tuple[float, int]:
    started = time.monotonic()
    r = requests.get(server.base + "/v2/health/live", timeout=10)
    return time.monotonic() - started, r.status_code


def dropped(server: Server, reason: str) -> float:
    return server.metrics().get(f'appliance_http_dropped_total{{reason="{reason}"}}', 0)


def test_expect_continue_bodies_trickled_end_at_the_request_deadline(srv, model_name):
    """70 connections send an `Expect: 100-continue` head, get 100 Continue, then trickle the body a byte a second:
    each is closed within --request-timeout (plus a margin), holding no thread meanwhile, so a normal completion
    from another client and the liveness probe are answered during the attack. Two HTTP/1.0 ones, which a thread
    reads, end at the same deadline."""
    body = generation_body(model_name, max_tokens=4)
    socks = [connect(srv, "127.0.0.2") for _ in range(70)]
    started = time.monotonic()
    for s in socks:
        s.sendall(post_head(len(body), "Expect: 100-continue"))
    # HTTP/1.0 with Expect (ignored there): handed to a thread at its head; the thread's reads share the deadline
    http10 = [connect(srv, "127.0.0.2") for _ in range(2)]
    for s in http10:
        s.sendall(post_head(len(body), "Expect: 100-continue").replace(b"HTTP/1.1", b"HTTP/1.0", 1))
    socks += http10
    for s in socks[:5]:
        s.settimeout(10)
        assert s.recv(64).startswith(b"HTTP/1.1 100 Continue")
    stop = threading.Event()

    def trickle() -> None:
        sent = 0
        while not stop.wait(1.0) and sent < len(body) - 1:
            for s in socks:
                try:
                    s.send(body[sent : sent + 1])
                except OSError:
                    pass
            sent += 1

    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    try:
        time.sleep(1.5)  # every connection has sent body bytes
        victim, status = victim_served(srv, model_name)
        assert status == 200 and victim < 15, (status, victim)
        elapsed, status = live(srv)
        assert status == 200 and elapsed < LIVE_BOUND, (status, elapsed)
        open_ = list(socks)
        while open_ and time.monotonic() - started < REQUEST_TIMEOUT + MARGIN + 5:
            open_ = [s for s in open_ if not is_closed(s)]
            time.sleep(0.2)
        closed_after = time.monotonic() - started
        print(f"expect trickle: victim {victim:.2f} s, live {elapsed:.2f} s; all closed after {closed_after:.1f} s")
        assert not open_, f"{len(open_)} trickling connections still open after {closed_after:.1f} s"
        assert closed_after < REQUEST_TIMEOUT + MARGIN, closed_after
    finally:
        stop.set()
        trickler.join()
        for s in socks:
            s.close()
    wait_until(lambda: dropped(srv, "request_timeout") >= 72, "the drops to be counted in /metrics", timeout=10)


def full_speed_pace(socks: list[socket.socket], got: list[bytes], nbytes: int) -> float:
    """Reads every stream as fast as it comes until each brought `nbytes` after its first read; returns the slowest
    stream's pace in bytes/s (from its first read to its last). Nothing waits in any buffer meanwhile: this is the
    generation's own pace on this box, for these streams side by side."""
    first: list[float | None] = [None] * len(socks)
    last = [0.0] * len(socks)
    counted = [0] * len(socks)
    for s in socks:
        s.settimeout(None)
    while open_ := [s for i, s in enumerate(socks) if counted[i] < nbytes]:
        ready, _, _ = select.select(open_, [], [], 30)
        assert ready, f"no stream byte in 30 s while measuring the pace: {counted} bytes"
        for s in ready:
            i = socks.index(s)
            data = s.recv(65536)
            assert data, f"a stream ended while its pace was measured: {got[i][-300:]!r}"
            now = time.monotonic()
            if first[i] is None:
                first[i] = now  # the head and what the prefill's wait piled up: not counted
            else:
                counted[i] += len(data)
            last[i] = now
            got[i] += data
    return min(counted[i] / (last[i] - (first[i] or 0.0)) for i in range(len(socks)))


def slow_read_bound(pace: float, rate: float, buffered: int, sent: int) -> float:
    """Seconds after a reader drops from the generation's `pace` to `rate` (bytes/s) by which the server must have
    cut it: the kernels' buffers (`buffered` bytes at most) fill at pace - rate, then the writes wait 1 - rate/pace
    of the time until that adds up to SEND_TIMEOUT plus a second per MIN_SEND_RATE bytes sent (`sent` before the
    drop, the buffers and what the reader takes meanwhile). The pace may have dropped by PACE_DROP meanwhile."""
    pace *= PACE_DROP
    assert pace > rate, (pace, rate)
    fill = buffered / (pace - rate)
    allowance = SEND_TIMEOUT + (sent + buffered + rate * fill) / MIN_SEND_RATE
    return fill + allowance / (1 - rate / pace - rate / MIN_SEND_RATE)


def test_a_stream_read_slowly_loses_its_connection(srv, model_name):
    """Two streams whose clients (with a small receive buffer) read at a third of the generation's pace, measured
    first on these streams: the response's total wait on them passes its budget, so the server resets them once
    the buffers are full and about the send timeout was waited (slow_read_bound), and cancels their sequences;
    meanwhile a normal completion and the liveness probe are answered. A fixed reading pace proved nothing on a box
    whose generation is no faster than it (7 tokens/s, 2 KB/s of SSE, on a loaded 2-core Zen 3): no write ever
    waited, the client kept up."""
    cancelled = srv.metrics().get("appliance_sequences_cancelled_total", 0)
    body = generation_body(model_name, max_tokens=4000, ignore_eos=True, stream=True)
    socks = [connect(srv, "127.0.0.3", rcvbuf=2048) for _ in range(2)]
    for s in socks:
        s.sendall(post_head(len(body)) + body)
    got = [b"", b""]
    pace = full_speed_pace(socks, got, PACE_BYTES)
    rate = min(SLOW_READ_RATE, pace / SLOWER)
    chunk = max(1, round(rate * READ_EVERY))
    # the server's send buffer as the worker sets it (Linux doubles it) and the clients' receive buffers: in bytes
    # of kernel memory, so at most that much payload
    buffered = 2 * STREAM_SEND_BUFFER + max(s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) for s in socks)
    bound = slow_read_bound(pace, rate, buffered, max(len(g) for g in got))
    started = time.monotonic()
    closed_at: list[float | None] = [None, None]
    try:
        checked_victim = False
        while time.monotonic() - started < bound + MARGIN + 5 and None in closed_at:
            for i, s in enumerate(socks):
                if closed_at[i] is not None:
                    continue
                s.settimeout(READ_EVERY)
                try:
                    data = s.recv(chunk)
                except TimeoutError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    closed_at[i] = time.monotonic() - started
                got[i] += data
            if not checked_victim and time.monotonic() - started > 4:
                checked_victim = True
                elapsed, status = victim_served(srv, model_name)
                assert status == 200 and elapsed < 15, (status, elapsed)
                elapsed, status = live(srv)
                assert status == 200 and elapsed < LIVE_BOUND, (status, elapsed)
            time.sleep(READ_EVERY)  # at most `chunk` bytes per stream each READ_EVERY: at most `rate`
    finally:
        for s in socks:
            s.close()
    print(
        f"slow readers: generation {pace:.0f} B/s, read at {rate:.0f} B/s; closed after {closed_at} s "
        f"(bound {bound:.1f} s + {MARGIN} s), {[len(g) for g in got]} bytes read"
    )
    assert all(g.startswith(b"HTTP/1.1 200") for g in got), [g[:100] for g in got]
    assert not any(b"[DONE]" in g for g in got)  # cut, not finished
    # The old per-write bound never cut them: each write waited less than SEND_TIMEOUT, and 4000 tokens read at a
    # third of their pace are minutes of stream.
    assert all(t is not None and t < bound + MARGIN for t in closed_at), (closed_at, bound)
    wait_until(
        lambda: (m := srv.metrics())["appliance_running_sequences"] == 0
        and m.get("appliance_sequences_cancelled_total", 0) >= cancelled + 2,
        "the slow streams to be cancelled",
        timeout=30,
    )
    wait_until(lambda: dropped(srv, "send_timeout") >= 2, "the drops to be counted in /metrics", timeout=10)


def test_unfinished_bodies_filling_the_budget_do_not_make_probes_503(srv, model_name):
    """Unfinished 4 MiB bodies fill the worker's 64 MiB read budget to the byte: 5 from one address, then 16 from
    16 others. The largest (the oldest among equals) are shed with 503, never the newcomers: the probes and a
    normal completion answer 200 while the bodies are held. The address with 5 bodies keeps at most its 16 MiB
    share."""
    length = BODY
    request = post_head(length)
    request += b"x" * (length - len(request))  # 4 MiB buffered per connection, its body a head's length short

    def send(s: socket.socket) -> None:
        try:
            s.sendall(request)
        except OSError:  # closed by the server meanwhile: what the assertions below look at
            pass

    greedy = [connect(srv, "127.0.2.1") for _ in range(5)]
    for s in greedy:
        send(s)
    held = [connect(srv, f"127.0.1.{i + 1}") for i in range(16)]
    for s in held:
        send(s)
    before = time.monotonic()
    try:
        time.sleep(1.0)  # the worker read them all
        for path in ("/v2/health/live", "/v2/health/ready", f"/v2/models/{model_name}/ready"):
            r = requests.get(srv.base + path, timeout=10)
            assert r.status_code == 200, (path, r.status_code)
        elapsed, status = victim_served(srv, model_name)
        assert status == 200, status
        assert time.monotonic() - before < REQUEST_TIMEOUT, "the check must run while the bodies are held"
        assert sum(is_closed(s) for s in greedy) >= 1
        assert sum(is_closed(s) for s in held) < len(held)
    finally:
        for s in held + greedy:
            s.close()
    wait_until(
        lambda: dropped(srv, "budget_shed") >= 1 and dropped(srv, "client_bytes") >= 1,
        "the sheds to be counted in /metrics",
        timeout=10,
    )


def test_concurrent_generations_per_key_and_address_are_capped(srv, model_name):
    """--client-max-generations 3: a fourth concurrent stream from the same address, or with the same key from
    another address, gets 429 in OpenAI's error shape; other clients are served, and the cap frees as streams end."""
    body = generation_body(model_name, max_tokens=4000, ignore_eos=True, stream=True)

    def stream(source: str, key: str | None = None) -> socket.socket:
        s = connect(srv, source)
        s.sendall(post_head(len(body), *([f"Authorization: Bearer {key}"] if key else [])) + body)
        return s

    def answer(s: socket.socket) -> bytes:
        s.settimeout(30)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        return data

    holders = [stream("127.0.3.1") for _ in range(MAX_GENERATIONS)]
    try:
        for s in holders:
            assert answer(s).startswith(b"HTTP/1.1 200")
        fourth = stream("127.0.3.1")
        reply = answer(fourth) + fourth.recv(4096)
        fourth.close()
        assert reply.startswith(b"HTTP/1.1 429"), reply[:200]
        error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        elapsed, status = victim_served(srv, model_name)  # another address: served
        assert status == 200, status
    finally:
        for s in holders:
            s.close()
    keyed = [stream(f"127.0.4.{i + 1}", "key-a") for i in range(MAX_GENERATIONS)]
    try:
        for s in keyed:
            assert answer(s).startswith(b"HTTP/1.1 200")
        fourth = stream("127.0.4.9", "key-a")
        assert answer(fourth).startswith(b"HTTP/1.1 429")
        fourth.close()
        other_key = stream("127.0.4.10", "key-b")
        assert answer(other_key).startswith(b"HTTP/1.1 200")
        other_key.close()
    finally:
        for s in keyed:
            s.close()
    wait_until(lambda: srv.metrics()["appliance_running_sequences"] == 0, "the streams to end", timeout=30)
    again = stream("127.0.3.1")  # the cap was given back when the streams ended
    try:
        assert answer(again).startswith(b"HTTP/1.1 200")
    finally:
        again.close()


TOO_LARGE = "The request head is over 64 KiB"


def test_anthropic_and_ollama_clients_read_the_edges_refusals_in_their_apis_shape(srv, model_name):
    """The edge answers a key past its cap (429) and a head too large (431) before Flask sees the request, in the
    API's error shape: the real Anthropic and Ollama clients read the type their SDK classifies by and the message
    their users read. (Their generations counting against the cap, and every refusal read by both clients:
    test_edge_intake.py.)"""
    import anthropic
    import ollama

    def hold(source: str) -> socket.socket:
        data = generation_body(model_name, max_tokens=4000, ignore_eos=True, stream=True)
        s = connect(srv, source)
        s.sendall(post_head(len(data), "Authorization: Bearer key-z") + data)
        s.settimeout(30)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        return s

    chat = [{"role": "user", "content": "Tell me a long story"}]
    holders = [hold(f"127.0.6.{i + 1}") for i in range(MAX_GENERATIONS)]
    url = f"http://127.0.0.1:{srv.port}"
    try:
        messages = anthropic.Anthropic(base_url=url, api_key="key-z", max_retries=0).messages
        with pytest.raises(anthropic.RateLimitError) as limited:
            messages.create(model=model_name, max_tokens=4, messages=chat)
        assert limited.value.body["type"] == "error"
        assert limited.value.body["error"]["type"] == "rate_limit_error"
        assert "Too many generation requests" in limited.value.message
        with pytest.raises(ollama.ResponseError) as refused:
            ollama.Client(host=url, headers={"Authorization": "Bearer key-z"}).chat(model=model_name, messages=chat)
        assert refused.value.status_code == 429 and refused.value.error.startswith("Too many generation requests")
    finally:
        for s in holders:
            s.close()
    for path, error in (
        ("/v1/messages", {"type": "error", "error": {"type": "invalid_request_error", "message": TOO_LARGE}}),
        ("/api/chat", {"error": TOO_LARGE}),
    ):  # a head still unfinished past 64 KiB (a finished one goes to gunicorn's parser, which has lower limits)
        s = connect(srv, "127.0.6.9")
        s.settimeout(30)
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ".encode() + b"y" * (65 * 1024))
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
        s.close()
        assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1]) == error


def test_invented_methods_add_no_metric_series(srv):
    """Unauthenticated requests with made-up methods are all counted under method "other": no new series."""
    for i in range(10):
        s = connect(srv, "127.0.5.1")
        try:
            s.sendall(f"ZQX{i:02d} /v3/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
            s.settimeout(10)
            assert s.recv(65536).startswith(b"HTTP/1.1 ")
        finally:
            s.close()
    text = requests.get(srv.base + "/metrics", timeout=10).text
    assert "ZQX" not in text
    assert 'method="other"' in text


def test_liveness_needs_no_engine_round_trip(srv):
    """The engine process stopped (SIGSTOP, as a long GIL hold would): /v2/health/live still answers at once, as
    it records itself in a batch, later; the records arrive once the engine runs again."""
    key = 'appliance_http_requests_total{method="GET",route="/v2/health/live",status="200"}'
    before = srv.metrics().get(key, 0)
    os.kill(srv.pid, signal.SIGSTOP)
    try:
        for _ in range(5):
            elapsed, status = live(srv)
            assert status == 200 and elapsed < LIVE_BOUND, (status, elapsed)
    finally:
        os.kill(srv.pid, signal.SIGCONT)
    wait_until(lambda: srv.metrics().get(key, 0) >= before + 5, "the probes to be counted", timeout=20)


def test_one_address_cannot_take_the_workers_connections(srv):
    """--client-max-connections: past it, an address's new connections get 503 and are closed at once; another
    address (the probe) is served."""
    # an address no other test uses: a generation another test held from 127.0.6.1 may still count against it
    # while its worker notices the close (the tests run in random order)
    socks = [connect(srv, "127.0.61.1") for _ in range(MAX_CONNECTIONS + 5)]
    try:
        time.sleep(1.0)  # accepted (or refused) by the worker
        refused = [s for s in socks if is_closed(s)]
        assert len(refused) == 5, len(refused)
        assert all(not is_closed(s) for s in socks[:MAX_CONNECTIONS])
        elapsed, status = live(srv)
        assert status == 200 and elapsed < LIVE_BOUND, (status, elapsed)
    finally:
        for s in socks:
            s.close()
    wait_until(lambda: dropped(srv, "client_connections") >= 5, "the refusals to be counted", timeout=10)


def test_a_full_worker_sheds_its_oldest_connection_not_the_newcomer(model_dir, tmp_path):
    """1000 silent connections from 20 addresses (50 each, under the per-address cap) bring a worker to gunicorn's
    worker_connections, where gthread stops accepting: the oldest are closed to make room, so a probe is answered
    at once instead of after --request-timeout."""
    with one_worker_server(model_dir, tmp_path / "serve.log", threads=4, request_timeout=30) as server:
        socks = [connect(server, f"127.0.8.{i // 50 + 1}") for i in range(1000)]
        try:
            time.sleep(1.0)  # accepted by the worker
            for _ in range(3):
                elapsed, status = live(server)
                assert status == 200 and elapsed < LIVE_BOUND, (status, elapsed)
            assert 1 <= sum(is_closed(s) for s in socks) < 100
        finally:
            for s in socks:
                s.close()
        wait_until(lambda: dropped(server, "connections_full") >= 1, "the sheds to be counted", timeout=10)
