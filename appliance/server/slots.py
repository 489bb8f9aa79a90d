"""The served models of the engine process (engine_service.py): a `Slot` per model (its ModelSpec, Engine, state
and output parsers) and `Models`, the registry that owns the slots and their lock.

A plain `serve` has one slot; a config file's model_config_list one per model, in config order. A job, a status or a
tokenize call names its model (`""`: the first one, for single-model callers); an unknown name is a 404. A reload
(the supervisor's `reloader`) swaps slots in and out: a removed or replaced slot stops taking jobs at once and its
engine is shut down once its in-flight `jobs` end (or after graceful_timeout). Each slot has a serial, new per
settings of the model, that workers compare to drop a status they kept for a replaced model (client.py).

Load on demand (appliance/server/residency.py decides, the supervisor acts): a ready slot may have no engine, being
unloaded by its keep_alive or the memory budget. It stays listed and ready (readiness holds: its next job loads
it), answers status from `facts` (what its engine's status said, kept as it unloaded: a new load of the same
settings says the same), tokenizes with the tokenizer it kept, and keeps its serial. `unload` detaches the engine
only when no job is in flight, under the lock `in_flight` counts jobs under, so a job either holds the engine or
finds none and waits for a load.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from appliance import protocol as p
from appliance.config import EngineConfig
from appliance.keep_alive import FOREVER, parse_keep_alive
from appliance.server import tool_prompt
from appliance.server.residency import Resident
from appliance.settings import ModelSpec, ServeSettings

if TYPE_CHECKING:
    from appliance.runtime.engine import Engine

log = logging.getLogger(__name__)

RETIRE_POLL_SECONDS = 0.1  # a retiring model's in-flight jobs are checked this often
# A step that has not ended after this long means the engine is wedged (the longest legitimate step, a
# max_num_batched_tokens prefill of a large model on a slow CPU, is seconds). Readiness then answers 503.
ENGINE_STALL_SECONDS = 60.0


def single_spec(settings: ServeSettings, engine: EngineConfig | None = None) -> ModelSpec:
    """The one model of a plain `serve` (settings.models empty: callers that build ServeSettings by hand)."""
    return ModelSpec(
        settings.served_model_name,
        settings.model_dir,
        settings.model_created,
        engine or EngineConfig(),
        settings.tool_parser,
        settings.reasoning_parser,
    )


def model_not_found(name: str) -> p.Failed:
    return p.Failed(404, f"The model `{name}` does not exist", "model", "model_not_found")


def not_ready(state: str) -> p.Failed:
    if state == "stopping":
        return p.Failed(503, "The server is shutting down", code="shutting_down")
    if state == "failed":
        return p.Failed(503, "The model cannot serve: it failed to load", code="model_failed")
    return p.Failed(503, "The model is not ready yet (loading)", code="model_not_ready")


class Rejected(Exception):
    """A call or job refused with this reply (the worker turns it into the HTTP error)."""

    def __init__(self, failed: p.Failed):
        super().__init__(failed.message)
        self.failed = failed


@dataclass
class Slot:
    """One served model. `jobs` counts its jobs in flight (a retiring slot waits for them)."""

    spec: ModelSpec
    serial: int
    state: str = "loading"  # loading | ready | failed | stopping
    error: str | None = None
    engine: Engine | None = None
    device: str = ""
    jobs: int = 0
    _parsers: tuple[str, str] | None = None
    # load on demand: what the last load reported (status of an unloaded slot), its tokenizer, its memory estimate
    facts: p.EngineStatus | None = None
    provisional: bool = False  # facts read from the export's files, not from a load (Models.dormant)
    tokenizer: Any = None
    size: int = 0
    last_used: float = 0.0  # monotonic: its last job's end, or its load
    default_keep_alive: float = FOREVER
    keep_alive: float = FOREVER  # the last job's keep_alive, else the default

    @property
    def unloaded(self) -> bool:
        """Ready to serve, but not in memory: its next job loads it."""
        return self.state == "ready" and self.engine is None

    def parsers(self) -> tuple[str, str]:
        """(tool parser, reasoning parser): the spec's, `auto` resolved from the chat template once."""
        if self._parsers is None:
            assert self.engine is not None, "called with an attached engine"
            template = self.engine.tokenizer.chat_template
            self._parsers = (
                tool_prompt.choose_tool_parser(template, self.spec.tool_parser),
                tool_prompt.choose_reasoning_parser(template, self.spec.reasoning_parser),
            )
        return self._parsers

    def problem(self) -> str | None:
        """Why the attached engine cannot serve now (None: it can): its loop died, or one step has taken
        longer than ENGINE_STALL_SECONDS."""
        e = self.engine
        if e is None:
            return None
        if not e.alive:
            return f"the engine loop stopped: {type(e.dead).__name__ if e.dead else 'exited'}"
        stalled = time.monotonic() - e.heartbeat
        if stalled > ENGINE_STALL_SECONDS:
            return f"the engine loop has not advanced for {stalled:.0f} s"
        return None

    def live_state(self) -> tuple[str, str | None]:
        """(state, error) as they are now: a ready slot whose engine cannot serve reads as failed."""
        if self.state == "ready" and (problem := self.problem()):
            return "failed", problem
        return self.state, self.error

    def info(self) -> p.ModelInfo:
        state, error = self.live_state()
        expires = None
        if self.engine is not None and self.keep_alive != FOREVER:
            idle_since = time.monotonic() if self.jobs else self.last_used
            expires = time.time() + (idle_since + self.keep_alive - time.monotonic())
        return p.ModelInfo(self.spec.name, self.spec.created, state, error, self.engine is not None, self.size, expires)

    def resident(self) -> Resident:
        return Resident(self.spec.name, self.size, self.last_used, self.jobs > 0, self.keep_alive)


class Models:
    """The served models: name -> Slot in config order, plus the retiring ones draining their jobs, under one lock.
    `stopping` is set once by stop() and read without the lock."""

    def __init__(self, specs: list[ModelSpec], graceful_timeout: float, keep_alive: str = "-1"):
        self.graceful_timeout = graceful_timeout
        self.keep_alive = keep_alive  # --keep-alive: a model's default when its spec has none
        # set when what the keep_alive reaper decides from changed (a model's last job ended, a model attached) and
        # at stop: the supervisor's reaper sleeps on it until the next keep_alive runs out
        self.idle = threading.Event()
        self.stopping = False
        self._serials = itertools.count(1)
        self._slots: dict[str, Slot] = {}  # the served models, in config order; guarded by _lock
        self._retiring: list[Slot] = []  # removed or replaced, draining their jobs before shutdown
        self._lock = threading.Lock()
        for spec in specs:
            self._slots[spec.name] = self._new_slot(spec)

    def _new_slot(self, spec: ModelSpec) -> Slot:
        keep = parse_keep_alive(spec.keep_alive if spec.keep_alive is not None else self.keep_alive)
        return Slot(spec, next(self._serials), default_keep_alive=keep, keep_alive=keep)

    # ---- lifecycle (supervisor thread)
    def attach(self, engine: Engine, device: str, name: str = "", spec: ModelSpec | None = None) -> None:
        """`engine` serves model `name` (the first one by default) from now on. With a `spec` (a reload), a
        fresh slot takes the name: a slot it replaces retires (its jobs finish on the old engine)."""
        with self._lock:
            old = self._find(name)
            if spec is None:
                assert old is not None, f"attach to an unknown model {name!r}"
                slot = old
            else:
                slot = self._new_slot(spec)
                self._slots[spec.name] = slot
            if slot.provisional:  # its first load: the engine's own status from now on, under a new serial
                slot.facts, slot.provisional, slot.serial = None, False, next(self._serials)
            slot.engine, slot.device, slot.state, slot.error = engine, device, "ready", None
            slot.tokenizer, slot.last_used = getattr(engine, "tokenizer", None), time.monotonic()
        self.idle.set()  # idle from now on: its keep_alive counts
        if old is not None and old is not slot:
            self._retire(old)

    def add(self, spec: ModelSpec) -> None:
        """A model a reload adds: listed as loading until attach() or fail()."""
        with self._lock:
            if spec.name not in self._slots:
                self._slots[spec.name] = self._new_slot(spec)

    def dormant(self, name: str, facts: p.EngineStatus, tokenizer: Any) -> None:
        """Model `name` ready but not loaded before its first job (a pulled model restored at start-up): its
        status says `facts` (read from its files) until that load, which gives the slot a new serial so the
        workers ask its status again (the KV cache may bound its context below the manifest's)."""
        with self._lock:
            slot = self._slots.get(name)
            if slot is None or slot.engine is not None:
                return
            slot.state, slot.error, slot.tokenizer = "ready", None, tokenizer
            slot.facts, slot.provisional = replace(facts, serial=slot.serial), True

    def fail(self, message: str, name: str | None = None) -> None:
        """Model `name` (every model when None) cannot serve; a model serving an older spec keeps serving."""
        with self._lock:
            for slot in self._slots.values():
                if name is None or slot.spec.name == name:
                    if name is not None and slot.state == "ready" and slot.engine is not None:
                        slot.error = f"the reload failed, the previous settings serve: {message}"
                    else:
                        slot.state, slot.error = "failed", message

    def remove(self, names: list[str]) -> None:
        """Stop routing to these models at once; their engines stop once their jobs end."""
        with self._lock:
            gone = [self._slots.pop(n) for n in names if n in self._slots]
        for slot in gone:
            self._retire(slot)

    def order(self, names: list[str]) -> None:
        """List the models in this order (the config file's)."""
        with self._lock:
            self._slots = {n: self._slots[n] for n in names if n in self._slots} | self._slots

    def specs(self) -> dict[str, tuple[ModelSpec, str]]:
        """name -> (spec, state) of every configured model."""
        with self._lock:
            return {n: (s.spec, s.state) for n, s in self._slots.items()}

    def unload(self, name: str) -> Engine | None:
        """Detach model `name`'s engine if it has no job in flight (the caller shuts it down); None otherwise. The
        slot stays ready: its next job loads it again."""
        with self._lock:
            slot = self._slots.get(name)
            if slot is None or slot.engine is None or slot.jobs or slot.state != "ready":
                return None
            engine, slot.engine = slot.engine, None
            return engine

    def residents(self) -> list[Resident]:
        """The loaded, ready models, as the residency policy sees them."""
        with self._lock:
            return [s.resident() for s in self._slots.values() if s.engine is not None and s.state == "ready"]

    def _retire(self, slot: Slot) -> None:
        slot.state = "stopping"
        with self._lock:
            self._retiring.append(slot)
        threading.Thread(target=self._drain, args=(slot,), name="engine-retire", daemon=True).start()

    def _drain(self, slot: Slot) -> None:
        deadline = time.monotonic() + self.graceful_timeout
        while slot.jobs and time.monotonic() < deadline and not self.stopping:
            time.sleep(RETIRE_POLL_SECONDS)
        with self._lock:
            if slot not in self._retiring:  # stop() took it
                return
            self._retiring.remove(slot)
        if slot.engine is None:  # a model that never loaded
            return
        slot.engine.on_death = None  # a retired engine's end is no death
        cut = slot.jobs  # counted before the shutdown, whose aborts take the jobs off the count
        if self.stopping:
            slot.engine.shutdown()
        else:  # the client is told why: the server is not shutting down
            slot.engine.shutdown(
                f"model {slot.spec.name!r} was removed or replaced by a config reload; its requests had "
                f"--graceful-timeout ({self.graceful_timeout:g} s) to finish"
            )
        log.info("model unloaded", extra={"model": slot.spec.name, "jobs_cut": cut})

    def retiring(self, name: str) -> bool:
        """Whether a removed or replaced model `name` still drains its jobs (its engine not shut down yet)."""
        with self._lock:
            return any(slot.spec.name == name for slot in self._retiring)

    def stop(self) -> list[Engine]:
        """No more jobs; the engines the caller shuts down (every model's, retiring ones too)."""
        self.stopping = True
        self.idle.set()  # the reaper ends
        with self._lock:
            slots = [*self._slots.values(), *self._retiring]
            self._retiring = []
            for slot in self._slots.values():
                slot.state = "stopping"
        return [s.engine for s in slots if s.engine is not None]

    # ---- lookups (any thread)
    def _find(self, name: str) -> Slot | None:
        """Model `name`'s slot ("": the first model), or None. Callers hold _lock or accept a racy read."""
        if not name:
            return next(iter(self._slots.values()), None)
        return self._slots.get(name)

    def find(self, name: str) -> Slot | None:
        with self._lock:
            return self._find(name)

    def slot(self, name: str) -> Slot:
        """Model `name`'s slot; Rejected with a 404 when there is none."""
        slot = self.find(name)
        if slot is None:
            raise Rejected(model_not_found(name))
        return slot

    def all(self) -> list[Slot]:
        """The served slots now, in config order."""
        with self._lock:
            return list(self._slots.values())

    @contextlib.contextmanager
    def in_flight(self, name: str, keep_alive: float | None = None) -> Iterator[Slot | None]:
        """Model `name`'s slot (None: no such model) with its `jobs` count held up for the block: a retiring slot
        waits for it before its engine shuts down, and the residency policy never unloads it. At the end the
        model's keep_alive is the job's (`keep_alive`, Ollama's: the last request's applies), else its default; its
        idle time counts from the end of its last job."""
        with self._lock:
            slot = self._find(name)
            if slot is not None:
                slot.jobs += 1
                slot.keep_alive = slot.default_keep_alive if keep_alive is None else keep_alive
        try:
            yield slot
        finally:
            if slot is not None:
                with self._lock:
                    slot.jobs -= 1
                    if not slot.jobs:
                        slot.last_used = time.monotonic()
                        if slot.keep_alive != FOREVER:  # a model kept forever gives the reaper nothing to do
                            self.idle.set()

    def healthy(self) -> bool:
        """For the watchdog: not stopping, nothing failed that should serve, and every engine alive and
        advancing (a model whose reload failed has no engine: it does not make the process unhealthy)."""
        slots = self.all()
        return not self.stopping and all(
            s.state != "failed" and s.problem() is None for s in slots if s.engine is not None
        )  # an unloaded model has no engine to fail: the policy's choice, not a fault

    def engine_problem(self, name: str = "") -> str | None:
        slot = self.find(name)
        return slot.problem() if slot is not None else None

    def infos(self) -> list[p.ModelInfo]:
        infos = [s.info() for s in self.all()]
        return [replace(i, state="stopping") for i in infos] if self.stopping else infos
