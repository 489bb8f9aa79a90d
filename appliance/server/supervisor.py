"""`appliance serve`'s process: it is the engine process, and gunicorn is its child.

Start order: private runtime dir (socket, authkey, settings) -> engine socket listening -> gunicorn (answers
503 while loading) -> each model's load + warm-up, one after another (a model serves as soon as it is ready;
the server is ready when all are) -> ready. A model that fails to load at start-up stops the server (exit 1:
a misconfigured box must not look healthy). Stop: SIGTERM/SIGINT is forwarded to gunicorn, whose
workers finish their in-flight requests (up to graceful_timeout); then the engine shuts down. Being the parent
means the engine cannot be orphaned by gunicorn, and gunicorn gets SIGTERM from the kernel if we die
(PR_SET_PDEATHSIG, set in gunicorn_conf).

If the engine loop dies (a bug: per-request errors are isolated inside the engine), readiness turns 503 at once,
gunicorn is stopped and the process exits 1, so systemd's Restart=on-failure or Docker's restart policy brings
up a fresh one: a server that cannot generate must not look alive.

Reload (POST /v1/config/reload -> the engine service's RELOAD -> `reload_config`): the config file is read again
(appliance/server/config_file.py); added models and models whose settings changed are loaded beside the serving
ones (a changed one is swapped in once ready, the old engine retires when its jobs end), removed ones stop taking
jobs at once and are shut down after theirs. A model that fails to load on reload is reported failed and the
others are untouched (a changed one keeps serving with its previous settings); a broken config changes nothing.
A model that failed is not loaded again by the next reloads until its entry or its export changes: a reload is
the admin's call (appliance/auth.py), and each load of a broken export costs the engine process seconds.
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
from appliance import auth, logs
from appliance import protocol as p
from appliance.config import EngineConfig
from appliance.params import SamplingParams
from appliance.server import config_file, embeddings, sdnotify, startup
from appliance.server.engine_service import EngineService
from appliance.server.metrics import ServerMetrics
from appliance.server.slots import single_spec
from appliance.settings import AUTHKEY_FILE, RUNTIME_DIR_ENV, ModelSpec, ServeSettings

log = logging.getLogger("appliance.serve")

WARMUP_PROMPT = "Hello"


def _default_engine(model_dir: str, config: EngineConfig):
    from appliance.runtime.engine import Engine  # heavy (OpenVINO): only in this process

    return Engine(model_dir, config)


class Supervisor:
    def __init__(self, settings: ServeSettings, engine_config: EngineConfig, engine_factory=_default_engine):
        self.settings, self.engine_config, self.engine_factory = settings, engine_config, engine_factory
        if not settings.models:
            settings.models = [single_spec(settings, engine_config)]
        self.service = EngineService(settings, ServerMetrics())
        self.service.reloader = self.reload_config
        self._reloading = threading.Lock()  # one reload at a time
        # name -> the spec it last failed to load with on a reload: not tried again until its entry (or its
        # export's manifest, ModelSpec.created) changes, so repeated reloads do not reload a broken model each time
        self._failed: dict[str, ModelSpec] = {}
        self.gunicorn: subprocess.Popen | None = None
        self.stopping = threading.Event()
        self.load_failed = False
        self.engine_died = False
        self._lock = threading.Lock()

    def run(self) -> int:
        self._install_signals()  # first: a SIGTERM during start-up still stops gunicorn and cleans up below
        startup.log_settings(self.settings)  # the one line with the effective settings
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
        cmd = [sys.executable, "-m", "gunicorn", "--config", "python:appliance.http.gunicorn_conf"]
        # Own session: a terminal's Ctrl-C reaches us only, and we stop gunicorn gracefully.
        return subprocess.Popen(cmd, env=env, start_new_session=True)

    def _load(self) -> None:
        with self._reloading:  # a reload asked for meanwhile waits for these
            for spec in list(self.settings.models):
                try:
                    engine = self._start_engine(spec)
                except Exception as exc:
                    log.exception("model failed to load", extra={"model": spec.name})
                    self.service.fail(f"{type(exc).__name__}: {exc}", spec.name)
                    self.load_failed = True
                    self._signal_gunicorn(signal.SIGTERM)
                    return
                if not self._attach(engine, spec, replace=False):
                    return
        s = self.settings
        log.info(
            "ready",
            extra={
                "models": [m.name for m in s.models],
                "url": auth.base_url(s) + "/v3",
                "workers": s.workers,
            },
        )
        sdnotify.ready()

    def _start_engine(self, spec: ModelSpec):
        log.info("loading model", extra={"model": spec.name, "model_dir": spec.model_dir, "device": spec.engine.device})
        if embeddings.model_task(spec.model_dir) != "generate":  # an embedding or rerank model: its own service
            threads, metrics = spec.engine.num_threads, self.service.metrics
            return embeddings.load_encoder_service(spec.model_dir, spec.engine.device, threads, metrics)
        engine = self.engine_factory(spec.model_dir, spec.engine)
        try:
            engine.generate(WARMUP_PROMPT, SamplingParams(max_tokens=2))  # compile / first-inference costs
        except BaseException:
            engine.shutdown()
            raise
        return engine

    def _attach(self, engine, spec: ModelSpec, replace: bool) -> bool:
        """Serve `engine` as model `spec.name` (`replace`: a fresh slot, for a reload). False when stopping."""
        with self._lock:
            if self.stopping.is_set():
                engine.shutdown()
                return False
            engine.on_death = self._engine_died
            self.service.attach(engine, spec.engine.device, spec.name, spec if replace else None)
            if not engine.alive:  # died before on_death was set
                self._engine_died(engine.dead or RuntimeError("engine loop exited"))
        log.info("model ready", extra={"model": spec.name})
        return True

    def reload_config(self) -> p.Reply:
        """The engine service's RELOAD: the config file read again, then reload(); a broken one is a 400."""
        if not self.settings.config_file:
            return p.Reply(error=p.Failed(400, "no config file: start the server with --config to reload it"))
        try:
            specs = config_file.reload_models(self.settings)
        except ValueError as exc:  # ConfigError, or a malformed export's manifest
            return p.Reply(error=p.Failed(400, str(exc), code="invalid_config"))
        return p.Reply(self.reload(specs))

    def reload(self, specs: list[ModelSpec]) -> tuple[bool, list[p.ModelInfo]]:
        """Serve exactly `specs` from now on; (anything changed, every model's state) once the loads end."""
        with self._reloading:
            current = self.service.specs()
            names = [spec.name for spec in specs]
            removed = [name for name in current if name not in names]
            self._failed = {n: f for n, f in self._failed.items() if f in specs}  # forget what is no longer asked
            changed = [s for s in specs if s.name not in current or current[s.name] != (s, "ready")]
            to_load = [s for s in changed if self._failed.get(s.name) != s]
            still_failed = [s.name for s in changed if s not in to_load]
            log.info(
                "reloading the config",
                extra={"load": [s.name for s in to_load], "remove": removed, "failed_unchanged": still_failed},
            )
            self.service.remove(removed)
            for spec in to_load:
                self.service.add(spec)
            self.service.order(names)
            for spec in to_load:
                try:
                    engine = self._start_engine(spec)
                except Exception as exc:
                    log.exception("model failed to load on reload", extra={"model": spec.name})
                    self.service.fail(f"{type(exc).__name__}: {exc}", spec.name)
                    self._failed[spec.name] = spec
                    continue
                self._failed.pop(spec.name, None)
                if not self._attach(engine, spec, replace=True):
                    break
            self.settings.models = specs
            self.settings.save()
            return bool(removed or to_load), self.service.models()

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
        self.service.fail(f"engine loop died: {type(exc).__name__}")  # every model: the server stops
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
            engines = self.service.stop()
        for engine in engines:
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
