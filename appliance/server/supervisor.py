"""`appliance serve`'s process: it is the engine process, and gunicorn is its child.

Start order: private runtime dir (socket, authkey, settings) -> engine socket listening -> gunicorn (answers
503 while loading) -> model load + warm-up -> ready. Stop: SIGTERM/SIGINT is forwarded to gunicorn, whose
workers finish their in-flight requests (up to graceful_timeout); then the engine shuts down. Being the parent
means the engine cannot be orphaned by gunicorn, and gunicorn gets SIGTERM from the kernel if we die
(PR_SET_PDEATHSIG, set in gunicorn_conf).

If the engine loop dies (a bug: per-request errors are isolated inside the engine), readiness turns 503 at once,
gunicorn is stopped and the process exits 1, so systemd's Restart=on-failure or Docker's restart policy brings
up a fresh one: a server that cannot generate must not look alive.
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import appliance
from appliance.config import EngineConfig
from appliance.params import SamplingParams
from appliance.server import logs, sdnotify
from appliance.server.engine_service import EngineService
from appliance.server.metrics import ServerMetrics
from appliance.server.settings import AUTHKEY_FILE, RUNTIME_DIR_ENV, ServeSettings

log = logging.getLogger("appliance.serve")

WARMUP_PROMPT = "Hello"


def _default_engine(model_dir: str, config: EngineConfig):
    from appliance.engine import Engine  # heavy (OpenVINO): only in this process

    return Engine(model_dir, config)


class Supervisor:
    def __init__(self, settings: ServeSettings, engine_config: EngineConfig, engine_factory=_default_engine):
        self.settings, self.engine_config, self.engine_factory = settings, engine_config, engine_factory
        self.service = EngineService(settings, ServerMetrics())
        self.engine = None
        self.gunicorn: subprocess.Popen | None = None
        self.stopping = threading.Event()
        self.load_failed = False
        self.engine_died = False
        self._lock = threading.Lock()

    def run(self) -> int:
        self._install_signals()  # first: a SIGTERM during start-up still stops gunicorn and cleans up below
        runtime = Path(tempfile.mkdtemp(prefix="appliance-"))  # mode 0700: only this user
        try:
            key = runtime / AUTHKEY_FILE
            key.write_bytes(os.urandom(32))
            key.chmod(0o600)
            self.settings.runtime_dir, self.settings.supervisor_pid = str(runtime), os.getpid()
            self.settings.save()
            raise_fd_limit()
            self.service.start()
            sdnotify.start_watchdog(self.healthy)
            self.gunicorn = self._start_gunicorn()
            if self.stopping.is_set():  # a signal before this point found no gunicorn to stop
                self._signal_gunicorn(signal.SIGTERM)
            threading.Thread(target=self._load, name="engine-load", daemon=True).start()
            code = self.gunicorn.wait()
            return self._finish(code)
        finally:
            shutil.rmtree(runtime, ignore_errors=True)

    def _start_gunicorn(self) -> subprocess.Popen:
        env = dict(os.environ)
        env[RUNTIME_DIR_ENV] = self.settings.runtime_dir
        package_root = str(Path(appliance.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "gunicorn", "--config", "python:appliance.server.gunicorn_conf"]
        # Own session: a terminal's Ctrl-C reaches us only, and we stop gunicorn gracefully.
        return subprocess.Popen(cmd, env=env, start_new_session=True)

    def _load(self) -> None:
        s = self.settings
        log.info("loading model", extra={"model_dir": s.model_dir, "device": self.engine_config.device})
        try:
            engine = self.engine_factory(s.model_dir, self.engine_config)
            engine.generate(WARMUP_PROMPT, SamplingParams(max_tokens=2))  # compile / first-inference costs
        except Exception as exc:
            log.exception("model failed to load")
            self.service.fail(f"{type(exc).__name__}: {exc}")
            self.load_failed = True
            self._signal_gunicorn(signal.SIGTERM)
            return
        with self._lock:
            if self.stopping.is_set():
                engine.shutdown()
                return
            self.engine = engine
            engine.on_death = self._engine_died
            self.service.attach(engine, self.engine_config.device)
            if not engine.alive:  # died before on_death was set
                self._engine_died(engine.dead or RuntimeError("engine loop exited"))
        log.info(
            "ready", extra={"model": s.served_model_name, "url": f"http://{s.host}:{s.port}/v3", "workers": s.workers}
        )
        sdnotify.ready()

    def healthy(self) -> bool:
        """The watchdog's question (sdnotify): can this process still serve? False once an engine died or wedged."""
        return not self.engine_died and self.service.healthy()

    def _engine_died(self, exc: BaseException) -> None:
        """Engine.on_death (called on the dying engine thread): fail readiness, stop serving, exit 1."""
        if self.engine_died:
            return
        self.engine_died = True
        log.critical(
            "the engine loop died; stopping so the service manager restarts the server",
            extra={"error": f"{type(exc).__name__}: {exc}"},
        )
        self.service.fail(f"engine loop died: {type(exc).__name__}")
        self.stopping.set()
        self._signal_gunicorn(signal.SIGTERM)

    def _install_signals(self) -> None:
        def handle(signum, frame):
            if self.stopping.is_set():  # second signal: stop now
                self._signal_gunicorn(signal.SIGQUIT)
                return
            log.info("stopping", extra={"signal": signal.Signals(signum).name})
            sdnotify.stopping()
            self.stopping.set()
            self._signal_gunicorn(signal.SIGTERM)

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)

    def _signal_gunicorn(self, sig: int) -> None:
        if self.gunicorn is not None and self.gunicorn.poll() is None:
            self.gunicorn.send_signal(sig)

    def _finish(self, gunicorn_code: int) -> int:
        """Gunicorn has exited, so no request is in flight: stop the engine."""
        with self._lock:
            self.stopping.set()
            self.service.stop()
            engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()
        if self.load_failed or self.engine_died:
            return 1
        if gunicorn_code == -signal.SIGTERM and self.stopping.is_set():
            gunicorn_code = 0  # our SIGTERM reached it before it installed its handlers: a stop all the same
        if gunicorn_code != 0:
            log.error("HTTP server exited", extra={"code": gunicorn_code})
            return gunicorn_code if gunicorn_code > 0 else 1
        log.info("stopped")
        return 0


def raise_fd_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard limit (inherited by gunicorn): every client connection is an fd in a
    worker, every worker connection one in this process, and 1024 (a common soft default) is a few hundred
    clients. systemd's LimitNOFILE= or Docker's --ulimit set the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            log.warning("could not raise the open-file limit", extra={"soft": soft, "hard": hard})


def serve(settings: ServeSettings, engine_config: EngineConfig, engine_factory=_default_engine) -> int:
    logs.setup(settings.log_level)
    return Supervisor(settings, engine_config, engine_factory).run()
