"""The `--config` file: one JSON file (OVMS's config.json is JSON) holding serve flags by name and, optionally,
OVMS's `model_config_list` to serve several models, each with its own engine settings.

Precedence, one rule everywhere: a flag on the command line > its APPLIANCE_* variable > the file's top-level value
> the flag's default; then, for one model, a key in its `model_config_list` entry > that global value. A reload
(`reload_models`, POST /v1/config/reload) re-reads the file and applies the same rule: the flags and variables given
at start-up are kept in ServeSettings.startup_flags, so no argparse runs in the engine process, and a reload cannot
undo what the command line said. Only the models (and the engine and parser keys they inherit) change on a reload;
the server's own settings (port, workers, keys) take effect at the next start.

Everything is checked before anything loads, and a mistake is one line naming the file and key: a ConfigError, which
the server answers a reload with as a 400 and appliance/cli.py's `main` turns into one line and exit 78 at start-up.
The option table and the engine checks are appliance/options.py's (`engine_config`), run on each model's merged
mapping: an inherited value is checked as if that model's flag (a global kv_cache_size and an NPU model are refused:
say it per model), except a box-wide cache_dir, which an ONNX model (no compile cache) skips, as it skips
APPLIANCE_CACHE_DIR.

No numpy or OpenVINO at import (tests/server/test_config.py checks): the engine process imports this for reloads, and
the CLI for every `serve` and `config`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance import options
from appliance.config import EngineConfig
from appliance.keep_alive import parse_keep_alive
from appliance.manifest import MANIFEST_NAME, Manifest
from appliance.paths import pulled_model, resolve_model
from appliance.server import tool_prompt
from appliance.settings import ConfigError, ModelSpec, ServeSettings

MODEL_LIST = "model_config_list"  # OVMS's key: [{"config": {"name": ..., "base_path": ..., ...}}]
# What one model may set for itself: every engine flag (OVMS spells --device `target_device` and --draft-model its
# graph option `draft_models_path`; `draft_device` is both's) and the output parsers.
ENGINE_FLAGS = tuple(flag for flag, (cls, _) in options.FIELDS.items() if cls is EngineConfig)
MODEL_FLAGS = (*ENGINE_FLAGS, "tool-parser", "reasoning-parser", "keep-alive")
MODEL_ALIASES = {"target_device": "device", "draft_models_path": "draft-model"}
# Flags naming a file or directory, and their words that are not paths: in the file, a path is relative to the
# file's directory (as OVMS's base_path).
PATH_FLAGS = {
    "model": ("default",),
    "cache-dir": ("auto", "none"),
    "draft-model": ("default",),
    "api-key-file": (),
    "admin-key-file": (),
    "tls-certfile": (),
    "tls-keyfile": (),
}
# Aliases of one setting: a value for one, given at a higher level, drops the other from the levels below it.
ALIASES = (("kv-cache-size", "kv-cache-tokens"),)
_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


@dataclass
class ConfigFile:
    """A checked config file: top-level serve flags (typed, paths absolute) and the model entries, if any."""

    path: str
    values: dict[str, Any]  # flag name -> value
    models: list[dict[str, Any]] | None  # each: name, base_path (absolute or "default"), flag name -> value


def _typed(where: str, key: str, flag: str, raw: Any, base: Path) -> Any:
    """A JSON value as the flag's type (what argparse would have made of the text); paths relative to `base`."""
    kind, default, _ = options.SERVE_OPTIONS[flag]
    if raw is None and default is None:
        return None  # "not set", as the flag's own default
    number = isinstance(raw, (int, float)) and not isinstance(raw, bool)
    if kind is str and number and flag in ("kv-cache-size", "keep-alive"):
        raw = str(raw)  # a bare number is GB, as OVMS's cache_size; keep_alive: seconds, as Ollama
    elif kind is float and number:
        raw = float(raw)
    if not isinstance(raw, kind) or (kind is int and isinstance(raw, bool)):
        raise ConfigError(f"{where}: {key!r} must be {_KINDS[kind]}, not {json.dumps(raw)}")
    if flag in PATH_FLAGS and str(raw).strip().lower() not in PATH_FLAGS[flag]:
        raw = str((base / Path(str(raw)).expanduser()).resolve())
    return raw


def _model_entry(path: str, index: int, entry: Any, base: Path) -> dict[str, Any]:
    where = f"{path}: {MODEL_LIST}[{index}]"
    if not isinstance(entry, dict) or set(entry) != {"config"} or not isinstance(entry["config"], dict):
        raise ConfigError(f'{where}: each entry is {{"config": {{"name": ..., "base_path": ..., ...}}}}')
    model: dict[str, Any] = {}
    for key, raw in entry["config"].items():
        if key in ("name", "base_path"):
            if not isinstance(raw, str) or not raw.strip():
                raise ConfigError(f"{where}: {key!r} must be a non-empty string")
            model[key] = raw
            continue
        flag = MODEL_ALIASES.get(key, key.replace("_", "-"))
        if flag not in MODEL_FLAGS:
            raise ConfigError(
                f"{where}: unknown key {key!r} (a model takes name, base_path, target_device, draft_models_path, "
                "the engine flags, tool_parser / reasoning_parser and keep_alive)"
            )
        if flag in model:
            raise ConfigError(f"{where}: {key!r} is given twice (as {flag!r} and an alias)")
        model[flag] = _typed(where, key, flag, raw, base)
    for key in ("name", "base_path"):
        if key not in model:
            raise ConfigError(f"{where}: no {key!r}")
    base_path = model["base_path"]
    folder = (base / Path(base_path).expanduser()).resolve()
    # "default", a folder (relative to the file), or a pulled model's name (appliance/paths.py resolve_model)
    keep = base_path == "default" or (not folder.exists() and pulled_model(base_path) is not None)
    model["base_path"] = base_path if keep else str(folder)
    return model


def read(path: str | Path) -> ConfigFile:
    """The file, checked: JSON object, known keys, right types, unique model names. ConfigError names what is wrong."""
    path = str(path)

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:  # JSON would keep the last of two: a mistake
        keys = [key for key, _ in pairs]
        twice = next((key for i, key in enumerate(keys) if key in keys[:i]), None)
        if twice is not None:
            raise ConfigError(f"{path}: key {twice!r} appears twice in one object")
        return dict(pairs)

    try:
        data = json.loads(Path(path).read_text(), object_pairs_hook=unique)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not JSON: not UTF-8 text") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config file must hold a JSON object")
    base = Path(path).resolve().parent
    values: dict[str, Any] = {}
    models = None
    for key, raw in data.items():
        if key == MODEL_LIST:
            if not isinstance(raw, list) or not raw:
                raise ConfigError(f"{path}: {MODEL_LIST!r} must be a non-empty list of models")
            models = [_model_entry(path, i, entry, base) for i, entry in enumerate(raw)]
            continue
        flag = key.replace("_", "-")
        if flag not in options.SERVE_OPTIONS or flag == "config":
            raise ConfigError(f"{path}: unknown key {key!r} (the serve flags by name, and {MODEL_LIST})")
        if flag in values:
            raise ConfigError(f"{path}: {key!r} is given twice")
        values[flag] = _typed(path, key, flag, raw, base)
    if models is not None:
        clash = [f"{flag!r}" for flag in ("model", "served-model-name") if flag in values]
        if clash:
            raise ConfigError(f"{path}: {' and '.join(clash)} cannot go with {MODEL_LIST}: name each model there")
        names = [model["name"] for model in models]
        twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
        if twice is not None:
            raise ConfigError(f"{path}: model name {twice!r} appears twice in {MODEL_LIST}")
    return ConfigFile(path, values, models)


def layer(lower: dict[str, Any], upper: dict[str, Any]) -> dict[str, Any]:
    """`upper` over `lower`; a value given for one of two aliases in `upper` drops the other from `lower`."""
    merged = dict(lower)
    for pair in ALIASES:
        given = [flag for flag in pair if flag in upper]
        if len(given) == 1:
            merged.update({flag: None for flag in pair if flag not in upper})
    return {**merged, **upper}


def effective(file: ConfigFile | None, pinned: dict[str, Any]) -> dict[str, Any]:
    """Every serve flag's value: `pinned` (command line, APPLIANCE_*) > the file's top level > the default."""
    defaults = {flag: option.default for flag, option in options.SERVE_OPTIONS.items()}
    return layer(layer(defaults, file.values if file else {}), pinned)


def model_specs(file: ConfigFile, pinned: dict[str, Any]) -> list[ModelSpec]:
    """The file's models, each with its engine settings: its own keys > `effective` global values. Each export is
    read and each engine mapping checked as `appliance serve` checks its flags."""
    assert file.models is not None
    values = effective(file, pinned)
    specs = []
    for model in file.models:
        where = f"{file.path}: model {model['name']!r}"
        merged = layer(
            {flag: values[flag] for flag in MODEL_FLAGS}, {k: v for k, v in model.items() if k in MODEL_FLAGS}
        )
        model_dir = resolve_model(model["base_path"])
        try:
            manifest = Manifest.load(model_dir)
        except FileNotFoundError as exc:
            raise ConfigError(f"{where}: base_path {exc}") from None
        if manifest.backend == "onnx" and "cache-dir" not in model:  # a box-wide cache dir: OpenVINO models only
            merged["cache-dir"] = "auto"
        try:
            engine = options.engine_config({flag: merged[flag] for flag in ENGINE_FLAGS}, manifest)
        except ConfigError as exc:  # the flags' own checks, reworded for a file
            raise ConfigError(f"{where}: {exc}") from None
        try:
            tool_prompt.choose_tool_parser(None, merged["tool-parser"])
            tool_prompt.choose_reasoning_parser(None, merged["reasoning-parser"])
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        try:
            parse_keep_alive(merged["keep-alive"])
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        created = int((model_dir / MANIFEST_NAME).stat().st_mtime)
        specs.append(
            ModelSpec(
                model["name"],
                str(model_dir),
                created,
                engine,
                merged["tool-parser"],
                merged["reasoning-parser"],
                str(merged["keep-alive"]),
            )
        )
    return specs


def reload_models(settings: ServeSettings) -> list[ModelSpec]:
    """The models settings.config_file lists now, with start-up's precedence (settings.startup_flags still win over
    the file). ConfigError (a ValueError) with a one-line message on any problem; nothing is loaded here."""
    if not settings.config_file:
        raise ConfigError("the server was started without --config: there is no config file to reload")
    file = read(settings.config_file)
    if file.models is None:
        raise ConfigError(f"{settings.config_file}: no {MODEL_LIST} to reload")
    return model_specs(file, settings.startup_flags)
