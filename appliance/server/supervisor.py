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

Load on demand, unload when idle: appliance/server/residency.py decides (keep_alive, the memory budget, least
recently used first), this class acts. Every configured model loads once at start-up, as before (a broken one still
stops the server, and its load records what its status says while it is unloaded); with a budget they load last to
first, making room as they go, so the first (the default) is the one left loaded. Then a reaper thread unloads
models idle past their keep_alive, and a job for an unloaded model (or a pulled one restored at start-up, which
start-up lists without loading: pulled_models.py) asks `ensure_loaded`, which queues the load for
one loader thread (concurrent requests for a model share its load; a load waits for room under the budget, bounded
by --models-load-wait, then fails its requests with a 503) and waits. Loads never run on an engine thread, and
they, start-up and reloads take turns (`_reloading`). A failed load on demand fails the requests that waited for
it (500, with the reason) and leaves the model listed, unloaded, with the error in /v1/config; the next request
tries again. Engines are shut down on the loader or reaper thread, then memory is given back to the OS (gc,
malloc_trim), as it is after each load (what compiling freed).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import queue
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import appliance
from appliance import auth, logs, options
from appliance import protocol as p
from appliance.config import EngineConfig
from appliance.params import SamplingParams
from appliance.server import config_file, sdnotify, startup, tracing
from appliance.server.encoders import embeddings
from appliance.server.engine_service import EngineService
from appliance.server.metrics import ServerMetrics
from appliance.server.pulled_models import PulledModels
from appliance.server.residency import Residency, estimate
from appliance.server.slots import model_not_found, not_ready, single_spec
from appliance.settings import AUTHKEY_FILE, RUNTIME_DIR_ENV, ModelSpec, ServeSettings

log = logging.getLogger("appliance.serve")

WARMUP_PROMPT = "Hello"
ROOM_POLL_SECONDS = 0.05  # a load waiting for room under the budget looks again this often
LOAD_POLL_SECONDS = 0.1  # a job waiting for its model's load checks its worker is still there this often


@dataclass
class _Pending:
    """A load on demand queued for the loader thread; the jobs for the model wait on `done`."""

    done: threading.Event = field(default_factory=threading.Event)
    failed: p.Failed | None = None


def _default_engine(model_dir: str, config: EngineConfig):
    from appliance.runtime.engine import Engine  # heavy (OpenVINO): only in this process

    engine = Engine(model_dir, config)
    # Compiling leaves freed heap in glibc's arenas (the graphs of rows compile on threads of their own: ~60 MB at
    # the default model, 629 -> 567 MB RSS once given back).
    _malloc_trim()
    return engine


class Supervisor:
    def __init__(self, settings: ServeSettings, engine_config: EngineConfig, engine_factory=_default_engine):
        self.settings, self.engine_config, self.engine_factory = settings, engine_config, engine_factory
        if not settings.models:
            settings.models = [single_spec(settings, engine_config)]
        self.service = EngineService(settings, ServerMetrics())
        self.pulled = PulledModels(self)  # what /api/pull added and /api/delete removes (pulled_models.py)
        self.service.calls.update({p.RELOAD: self.reload_config, p.LOAD: self.load_call, **self.pulled.calls()})
        if settings.serve_pulled:  # the pulled models the command line and config file do not name, on demand
            for spec in self.pulled.restore(settings.models):
                settings.models.append(spec)
                self.service.add(spec)
        self.service.jobs.ensure = self.ensure_loaded
        self.residency = Residency(options.parse_memory_budget(settings.models_memory_budget))
        self._pending: dict[str, _Pending] = {}  # name -> its queued load; guarded by _pending_lock
        self._pending_lock = threading.Lock()
        self._loads: queue.SimpleQueue[str | None] = queue.SimpleQueue()
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
            tracing.setup(self.settings)  # OpenTelemetry, when configured: this process's provider
            raise_fd_limit()
            self.service.start()
            sdnotify.start_watchdog(self.healthy)
            self.gunicorn = self._start_gunicorn()
            if self.stopping.is_set():  # a signal before this point found no gunicorn to stop
                self._signal_gunicorn(signal.SIGTERM)
            threading.Thread(target=self._load, name="engine-load", daemon=True).start()
            threading.Thread(target=self._loader, name="engine-ondemand", daemon=True).start()
            threading.Thread(target=self._reaper, name="engine-reaper", daemon=True).start()
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
            specs = [spec for spec in self.settings.models if spec.name not in self.pulled.added]
            for spec in self.settings.models:
                if spec.name in self.pulled.added:  # restored pulled models: ready, loaded by their first request
                    self.pulled.prepare(spec)
            if self.residency.budget is not None:  # last to first: the first model is the one left loaded
                specs.reverse()
                log.info("models memory budget", extra={"bytes": self.residency.budget})
            for spec in specs:
                try:
                    self._make_room(spec, None)
                    engine = self._start_engine(spec, "startup")
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

    def _start_engine(self, spec: ModelSpec, reason: str = "reload"):
        """A loaded, warmed-up engine for `spec` (raises if it cannot load); counted in the metrics by `reason`."""
        log.info("loading model", extra={"model": spec.name, "model_dir": spec.model_dir, "device": spec.engine.device})
        metrics, start = self.service.metrics, time.monotonic()
        try:
            if embeddings.model_task(spec.model_dir) != "generate":  # an embedding or rerank model: its own service
                threads = spec.engine.num_threads
                nice, sched = self.settings.encoder_nice, self.settings.encoder_sched
                engine = embeddings.load_encoder_service(
                    spec.model_dir, spec.engine.device, threads, metrics, nice, sched
                )
            else:
                engine = self.engine_factory(spec.model_dir, spec.engine)
                try:
                    engine.generate(WARMUP_PROMPT, SamplingParams(max_tokens=2))  # compile / first-inference costs
                except BaseException:
                    engine.shutdown()
                    raise
        except BaseException:
            metrics.model_loads.labels(reason, "failed").inc()
            raise
        seconds = time.monotonic() - start
        metrics.model_loads.labels(reason, "ok").inc()
        metrics.model_load_seconds.observe(seconds)
        log.info("model loaded", extra={"model": spec.name, "seconds": round(seconds, 3), "reason": reason})
        return engine

    def _attach(self, engine, spec: ModelSpec, replace: bool) -> bool:
        """Serve `engine` as model `spec.name` (`replace`: a fresh slot, for a reload). False when stopping."""
        with self._lock:
            if self.stopping.is_set():
                engine.shutdown()
                return False
            engine.on_death = self._engine_died
            self.service.attach(engine, spec.engine.device, spec.name, spec if replace else None)
            slot = self.service.registry.find(spec.name)
            if slot is not None and slot.engine is engine:  # the budget counts what it really holds from now on
                kv_bytes = getattr(getattr(engine, "backend", None), "cache_bytes", None)
                slot.size = estimate(spec.model_dir, spec.engine, kv_bytes)
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
        return p.Reply(self.reload(self.pulled.keep(specs)))

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
                    failed = self._make_room(spec, time.monotonic() + self.settings.models_load_wait)
                    if failed is not None:
                        raise RuntimeError(failed.message)
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

    # ---- load on demand, unload when idle (appliance/server/residency.py decides)
    def ensure_loaded(self, name: str, gone) -> p.Failed | None:
        """Model `name` loaded (None), or why not. Called on a job's connection thread (which holds the model's
        in-flight count): the load runs on the loader thread, shared with every request waiting for it; `gone()`
        (the worker closed the connection) ends this wait, not the load."""
        with self._pending_lock:
            pending = self._pending.get(name)
            if pending is None:
                pending = self._pending[name] = _Pending()
                self._loads.put(name)
        while not pending.done.wait(LOAD_POLL_SECONDS):
            if gone():
                return p.Failed(499, "the client went away while its model loaded")
        return pending.failed

    def load_call(self, model: str, keep_alive: float | None) -> p.Reply:
        """LOAD (Ollama's request without a prompt): the model loaded and kept for `keep_alive` (None: its default);
        keep_alive 0 unloads it instead (at once when idle, else when its requests end). The model's state after.
        Rejected (404) for a model not served; "" is the first one."""
        registry = self.service.registry
        name = registry.slot(model).spec.name
        if keep_alive == 0:
            slot = registry.find(name)
            if slot is None:
                return p.Reply(error=model_not_found(name))
            slot.keep_alive, slot.last_used = 0.0, time.monotonic()
            self._unload(name, "keep_alive")
            return p.Reply(slot.info())
        with registry.in_flight(name, keep_alive) as slot:  # held: not unloaded between its load and this answer
            if slot is None:
                return p.Reply(error=model_not_found(name))
            if slot.unloaded:  # the worker waits for the answer (LOAD_SECONDS): nothing to watch
                failed = self.ensure_loaded(name, lambda: False)
                if failed is not None:
                    return p.Reply(error=failed)
            if slot.engine is None:
                return p.Reply(error=not_ready(slot.state))
            info = slot.info()
        return p.Reply(info)

    def _loader(self) -> None:
        """The loader thread: the queued loads on demand, one at a time."""
        while True:
            name = self._loads.get()
            if name is None:
                return
            try:
                failed = self._load_on_demand(name)
            except Exception as exc:  # a bug here must fail the waiting requests, not leave them waiting
                log.exception("load on demand failed", extra={"model": name})
                failed = p.Failed(500, f"The model `{name}` could not be loaded: {type(exc).__name__}")
            with self._pending_lock:
                pending = self._pending.pop(name, None)
            if pending is not None:
                pending.failed = failed
                pending.done.set()

    def _load_on_demand(self, name: str) -> p.Failed | None:
        with self._reloading:  # start-up and reloads load too: one at a time
            registry = self.service.registry
            slot = registry.find(name)
            if slot is None:
                return model_not_found(name)
            if not slot.unloaded:
                return None if slot.engine is not None else not_ready(slot.state)
            spec = slot.spec
            failed = self._make_room(spec, time.monotonic() + self.settings.models_load_wait)
            if failed is not None:
                return failed
            try:
                engine = self._start_engine(spec, "demand")
            except Exception as exc:
                log.exception("model failed to load on demand", extra={"model": name})
                message = f"{type(exc).__name__}: {exc}"
                slot.error = f"the last load on demand failed: {message}"
                return p.Failed(500, f"The model `{name}` failed to load: {message}", code="model_load_failed")
            if not self._attach(engine, spec, replace=False):
                return not_ready("stopping")
            return None

    def _make_room(self, spec: ModelSpec, deadline: float | None) -> p.Failed | None:
        """Unload what the budget needs unloaded before `spec` loads (idle models, least recently used first);
        wait while only busy models hold the room, until `deadline` (None: no bound, start-up)."""
        registry, budget = self.service.registry, self.residency.budget
        if budget is None:
            return None
        slot = registry.find(spec.name)
        size = slot.size if slot is not None and slot.size else estimate(spec.model_dir, spec.engine)
        warned = False
        while True:
            residents = registry.residents()
            plan = self.residency.plan(spec.name, size, residents)
            if plan.alone and not warned:
                log.warning(
                    "a model is larger than the models memory budget: it loads with nothing beside it",
                    extra={"model": spec.name, "bytes": size, "budget": budget},
                )
                warned = True
            if not plan.wait:
                if all([self._unload(name, "budget") for name in plan.unload]):
                    return None
                continue  # one went busy (or away) meanwhile: plan again
            if self.stopping.is_set():
                return not_ready("stopping")
            if deadline is not None and time.monotonic() >= deadline:
                busy = ", ".join(r.name for r in residents if r.busy)
                return p.Failed(
                    503,
                    f"The model `{spec.name}` cannot be loaded now: the models memory budget ({budget} bytes) is "
                    f"held by models with requests in flight ({busy}) for more than "
                    f"{self.settings.models_load_wait:g} s; retry later",
                    code="models_memory_busy",
                )
            time.sleep(ROOM_POLL_SECONDS)

    def _unload(self, name: str, reason: str) -> bool:
        """Shut model `name`'s engine down if it is idle (it stays listed; its next job loads it)."""
        engine = self.service.unload(name)
        if engine is None:
            return False
        engine.on_death = None  # an unloaded engine's end is no death
        engine.shutdown()
        del engine
        gc.collect()
        _malloc_trim()
        self.service.metrics.model_unloads.labels(reason).inc()
        log.info("model unloaded", extra={"model": name, "reason": reason})
        return True

    def _reaper(self) -> None:
        """Unloads the models idle past their keep_alive. Asleep until the first keep_alive runs out, or until the
        registry says something changed (`Models.idle`: a model's last job ended, a model attached, stopping):
        no timer, since a periodic wakeup beside the engine's threads costs a busy core (bench.http_breakdown
        counted the 0.5 s poll it replaces at 0.1-0.3 context switches per token at batch 1)."""
        registry = self.service.registry
        while not self.stopping.is_set():
            registry.idle.clear()  # before looking: a change from now on ends the wait below at once
            for name in self.residency.expired(registry.residents(), time.monotonic()):
                if self.stopping.is_set():
                    return
                self._unload(name, "keep_alive")
            wait = self.residency.next_expiry(registry.residents(), time.monotonic())
            registry.idle.wait(None if wait is None else min(wait, threading.TIMEOUT_MAX))

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


def _malloc_trim() -> None:
    """Give freed heap back to the OS (glibc keeps it otherwise, and an unloaded model would still look resident)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


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
