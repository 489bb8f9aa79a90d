"""`appliance serve`: flags, else APPLIANCE_* variables (e.g. APPLIANCE_WORKERS=4), else a --config file, else defaults.

The config file, with OVMS's model_config_list for several models, is appliance/server/config_file.py's; `appliance
config` prints the effective configuration and where each value came from.

The flags, their help and defaults are the fields of ServeSettings, EngineConfig and Limits, declared there once;
their table and checks are appliance/options.py's, shared with the config file's reload. This module keeps what a
command line needs: argparse, the APPLIANCE_* variables, flag > variable > file > default, and `main`, the one
place a ConfigError becomes a line on stderr and exit 78."""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from appliance import auth, cpu_isa, devices, limits, logs, state
from appliance.manifest import MANIFEST_NAME, VLM_PAGED_ONLY, Manifest
from appliance.options import (
    GROUPS,
    SERVE_OPTIONS,
    check_server,
    embedding_spec,
    engine_config,
    env_name,
    limits_from,
    options_table,
    shown_default,
)
from appliance.paths import resolve_model
from appliance.pull import command as pull_command
from appliance.runtime import kernels
from appliance.server import config_file, tool_prompt
from appliance.server.config_file import ALIASES, MODEL_FLAGS
from appliance.settings import EX_CONFIG, ConfigError, ModelSpec, ServeSettings

log = logging.getLogger("appliance.serve")
PATH_FIELDS = ("config_file", "api_key_file", "admin_key_file", "tls_certfile", "tls_keyfile")  # made absolute


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

# APPLIANCE_* variables that are not serve flags: the data dir (appliance/paths.py), the server's own plumbing
# (settings.RUNTIME_DIR_ENV, protocol.FAULT_INJECTION_ENV, ollama_api/pull.py PARENT_ENV), the test suite's knobs
# and the kernels' (runtime/kernels/__init__.py); and the ones Kubernetes injects for a Service named `appliance`
# (APPLIANCE_SERVICE_HOST, APPLIANCE_PORT_8000_TCP_ADDR, ...).
OTHER_VARIABLES = frozenset(
    "APPLIANCE_" + name
    for name in (
        "DATA_DIR RUNTIME_DIR FAULT_INJECTION PULL_PARENT "
        "SERVING_VENV ARTIFACTS_DIR FUZZ_SEED FUZZ_EXAMPLES FUZZ_DOC RAW_FUZZ_REQUESTS"
    ).split()
) | {kernels.LIBRARY_ENV, kernels.ISA_ENV, kernels.MIN_WEIGHTS_ENV, kernels.RESIDUAL_ENV}
KUBERNETES_LINKS = re.compile(r"APPLIANCE_(SERVICE_[A-Z0-9_]+|PORT_\d+_(TCP|UDP|SCTP)(_[A-Z]+)?)")
TYPO_CUTOFF = 0.85  # difflib's ratio: APPLIANCE_WORKRES ~ APPLIANCE_WORKERS 0.94, APPLIANCE_KV_CACHE ~ _SIZE 0.88


class InvalidEnv:
    """An APPLIANCE_* value its flag's type refuses. It becomes the flag's default instead of an error at once: a flag
    given on the command line overrides it (Kubernetes sets APPLIANCE_PORT=tcp://... for a Service named
    `appliance`), and `parse` refuses the ones still in force. Not a str: argparse would convert a str default."""

    def __init__(self, message: str):
        self.message = message

    def __str__(self) -> str:
        return self.message


def _env_default(flag: str, kind, default):
    raw = os.environ.get(env_name(flag))
    if raw is None or raw == "":
        return default
    if kind is bool:
        word = raw.strip().lower()
        if word not in _TRUE + _FALSE:
            return InvalidEnv(f"{env_name(flag)}={raw!r} is not a boolean (1/0, true/false, yes/no, on/off)")
        return word in _TRUE
    try:
        return kind(raw)
    except ValueError:
        return InvalidEnv(f"{env_name(flag)}={raw!r} is not a valid {kind.__name__}")


def check_variables(environ: dict[str, str] | os._Environ) -> None:
    """Unknown APPLIANCE_* variables: on a box configured through an env file, a misspelt name would otherwise be
    silently ignored and the server run with the default. One that is close to a setting's name is a typo: the
    start is refused (one line naming the setting it resembles, exit 78). Any other is warned about (one line
    each) and ignored: it may be another tool's."""
    known = {env_name(flag) for flag in SERVE_OPTIONS} | OTHER_VARIABLES
    for name in sorted(n for n in environ if n.startswith("APPLIANCE_") and n not in known):
        if KUBERNETES_LINKS.fullmatch(name):
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=TYPO_CUTOFF)
        if close:
            raise ConfigError(f"{name} is not a setting: did you mean {close[0]}? (`appliance serve --help`)")
        log.warning(f"{name} is not a setting of appliance serve: ignored", extra={"variable": name})


def add_serve_arguments(parser: argparse.ArgumentParser, probe: bool = False) -> None:
    """The serve flags, shared by `serve` and `config`. `probe`: every default "not given" (argparse.SUPPRESS), to
    tell which flags the command line holds (flag > env > config file > default, appliance/server/config_file.py)."""
    for title, cls in GROUPS:
        group = parser.add_argument_group(title)
        for f in limits.flag_fields(cls):
            flag = f.metadata["flag"]
            kind, default, help_text = SERVE_OPTIONS[flag]
            value = argparse.SUPPRESS if probe else _env_default(flag, kind, default)
            if kind is bool:
                group.add_argument(
                    f"--{flag}",
                    action=argparse.BooleanOptionalAction,
                    default=value,
                    help=f"{help_text} (env {env_name(flag)}=1/0, default {shown_default(f)})".replace("%", "%%"),
                )
            else:
                shown = "" if shown_default(f) == "none" else f", default {shown_default(f)}"
                group.add_argument(
                    f"--{flag}",
                    type=kind,
                    default=value,
                    help=f"{help_text} (env {env_name(flag)}{shown})".replace("%", "%%"),
                )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="appliance", description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve the OpenAI-compatible API (OVMS flavour)",
        description="Serve a model over the OVMS-compatible OpenAI API. Every flag can also be set with an "
        "APPLIANCE_* environment variable, e.g. APPLIANCE_WORKERS=4, or in a --config file (docs/deploy.md).",
    )
    add_serve_arguments(serve)
    config = sub.add_parser(
        "config",
        help="print the effective configuration of `serve` with the same flags, as JSON",
        description="Print what `appliance serve` with the same flags would run with, as JSON: every setting, "
        "where it came from (flag, env, file, default), and the models with their engine settings.",
    )
    add_serve_arguments(config)
    listing = sub.add_parser(
        "devices",
        help="list the OpenVINO devices on this machine (for --device)",
        description="The OpenVINO devices present (CPU, GPU.0, NPU): name, optimization capabilities, details.",
    )
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pull_command.add_arguments(sub)  # `pull` and `rm`: appliance/pull/command.py
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line with the --config file slotted in: flag > APPLIANCE_* > file > default (the file's rules:
    appliance/server/config_file.py). Adds `sources` (serve flag -> flag/env/file/default), `pinned` (the values
    the command line and environment set) and `config_loaded` (the checked file, or None)."""
    args = build_parser().parse_args(argv)
    if args.command not in ("serve", "config"):
        return args
    invalid = next((v for v in vars(args).values() if isinstance(v, InvalidEnv)), None)
    if invalid is not None:
        raise ConfigError(str(invalid))
    probe = argparse.ArgumentParser(add_help=False)
    add_serve_arguments(probe, probe=True)
    given = vars(probe.parse_known_args(argv[argv.index(args.command) + 1 :])[0])
    args.sources, args.pinned = {}, {}
    for flag in SERVE_OPTIONS:
        if flag.replace("-", "_") in given or os.environ.get(env_name(flag)):
            args.sources[flag] = "flag" if flag.replace("-", "_") in given else "env"
            args.pinned[flag] = getattr(args, flag.replace("-", "_"))
    args.config_loaded = config_file.read(args.config) if args.config else None
    values = config_file.effective(args.config_loaded, args.pinned)
    in_file = args.config_loaded.values if args.config_loaded else {}
    for flag, value in values.items():
        setattr(args, flag.replace("-", "_"), value)
        dropped = any(flag in pair and set(pair) & set(args.pinned) for pair in ALIASES)
        args.sources.setdefault(flag, "file" if flag in in_file and not dropped else "default")
    return args


def _models(args: argparse.Namespace) -> list[ModelSpec]:
    """The served models: the --config file's model_config_list, else --model with the engine flags.

    A model list beside a model named in the environment (APPLIANCE_MODEL / APPLIANCE_SERVED_MODEL_NAME): the
    list wins, with an info line. The environment is the box's default (the systemd env file ships
    APPLIANCE_MODEL=default), and pointing APPLIANCE_CONFIG at a file with a list is how an operator asks for
    several models. On the command line the two stay an error: someone typed both."""
    loaded = getattr(args, "config_loaded", None)
    if loaded is not None and loaded.models is not None:
        named = [f"--{flag}" for flag in ("model", "served-model-name") if args.sources[flag] == "flag"]
        if named:
            raise ConfigError(
                f"{' and '.join(named)} cannot go with {loaded.path}'s {config_file.MODEL_LIST}: name each model there"
            )
        from_env = [env_name(flag) for flag in ("model", "served-model-name") if args.sources[flag] == "env"]
        if from_env:
            log.info(
                f"{config_file.MODEL_LIST} of the config file wins over {' and '.join(from_env)} from the environment",
                extra={"config_file": loaded.path, "ignored": from_env},
            )
        return config_file.model_specs(loaded, args.pinned)
    model_dir = resolve_model(args.model)
    try:
        manifest = Manifest.load(model_dir)
    except FileNotFoundError as exc:
        hint = " (build it with `make model` or `python -m export.default_model`)" if args.model == "default" else ""
        raise ConfigError(f"{exc}{hint}") from None
    created = int((Path(model_dir) / MANIFEST_NAME).stat().st_mtime)
    engine = engine_config(args, manifest)
    if manifest.is_vlm and (engine.static or engine.device.upper().startswith("NPU")):
        raise ConfigError(f"{model_dir}: {VLM_PAGED_ONLY}")
    name = args.served_model_name or manifest.name
    chat = ModelSpec(name, str(model_dir), created, engine, args.tool_parser, args.reasoning_parser)
    return [chat, *filter(None, [embedding_spec(args, name)])]  # --embedding-model: beside it, under its own name


def _settings(args: argparse.Namespace):
    models = _models(args)
    check_server(args)
    # Every server flag is a ServeSettings field of the same name (a new flag needs no line here); the files as
    # absolute paths; the first model's directory and name.
    values = {f.name: getattr(args, f.metadata["flag"].replace("-", "_")) for f in limits.flag_fields(ServeSettings)}
    values |= {name: str(Path(values[name]).resolve()) for name in PATH_FIELDS if values[name]}
    values.update(model_dir=models[0].model_dir, served_model_name=models[0].name, log_level=args.log_level.lower())
    settings = ServeSettings(
        **values,
        model_created=models[0].created,
        limits=limits_from(args),
        max_queued=max(model.engine.max_queued for model in models),  # workers refuse what fits no model's queue
    )
    try:  # a misspelt parser fails here, not at the first tool call
        tool_prompt.choose_tool_parser(None, settings.tool_parser)
        tool_prompt.choose_reasoning_parser(None, settings.reasoning_parser)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    auth.check_exposure(settings)  # keys, open bind, TLS files, allowed hosts: before any model loads
    settings.models = models
    # what a reload keeps from the command line
    settings.startup_flags = {k: v for k, v in getattr(args, "pinned", {}).items() if k in MODEL_FLAGS}
    return settings, models[0].engine


def effective_config(args: argparse.Namespace) -> dict[str, Any]:
    """`appliance config`: every serve flag's value and where it came from (flag, env, file, default), and the
    models `serve` would load with their engine settings (a model's own key: "model")."""
    settings, _ = _settings(args)
    entries = (
        args.config_loaded.models if args.config_loaded and args.config_loaded.models else [{}] * len(settings.models)
    )
    models = []
    for spec, own in zip(settings.models, entries, strict=True):
        mine = {flag for flag in MODEL_FLAGS if flag in own or any(flag in p and set(p) & set(own) for p in ALIASES)}
        models.append(
            {
                **asdict(spec),
                "sources": {flag: "model" if flag in mine else args.sources[flag] for flag in MODEL_FLAGS},
            }
        )
    return {
        "config_file": settings.config_file,
        "settings": {flag: getattr(args, flag.replace("-", "_")) for flag in SERVE_OPTIONS},
        "sources": args.sources,
        "models": models,
    }


def main(argv: list[str] | None = None) -> int:
    """The entry point: a setting that cannot run (ConfigError, from any check) is one line on stderr and exit
    EX_CONFIG (78), here and nowhere else; argparse's usage errors stay 2 and a crash 1."""
    try:
        return _main(argv)
    except ConfigError as exc:
        print(f"appliance: {exc}", file=sys.stderr)
        return EX_CONFIG


def _main(argv: list[str] | None) -> int:
    if (sys.argv[1:] if argv is None else argv) == ["--options-table"]:  # the table for docs/serving.md
        print(options_table(), end="")
        return 0
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.command in ("serve", "config"):
        logs.setup(args.log_level.lower())  # what the checks below log (JSON lines on stderr, as the server's)
        check_variables(os.environ)
    if args.command == "config":
        print(json.dumps(effective_config(args), indent=1))
        return 0
    if args.command == "serve":
        from appliance.server.supervisor import serve

        settings, engine = _settings(args)
        state.check_state_dir(settings)  # before any model loads: a store that cannot write is no 500 later
        if cpu_isa.single_thread_amx_cap(spec.engine for spec in settings.models):  # before the plugin loads
            log.warning(
                "AMX off in this process: OpenVINO's CPU plugin cannot compile bf16 on AMX with --num-threads 1",
                extra={"variable": f"{cpu_isa.CAP_ENV}={cpu_isa.SINGLE_THREAD_AMX_CAP}"},
            )
        wanted = (d for spec in settings.models for d in (spec.engine.device, spec.engine.draft_device) if d)
        devices.require(wanted)  # one line naming those present
        return serve(settings, engine)
    if args.command == "devices":
        return devices.main(args.json)
    if args.command in ("pull", "rm"):
        return pull_command.main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
