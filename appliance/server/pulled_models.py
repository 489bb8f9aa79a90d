"""The engine process's part of Ollama's /api/pull and /api/delete: serve a model a pull has just made, and stop
serving and delete a pulled one, through the supervisor's reload path (Supervisor.reload: an added model loads
beside the serving ones; a removed one stops taking jobs at once and its engine shuts down once its jobs end).

The download itself is not done here: the HTTP worker that answers /api/pull runs it in a child process
(appliance/pull/__init__.py says why: neither the engine's GIL and memory nor a worker's OpenVINO-free import set should
carry it) and relays its progress; once the child has put the model in place, the worker makes one SERVE_PULLED
call and this loads it. Keeping the engine's part to "serve this folder" and "stop serving and delete that one"
means the engine socket carries no progress stream and the supervisor only gains this small hook.

A model added by a pull has the server's global engine settings (the command line and APPLIANCE_* variables over
the config file's top level over the defaults, as a config file's model without keys of its own), never the served
model's draft model (a draft belongs to its model's tokenizer). A config reload keeps it (`keep`): a reload applies
the file, and the file does not name it. A reload also looks at the data dir again: a model `appliance pull` put
there while the server ran is served from then on (loaded by the reload, as a model the file adds), and one
`appliance rm` deleted is no longer served (unless --no-serve-pulled: then only /api/pull adds models).

After a restart every pulled model in the data dir is served again, on demand as Ollama's are (`restore`, unless
--no-serve-pulled): listed ready but not loaded, so /api/tags and /v3/models show it at once and start-up loads
nothing more, and its first request loads it (the supervisor's load on demand). Until then its status is read from
its files (`prepare`: the manifest, the tokenizer and its chat template, generation_config.json: a tokenizer read,
not a model load), with the manifest's context as the bound; the load gives the slot the engine's own status under
a new serial (slots.py Models.dormant). One the command line or the config file names (`--model
REPO[:REVISION]`, base_path likewise) is served as named, with its own settings, and not twice.

Delete removes only what a pull made (the folder under appliance/paths.py `pulled_models_dir`): a model served from
any other folder is refused (400), and so is a pulled one that the config file or command line names (the next
start would not find it: take it out there first). A served model is first removed from serving, then the call
waits until its in-flight jobs end (as a reload's removal: up to graceful_timeout) before the folder goes.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from appliance import hub_names, options, paths
from appliance import protocol as p
from appliance.manifest import MANIFEST_NAME, Manifest
from appliance.pull import store
from appliance.server import config_file, tool_prompt
from appliance.server.engine_service import EngineService
from appliance.settings import ConfigError, ModelSpec, ServeSettings

log = logging.getLogger("appliance.serve")

DRAIN_MARGIN_SECONDS = 5.0  # beyond graceful_timeout: the retiring engine's own shutdown


def _not_found(name: str) -> p.Reply:
    return p.Reply(error=p.Failed(404, f"model '{name}' not found"))


class Reloader(Protocol):
    """What this needs of the supervisor (supervisor.py): its settings, its engine service, its reload."""

    settings: ServeSettings
    service: EngineService

    def reload(self, specs: list[ModelSpec]) -> tuple[bool, list[p.ModelInfo]]: ...


class PulledModels:
    def __init__(self, supervisor: Reloader):
        self.supervisor = supervisor
        self.added: dict[str, ModelSpec] = {}  # served because a pull added them, not the config or command line

    def calls(self) -> dict[str, Callable[..., p.Reply]]:
        return {p.SERVE_PULLED: self.serve, p.DELETE_PULLED: self.delete}

    def keep(self, specs: list[ModelSpec]) -> list[ModelSpec]:
        """A config reload's models, and the pulled ones it does not name: those still in the data dir, and those
        pulled there since (the module docstring)."""
        names = {spec.name for spec in specs}
        for name in [n for n in self.added if paths.pulled_model(n) is None]:  # deleted beside the server
            del self.added[name]
        if self.supervisor.settings.serve_pulled:
            self.restore(specs)
        return [*specs, *(spec for name, spec in self.added.items() if name not in names)]

    def restore(self, named: list[ModelSpec]) -> list[ModelSpec]:
        """At start-up (and on a reload): the pulled models in the data dir that `named` (the command line's or
        config file's) does not serve and that are not served yet, as specs to serve (on demand at start-up: the
        module docstring). One that cannot be read is left out, said in the log: a pulled folder must not stop the
        server the operator configured."""
        names = {spec.name for spec in named}
        folders = {Path(spec.model_dir).resolve() for spec in named}
        specs = []
        for name, folder in pulled_folders():
            if name in names or name in self.added or folder.resolve() in folders:
                continue
            try:
                manifest = Manifest.load(folder)
                if manifest.task != "generate":
                    raise ValueError(f"a {manifest.task} model")  # a pull makes LLMs only
                spec = self._spec(name, folder, manifest, int((folder / MANIFEST_NAME).stat().st_mtime))
            except (OSError, ValueError, TypeError) as exc:  # ConfigError is a ValueError
                log.warning("a pulled model is not served", extra={"model": name, "error": str(exc)})
                continue
            self.added[name] = spec
            specs.append(spec)
        if specs:
            log.info("pulled models found", extra={"models": [s.name for s in specs]})
        return specs

    def prepare(self, spec: ModelSpec) -> None:
        """A restored model's slot ready and unloaded, its status read from its files (the module docstring); one
        whose files cannot be read is taken out of serving, the others serve."""
        from appliance.runtime.tokenizer import Tokenizer  # the engine process's: the tokenizers library

        folder = Path(spec.model_dir)
        try:
            manifest = Manifest.load(folder)
            tokenizer = Tokenizer.from_dir(folder)
            generation = folder / manifest.generation_config_file
            defaults = json.loads(generation.read_text()) if generation.is_file() else {}
            template = tokenizer.chat_template
            facts = p.EngineStatus(
                "ready",
                None,
                manifest.max_context,
                manifest.vocab_size,
                defaults,
                manifest.backend,
                manifest.weight_format,
                spec.engine.device,
                tool_prompt.choose_tool_parser(template, spec.tool_parser),
                tool_prompt.choose_reasoning_parser(template, spec.reasoning_parser),
            )
        except Exception as exc:  # a damaged folder: not served (failed, it would keep readiness 503), said in the log
            log.warning("a pulled model is not served", extra={"model": spec.name, "error": repr(exc)})
            settings = self.supervisor.settings
            self.added.pop(spec.name, None)
            self.supervisor.service.remove([spec.name])
            settings.models = [s for s in settings.models if s.name != spec.name]
            settings.save()
            return
        self.supervisor.service.registry.dormant(spec.name, facts, tokenizer)

    def serve(self, name: str) -> p.Reply:
        """Serve the pulled model `name` (a served one is reloaded from its new files); its state once loaded."""
        folder = paths.pulled_model(name)
        if folder is None:
            return _not_found(name)
        try:
            manifest = Manifest.load(folder)
        except (OSError, ValueError, TypeError) as exc:
            return p.Reply(error=p.Failed(500, f"the pulled model's manifest cannot be read: {exc}"))
        created = int((folder / MANIFEST_NAME).stat().st_mtime)
        current = {n: spec for n, (spec, _) in self.supervisor.service.specs().items()}
        if name in current and Path(current[name].model_dir).resolve() != folder.resolve():
            message = f"model '{name}' is served from {current[name].model_dir}: pulled into {folder}, not served"
            return p.Reply(error=p.Failed(409, message))
        if name in current:
            spec = replace(current[name], created=created)
        else:
            try:
                spec = self._spec(name, folder, manifest, created)
            except ConfigError as exc:
                return p.Reply(error=p.Failed(400, f"the pulled model cannot be served with these settings: {exc}"))
        if name in self.added or name not in current:
            self.added[name] = spec
        log.info("serving a pulled model", extra={"model": name, "model_dir": str(folder)})
        specs = [spec if n == name else s for n, s in current.items()] + ([] if name in current else [spec])
        _, infos = self.supervisor.reload(specs)
        info = next((i for i in infos if i.name == name), None)
        if info is None or info.state != "ready" or info.error:  # an error: the previous files still serve
            error = info.error if info is not None else "it is not served"
            return p.Reply(error=p.Failed(500, f"the model was pulled but failed to load: {error}"))
        return p.Reply(infos)

    def _spec(self, name: str, folder: Path, manifest: Manifest, created: int) -> ModelSpec:
        """The server's global engine and parser settings (the module docstring), checked for this export."""
        settings = self.supervisor.settings
        try:
            file = config_file.read(settings.config_file) if settings.config_file else None
        except ConfigError:
            file = None  # a file broken since start-up: the command line and defaults still apply
        values = config_file.effective(file, settings.startup_flags)
        engine = {flag: values[flag] for flag in config_file.ENGINE_FLAGS} | {"draft-model": None}
        return ModelSpec(
            name,
            str(folder),
            created,
            options.engine_config(engine, manifest),
            values["tool-parser"],
            values["reasoning-parser"],
        )

    def delete(self, name: str) -> p.Reply:
        """Stop serving the pulled model `name` (after its jobs) and delete its folder."""
        try:
            ref = hub_names.parse(name)
        except ValueError:
            ref = None
        current = {n: spec for n, (spec, _) in self.supervisor.service.specs().items()}
        served = name if name in current else ref.name if ref is not None and ref.name in current else None
        if served is not None:
            folder: Path | None = Path(current[served].model_dir)
            if not paths.is_pulled(current[served].model_dir):
                return p.Reply(
                    error=p.Failed(
                        400,
                        f"model '{name}' is served from {folder}, which `appliance pull` did not make: it is not "
                        "deleted here (take it out of the config file or the command line)",
                    )
                )
        else:
            folder = paths.pulled_model(name)
        if folder is None:  # no finished model: what an interrupted pull of it left, if anything
            if ref is not None and store.remove(paths.pulled_model_dir(ref)):
                log.info("deleted a partial pull", extra={"model": ref.name})
                return p.Reply()
            return _not_found(name)
        users = [n for n, spec in current.items() if Path(spec.model_dir).resolve() == folder.resolve()]
        named = [n for n in users if n not in self.added]
        if named:
            return p.Reply(
                error=p.Failed(
                    400,
                    f"model '{named[0]}' is served from {folder} because the config file or the command line names "
                    "it: take it out there first",
                )
            )
        if users:
            log.info("deleting a pulled model: stopping it first", extra={"model": users})
            self.supervisor.reload([spec for n, spec in current.items() if n not in users])
            for n in users:
                self.added.pop(n, None)
            deadline = time.monotonic() + self.supervisor.settings.graceful_timeout + DRAIN_MARGIN_SECONDS
            registry = self.supervisor.service.registry
            while any(registry.retiring(n) for n in users) and time.monotonic() < deadline:
                time.sleep(0.05)
        store.remove(folder)
        log.info("deleted a pulled model", extra={"model": served or name, "model_dir": str(folder)})
        return p.Reply()


def pulled_folders() -> list[tuple[str, Path]]:
    """(served name, folder) of every model `appliance pull` finished in the data dir: a folder with its manifest
    and the pull's record (appliance/pull/store.py RECORD: the repository and revision, so the name)."""
    found = []
    root = paths.pulled_models_dir()
    for record in sorted(root.glob(f"*/*/{store.RECORD}")):
        try:
            data = json.loads(record.read_text())
            name = hub_names.HubRef(str(data["repo"]), str(data["revision"])).name
            hub_names.parse(name)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if paths.pulled_model(name) == record.parent:  # laid out as a pull lays it (and its manifest written)
            found.append((name, record.parent))
    return found
