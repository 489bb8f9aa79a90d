"""No request can hurt another, on a real server: hostile and broken clients against live traffic.

Each test starts what a careless or hostile client does next to well-behaved ones and checks that the
well-behaved ones are served (complete, in bounded time) and that the server's resources come back. Two servers:
`hostile` (module-wide, short edge timeouts, fault injection on) and, for the engine-death drill, one of its own.

Timing bounds hold on a loaded 2-core box, where a short completion beside 30 streams can take seconds, and still
catch the failure each guards, which costs far more: a thread held by a slow client until the 30 s request
timeout, an engine connection waiting behind 20 stalled handshakes of HANDSHAKE_SECONDS each, a call that never
returns.
"""

from __future__ import annotations

import resource
import socket
import threading
import time
from pathlib import Path

import pytest
import requests

from appliance import protocol as p
from appliance.http.client import EngineClient, EngineUnavailable
from appliance.settings import SOCKET_FILE
from tests.helpers import Server, engine_client, runtime_dir, sse_events, wait_until

pytestmark = pytest.mark.slow

SEND_TIMEOUT = 4  # the hostile server's --send-timeout: how long a stream may make no progress


def complete(server: Server, model: str, timeout: float, **body) -> requests.Response:
    return requests.post(
        f"{server.base}/v3/completions",
        json={"model": model, "prompt": "The capital of France is", "max_tokens": 8, **body},
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def hostile(model_dir, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv(p.FAULT_INJECTION_ENV, "1")
    with Server(
        model_dir,
        tmp_path_factory.mktemp("hostile") / "serve.log",
        "--workers",
        "2",
        "--send-timeout",
        str(SEND_TIMEOUT),
        "--request-timeout",
        "30",
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def name(hostile) -> str:
    return hostile.model_id()


# ---------------------------------------------------------------- the engine socket


def test_engine_socket_outlives_broken_and_stalled_peers(hostile, name):
    """A worker killed mid-handshake, garbage instead of the handshake, peers that never answer it: each costs
    its own connection only. A fresh worker connection is still accepted and answered at once."""
    path = str(runtime_dir(hostile) / SOCKET_FILE)

    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        return s

    for _ in range(5):  # gone before the challenge is answered (EOFError in the engine)
        connect().close()
    with connect() as s:  # a wrong answer (AuthenticationError, or a malformed message)
        s.recv(64)
        s.sendall(b"\x00\x00\x00\x10" + b"x" * 16)
    stalled = [connect() for _ in range(20)]  # connected, silent: each waits out the handshake timeout alone
    try:
        started = time.monotonic()
        status = engine_client(hostile).status()
        assert status.ready, status
        # behind even one stalled handshake it would wait HANDSHAKE_SECONDS (5 s); behind all 20, 100 s
        assert time.monotonic() - started < 4.0, "a fresh engine connection waited behind stalled ones"
        r = complete(hostile, name, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        for s in stalled:
            s.close()
    # the stalled ones are dropped by the engine after the handshake timeout (their sockets see EOF)
    wait_until(lambda: engine_client(hostile).status().ready, "the engine to keep answering")


def test_engine_calls_are_bounded(hostile):
    """A worker's call to an engine that does not answer fails after its timeout instead of hanging."""
    runtime = runtime_dir(hostile)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as fake:  # an "engine" that accepts and never talks
        fake_path = str(runtime.parent / f"fake-engine-{time.monotonic_ns()}.sock")
        fake.bind(fake_path)
        fake.listen(4)
        try:
            client = EngineClient(fake_path, b"k" * 32)
            started = time.monotonic()
            with pytest.raises(EngineUnavailable, match="engine"):  # a clean refusal, not a hang or another error
                client.status()
            assert time.monotonic() - started < p.HANDSHAKE_SECONDS + 10  # unbounded, it would never return
        finally:
            Path(fake_path).unlink(missing_ok=True)


# ---------------------------------------------------------------- a dead engine loop


def test_a_dead_engine_loop_fails_readiness_and_exits_nonzero(model_dir, tmp_path, monkeypatch):
    """The engine thread dies (a bug, injected): readiness answers 503 at once, a stream in flight ends with an
    error instead of hanging, and the process exits non-zero (systemd / Docker then restart it)."""
    monkeypatch.setenv(p.FAULT_INJECTION_ENV, "1")
    srv = Server(model_dir, tmp_path / "serve.log")
    try:
        srv.wait_ready()
        model = srv.model_id()
        outcome: dict = {}

        def stream():
            try:
                with requests.post(
                    f"{srv.base}/v3/completions",
                    stream=True,
                    timeout=120,
                    json={
                        "model": model,
                        "prompt": "Count to a thousand:",
                        "max_tokens": 2000,
                        "ignore_eos": True,
                        "stream": True,
                    },
                ) as r:
                    outcome["status"] = r.status_code
                    outcome["events"] = sse_events(r)
            except requests.RequestException as exc:  # the server went away mid-stream: also an end
                outcome["error"] = repr(exc)

        t = threading.Thread(target=stream)
        t.start()
        wait_until(
            lambda: srv.metrics().get("appliance_running_sequences", 0) >= 1 or not t.is_alive(), "the stream to start"
        )
        engine_client(srv).call(p.FAULT, "loop")
        codes: list = []
        wait_until(lambda: codes.append(_ready_code(srv)) or codes[-1] != 200, "readiness to fail", timeout=10)
        assert codes[-1] in (503, None)  # None: already gone
        t.join(timeout=60)
        assert not t.is_alive(), "a stream in flight hung when the engine died"
        events = outcome.get("events") or []
        assert "error" in outcome or any(isinstance(e, dict) and "error" in e for e in events), outcome
        code = srv.proc.wait(timeout=90)
        assert code != 0, srv.output()
        assert "the engine loop died" in srv.output()
    finally:
        srv.kill()


def _ready_code(srv: Server) -> int | None:
    try:
        return requests.get(f"{srv.base}/v2/health/ready", timeout=5).status_code
    except requests.RequestException:
        return None


# ---------------------------------------------------------------- one request's work, others' streams


def _stream_tokens(server: Server, model: str, max_tokens: int, results: list, i: int) -> None:
    """A well-behaved streaming client: its events, kept in results[i]."""
    with requests.post(
        f"{server.base}/v3/completions",
        stream=True,
        timeout=300,
        json={
            "model": model,
            "prompt": f"Story number {i}:",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as r:
        results[i] = (r.status_code, sse_events(r))


def _finished_normally(result, max_tokens: int) -> bool:
    status, events = result
    chunks = [e for e in events if isinstance(e, dict)]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    return (
        status == 200
        and events[-1] == "[DONE]"
        and not any("error" in c for c in chunks)
        and finish[-1] == "length"
        and chunks[-1]["usage"]["completion_tokens"] == max_tokens
    )


def test_a_poisoned_request_among_live_streams_fails_alone(hostile, name):
    """The review's reproducer: a 100-byte beam request with length_penalty 2000 used to abort every running
    sequence. Now it is refused at the edge (and the engine would fail it alone: test_engine_faults.py); the 8
    streams next to it finish normally, whole."""
    results: list = [None] * 8
    threads = [threading.Thread(target=_stream_tokens, args=(hostile, name, 48, results, i)) for i in range(8)]
    for t in threads:
        t.start()
    wait_until(lambda: hostile.metrics().get("appliance_running_sequences", 0) >= 4, "the streams to run")
    for body in (
        {"best_of": 2, "length_penalty": 2000},
        {"best_of": 2, "length_penalty": -2000},
        {"best_of": 2, "stop_token_ids": list(range(10_000))},
    ):
        r = complete(hostile, name, timeout=30, max_tokens=5, **body)
        assert r.status_code == 400, r.text
    for t in threads:
        t.join(timeout=300)
    assert all(r is not None and _finished_normally(r, 48) for r in results), results


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "M", "prompt": "\\ud800"}',  # a lone surrogate
        b'{"model": "M", "prompt": "x", "temperature": 1' + b"0" * 400 + b"}",  # a 400-digit number
        b'{"model": "M", "prompt": "x", "timeout": 1' + b"0" * 400 + b"}",
        b'{"model": "M", "prompt": "x", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # deep nesting
        b'{"model": "M", "prompt": [' + b",".join([b'"a"'] * 300_000) + b"]}",  # 300k prompts
        b'{"model": "M", "prompt": "x", "logit_bias": {"01": 1, "1": 2}}',  # colliding keys
        b'{"model": "M", "prompt": "x", "stop": ["' + b"s" * 100_000 + b'"]}',  # a 100k-character stop
        b'{"model": "M", "messages": [{"role": "user", "content": "\\udfff"}]}',
    ],
    ids=[
        "surrogate",
        "big-int",
        "big-int-timeout",
        "nested",
        "prompt-list",
        "logit-bias-keys",
        "stop-length",
        "chat-surrogate",
    ],
)
def test_bad_inputs_are_4xx(hostile, name, body):
    url = "/v3/chat/completions" if b"messages" in body else "/v3/completions"
    r = requests.post(
        hostile.base + url,
        data=body.replace(b'"M"', f'"{name}"'.encode()),
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert complete(hostile, name, timeout=30).status_code == 200


def test_a_prompt_list_times_n_bomb_is_refused_before_anything_is_built(hostile, name):
    """256 prompts (the limit) x n = 20 is 5,120 sequences, far past the queue: refused at once (400: it could
    never be queued), in the worker, and the engine process does not grow (nothing was tokenized or built)."""
    from tests.helpers import rss_mb

    before = rss_mb(hostile.pid)
    for _ in range(5):
        started = time.monotonic()
        r = complete(hostile, name, timeout=30, prompt=["a " * 2000] * 256, n=20)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text[:300]
        assert time.monotonic() - started < 15  # the body's transfer and JSON; building it shows in the RSS
    assert rss_mb(hostile.pid) - before < 50
    assert hostile.metrics()["appliance_queue_depth"] == 0


# ---------------------------------------------------------------- slow and stalled clients


def _trickle(sockets: list[socket.socket], stop: threading.Event) -> None:
    """Slowloris: each socket sent part of a request head; one more header byte each, every second."""
    while not stop.wait(1.0):
        for s in sockets:
            try:
                s.send(b"x")
            except OSError:
                pass


def _stalled_stream(server: Server, model: str) -> socket.socket:
    """A streaming client that never reads: a 4 KiB receive window, a request, then silence."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", server.port))
    body = (
        f'{{"model": "{model}", "prompt": "Write a long story:", "max_tokens": 4000, "ignore_eos": true, '
        f'"stream": true}}'
    ).encode()
    s.sendall(
        b"POST /v3/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    return s


def test_slow_headers_and_stalled_streams_do_not_take_the_box(hostile, name):
    """100 connections trickle a request head, 30 streams stop reading: a normal request still answers in < 15 s
    and health in < 10 s (a thread held by a slow client would make them wait for the 30 s request timeout: past
    the client's 20 s); the stalled streams are cancelled (send timeout) and every KV block comes back."""
    cancelled = hostile.metrics().get("appliance_sequences_cancelled_total", 0)
    slow = []
    for _ in range(100):
        s = socket.create_connection(("127.0.0.1", hostile.port))
        s.sendall(b"POST /v3/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        slow.append(s)
    stop = threading.Event()
    trickler = threading.Thread(target=_trickle, args=(slow, stop), daemon=True)
    trickler.start()
    stalled = [_stalled_stream(hostile, name) for _ in range(30)]
    try:
        wait_until(lambda: hostile.metrics().get("appliance_running_sequences", 0) >= 25, "the stalled streams")
        for _ in range(3):
            started = time.monotonic()
            assert requests.get(f"{hostile.base}/v2/health/ready", timeout=20).status_code == 200
            assert time.monotonic() - started < 10.0
            started = time.monotonic()
            assert complete(hostile, name, timeout=20).status_code == 200
            assert time.monotonic() - started < 15.0
        # KV is freed on the engine thread, each cancel counted as its last chunk passes a pump thread: wait for both
        wait_until(
            lambda: (m := hostile.metrics())["appliance_kv_cache_blocks_used"] == 0
            and m["appliance_sequences_cancelled_total"] - cancelled >= 30,
            "the stalled streams to be cancelled and their KV freed",
            timeout=120,
        )
        assert hostile.metrics()["appliance_running_sequences"] == 0
    finally:
        stop.set()
        for s in slow + stalled:
            s.close()


def test_requests_on_sockets_past_fd_1024_are_served(model_dir, tmp_path):
    """Past 1023 open fds, select() cannot watch a socket: a disconnect check based on it cancelled every request
    there as if its client had left. With 1,100 idle connections open, a request on a fd above 1024 runs to its end."""
    from appliance.server.supervisor import raise_fd_limit

    raise_fd_limit()  # this test process holds the 1,100 client sockets (the server raises its own limit alike)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft > 1300, f"RLIMIT_NOFILE hard limit {soft}: this drill needs more than 1300 fds"
    srv = Server(model_dir, tmp_path / "serve.log", "--threads", "600", "--request-timeout", "120")
    idle = []
    try:
        srv.wait_ready()
        model = srv.model_id()
        for _ in range(1100):
            idle.append(socket.create_connection(("127.0.0.1", srv.port)))
        worker = next(iter(srv.workers()))
        wait_until(lambda: len(list(Path(f"/proc/{worker}/fd").iterdir())) > 1100, "the worker to accept them")
        r = complete(srv, model, timeout=120, max_tokens=64, ignore_eos=True)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 64
    finally:
        for s in idle:
            s.close()
        srv.close()
