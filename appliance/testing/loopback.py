"""A server subprocess on a free loopback port, the harness the tests and the benchmarks share: start command
and environment, readiness wait, SIGTERM stop, its log, /metrics parsed.

The server does not use this. It lives in the package for the reason procinfo does: tests and bench import
the same code without importing each other. `requests` (a test and bench extra) is imported where used.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # this checkout: put on the server's PYTHONPATH


class ServerNotReady(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {"name{labels}": value}."""
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


class LoopbackServer:
    """`command(port)` started with its output in `log_path`; `with LoopbackServer(...) as srv:` waits until GET
    `ready_path` answers 200 and stops it with SIGTERM at the end."""

    what = "server"
    ready_path = "/"

    def __init__(
        self,
        command: Callable[[int], list[str]],
        log_path: Path,
        *,
        env: dict | None = None,
        start_timeout: float = 300,
    ):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        self.start_timeout = start_timeout
        self.startup_answers: list = []  # every readiness answer before the 200 (the tests check the 503s)
        self.proc = subprocess.Popen(
            command(self.port), stdout=self._log, stderr=subprocess.STDOUT, env=env or dict(os.environ), cwd=ROOT
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self, since: int = 0) -> str:
        """The log (stdout + stderr): its last 6000 characters, or everything past byte `since`."""
        data = self.log_path.read_bytes()
        return data[since:].decode(errors="replace") if since else data.decode(errors="replace")[-6000:]

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def wait_ready(self):
        import requests

        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerNotReady(f"{self.what} exited with {self.proc.returncode}:\n{self.output()}")
            try:
                r = requests.get(self.base + self.ready_path, timeout=5)
            except requests.ConnectionError:
                time.sleep(0.2)
                continue
            self.startup_answers.append(r)
            if r.status_code == 200:
                return self
            time.sleep(0.2)
        self.kill()
        raise ServerNotReady(f"{self.what} not ready after {self.start_timeout}s:\n{self.output()}")

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM, as systemd sends; SIGKILL if it is still running after `timeout` s. The exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self):
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


class ApplianceServer(LoopbackServer):
    """`python -m appliance.cli serve` from this checkout: engine process -> gunicorn arbiter -> workers."""

    what = "appliance serve"
    ready_path = "/v2/health/ready"

    def __init__(self, model_dir: Path, *args: str, log_path: Path, start_timeout: float = 300):
        def command(port: int) -> list[str]:
            return [
                sys.executable,
                "-m",
                "appliance.cli",
                "serve",
                "--model",
                str(model_dir),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                *args,
            ]

        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        super().__init__(command, log_path, env=env, start_timeout=start_timeout)

    def model_id(self) -> str:
        """The name the server serves its model under (what requests put in "model")."""
        import requests

        return requests.get(self.base + "/v3/models", timeout=30).json()["data"][0]["id"]

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        import requests

        return parse_metrics(requests.get(self.base + "/metrics", headers=headers, timeout=30).text)
