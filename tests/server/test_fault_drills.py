"""The faults an unattended box meets, on a real server, with what systemd would see: its notify socket.

systemd is not running here, so a datagram socket stands in for it: the server gets $NOTIFY_SOCKET and a short
$WATCHDOG_USEC as a `Type=notify`, `WatchdogSec=` unit would give them, and the socket receives the sender's
credentials (SO_PASSCRED) as systemd's does for NotifyAccess=main. The drills:
- start-up: READY=1 once, after the load (readiness answers 200 then), keep-alives before and after it, every
  message from the main process (gunicorn, our child, would otherwise announce READY=1 before any model loaded);
- a gunicorn worker SIGKILLed mid-stream: a new worker serves within seconds, the engine drops the orphaned job;
- the engine loop dies (fault injection): the keep-alives stop and the process exits non-zero, freeing the port
  (test_hostile.py checks what clients see then);
- the engine process SIGKILLed: gunicorn and its workers exit within seconds (PR_SET_PDEATHSIG) and the port is
  free for the restarted server.
A SIGTERM during a stream (it completes, exit 0) is test_server_e2e.py's test_graceful_sigterm_finishes_inflight_stream.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from appliance import protocol as p
from appliance.testing.procinfo import is_zombie
from tests.helpers import Server, engine_client, wait_until

pytestmark = pytest.mark.slow

WATCHDOG_USEC = 400_000  # a keep-alive every 0.2 s
RECOVERY_SECONDS = 10  # "within seconds": each drill measures its own time (printed with -s)


class FakeSystemd:
    """systemd's end of $NOTIFY_SOCKET: every datagram with its sender's PID, collected by a thread."""

    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(str(path))
        self.messages: list[tuple[float, int, str]] = []  # (monotonic time, sender PID, message)
        threading.Thread(target=self._receive, daemon=True).start()

    def _receive(self) -> None:
        while True:
            try:
                data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except OSError:
                return
            pid = next(
                struct.unpack("3i", d)[0]
                for level, kind, d in ancillary
                if (level, kind) == (socket.SOL_SOCKET, socket.SCM_CREDENTIALS)
            )
            self.messages.append((time.monotonic(), pid, data.decode()))

    def since(self, t: float) -> list[str]:
        return [m for when, _, m in list(self.messages) if when >= t]

    def close(self) -> None:
        self.sock.close()


def first(messages: list[str], prefix: str) -> int | None:
    return next((i for i, m in enumerate(messages) if m.startswith(prefix)), None)


@pytest.fixture
def watched(model_dir, tmp_path) -> Iterator[tuple[Server, FakeSystemd]]:
    """A server of its own for each drill (1 worker, fault injection on) started as systemd would start the unit:
    a drill kills a worker or the engine loop, and the next one must not meet that server (a start is ~3 s)."""
    tmp = tmp_path
    systemd = FakeSystemd(tmp / "notify")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("NOTIFY_SOCKET", str(tmp / "notify"))
        env.setenv("WATCHDOG_USEC", str(WATCHDOG_USEC))
        env.setenv(p.FAULT_INJECTION_ENV, "1")
        srv = Server(model_dir, tmp / "serve.log", "--workers", "1")
    try:
        wait_until(lambda: "READY=1\nSTATUS=serving" in systemd.since(0) or srv.proc.poll() is not None, "READY=1", 300)
        yield srv, systemd
    finally:
        srv.close()
        systemd.close()


def ready_code(srv: Server) -> int | None:
    try:
        return requests.get(f"{srv.base}/v2/health/ready", timeout=5).status_code
    except requests.RequestException:
        return None


def long_stream(srv: Server) -> requests.Response:
    """A completion streaming 2000 tokens, its first event already read."""
    r = requests.post(
        f"{srv.base}/v3/completions",
        stream=True,
        timeout=60,
        json={"model": srv.model_id(), "prompt": "Count:", "max_tokens": 2000, "ignore_eos": True, "stream": True},
    )
    assert r.status_code == 200 and next(line for line in r.iter_lines() if line).startswith(b"data: ")
    return r


def drain(r: requests.Response) -> None:
    """Reads what is left of a stream whose server side died: an error or a short end, never a hang."""
    try:
        for _ in r.iter_lines():
            pass
    except requests.RequestException:
        pass


def test_ready_comes_after_the_load_with_keepalives_from_the_main_process_only(watched):
    srv, systemd = watched
    assert ready_code(srv) == 200, srv.output()  # asked right after READY=1 arrived: it means serving
    messages = systemd.since(0)
    assert messages[0] == "STATUS=loading the model"
    assert [m for m in messages if m.startswith("READY=1")] == ["READY=1\nSTATUS=serving"]
    assert first(messages, "WATCHDOG=1") < first(messages, "READY=1")  # the load is watched too
    assert {pid for _, pid, _ in systemd.messages} == {srv.pid}, "a child spoke to systemd (NotifyAccess=main)"
    t = time.monotonic()
    time.sleep(1)
    assert systemd.since(t).count("WATCHDOG=1") >= 3


def test_a_killed_worker_is_replaced_and_serving_resumes(watched):
    srv, systemd = watched
    (old,) = srv.workers()
    stream = long_stream(srv)
    os.kill(old, signal.SIGKILL)
    killed = time.monotonic()
    drain(stream)

    def served() -> bool:
        try:
            r = requests.post(
                f"{srv.base}/v3/completions",
                json={"model": srv.model_id(), "prompt": "Hello", "max_tokens": 4},
                timeout=10,
            )
            return r.status_code == 200
        except requests.RequestException:
            return False

    wait_until(served, "a completion after the worker was killed", timeout=RECOVERY_SECONDS)
    print(f"\nworker SIGKILL -> served again in {time.monotonic() - killed:.2f} s")
    assert srv.workers() and old not in srv.workers()
    wait_until(lambda: srv.metrics().get("appliance_running_sequences", 0) == 0, "the orphaned job to end", 30)
    t = time.monotonic()
    time.sleep(0.6)
    assert "WATCHDOG=1" in systemd.since(t)  # the engine is untouched


def test_a_dead_engine_loop_stops_the_keepalives_and_frees_the_port(watched):
    srv, systemd = watched
    t = time.monotonic()
    engine_client(srv).call(p.FAULT, "loop")
    code = srv.proc.wait(timeout=60)
    assert code != 0, srv.output()
    after = systemd.since(t)
    unhealthy = first(after, "STATUS=unhealthy")
    assert unhealthy is not None, after
    assert "WATCHDOG=1" not in after[unhealthy:]  # systemd would kill a process that still hangs on
    assert_port_free(srv)


def assert_port_free(srv: Server) -> None:
    """A restarted server can listen on the port (with SO_REUSEADDR, as gunicorn does): no process holds it."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", srv.port))
        s.listen()


def test_a_killed_engine_process_takes_gunicorn_with_it_and_frees_the_port(model_dir, tmp_path):
    srv = Server(model_dir, tmp_path / "serve.log", "--workers", "2")
    try:
        srv.wait_ready()
        stream = long_stream(srv)
        tree = srv.process_tree()
        assert len(tree) == 4  # engine, arbiter, 2 workers
        os.kill(srv.pid, signal.SIGKILL)
        killed = time.monotonic()
        srv.proc.wait(timeout=10)
        drain(stream)
        wait_until(
            lambda: all(is_zombie(q) for q in tree[1:]),  # gone, or exited and waiting for init to reap it
            "gunicorn to exit after the engine process",
            timeout=RECOVERY_SECONDS,
        )
        print(f"\nengine SIGKILL -> gunicorn and workers gone in {time.monotonic() - killed:.2f} s")
        assert_port_free(srv)
    finally:
        srv.close()
