"""`appliance serve`: flags, else APPLIANCE_* variables (e.g. APPLIANCE_WORKERS=4), else a --config file, else defaults.

The config file, with OVMS's model_config_list for several models, is appliance/server/config_file.py's; `appliance
config` prints the effective configuration and where each value came from.

The flags, their help and defaults are the fields of ServeSettings, EngineConfig and Limits, declared there once;
this module keeps only what a command line needs: words and units (--precision, --kv-cache-size) and refusing
flags that cannot act (static shapes, NPU, ONNX; speculative decoding there)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import Field, asdict
from pathlib import Path
from typing import Any, NamedTuple, get_args, get_type_hints

from appliance import auth, devices, limits, logs
from appliance.config import EngineConfig
from appliance.manifest import MANIFEST_NAME, Manifest
from appliance.paths import compile_cache_dir, resolve_model
from appliance.server import tool_prompt
from appliance.settings import EX_CONFIG, ConfigError, ModelSpec, ServeSettings

log = logging.getLogger("appliance.serve")

# The serve flags, in --help's and docs/serving.md's order, by group: each is a field of one of these dataclasses,
# which declares its default and help once (appliance/limits.py `setting`); nothing below repeats a default.
# The environment variable is APPLIANCE_<FLAG IN UPPER SNAKE CASE>.
GROUPS: tuple[tuple[str, type], ...] = (
    ("server (ServeSettings, appliance/settings.py)", ServeSettings),
    ("engine (EngineConfig, appliance/config.py: the Python API's configuration too)", EngineConfig),
    ("request limits (Limits, appliance/limits.py)", limits.Limits),
)


class Option(NamedTuple):
    kind: type  # what argparse converts the text to
    default: Any  # the flag's default before its environment variable; None: not given
    help: str


def _kind(cls: type, f: Field) -> type:
    """The flag's type: declared (`kind`), else the field's annotation without its None."""
    if f.metadata.get("kind"):
        return f.metadata["kind"]
    hint = get_type_hints(cls)[f.name]
    return next((t for t in get_args(hint) if t is not type(None)), hint)


def _option(cls: type, f: Field) -> Option:
    default = f.metadata["cli"] if "cli" in f.metadata else limits.field_default(f)
    return Option(_kind(cls, f), default, f.metadata["help"])


def shown_default(f: Field) -> str:
    """A flag's default as --help and docs/serving.md write it: declared (`show`), else the flag's own, else the
    field's (a flag left unset gets the field's default)."""
    if f.metadata.get("show"):
        return f.metadata["show"].format(default=limits.show(limits.field_default(f)))
    return limits.show(f.metadata["cli"] if f.metadata.get("cli") is not None else limits.field_default(f))


FIELDS: dict[str, tuple[type, Field]] = {
    f.metadata["flag"]: (cls, f) for _, cls in GROUPS for f in limits.flag_fields(cls)
}
SERVE_OPTIONS: dict[str, Option] = {flag: _option(cls, f) for flag, (cls, f) in FIELDS.items()}


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_name(flag: str) -> str:
    return "APPLIANCE_" + flag.upper().replace("-", "_")


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
    return parser


def options_table() -> str:
    """docs/serving.md's "Options" table (tests/test_cli.py checks the document holds exactly this)."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for _, cls in GROUPS:
        for f in limits.flag_fields(cls):
            flag = f.metadata["flag"]
            name = f"`--{flag}` / `--no-{flag}`" if SERVE_OPTIONS[flag].kind is bool else f"`--{flag}`"
            rows.append(f"| {name} | {shown_default(f)} | {f.metadata['help']} |")
    return "\n".join(rows) + "\n"


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
    from appliance.server import config_file

    probe = argparse.ArgumentParser(add_help=False)
    add_serve_arguments(probe, probe=True)
    given = vars(probe.parse_known_args(argv[argv.index(args.command) + 1 :])[0])
    args.sources, args.pinned = {}, {}
    for flag in SERVE_OPTIONS:
        if flag.replace("-", "_") in given or os.environ.get(env_name(flag)):
            args.sources[flag] = "flag" if flag.replace("-", "_") in given else "env"
            args.pinned[flag] = getattr(args, flag.replace("-", "_"))
    try:
        args.config_loaded = config_file.read(args.config) if args.config else None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    values = config_file.effective(args.config_loaded, args.pinned)
    in_file = args.config_loaded.values if args.config_loaded else {}
    for flag, value in values.items():
        setattr(args, flag.replace("-", "_"), value)
        dropped = any(flag in pair and set(pair) & set(args.pinned) for pair in config_file.ALIASES)
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
        from appliance.server import config_file

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
        try:
            return config_file.model_specs(loaded, args.pinned)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    model_dir = resolve_model(args.model)
    try:
        manifest = Manifest.load(model_dir)
    except FileNotFoundError as exc:
        hint = " (build it with `make model` or `python -m export.default_model`)" if args.model == "default" else ""
        raise ConfigError(f"{exc}{hint}") from None
    created = int((Path(model_dir) / MANIFEST_NAME).stat().st_mtime)
    engine = engine_config(args, manifest)
    name = args.served_model_name or manifest.name
    return [ModelSpec(name, str(model_dir), created, engine, args.tool_parser, args.reasoning_parser)]


def _settings(args: argparse.Namespace):
    models = _models(args)
    if args.workers < 1 or args.threads < 1:
        raise ConfigError("--workers and --threads must be at least 1")
    if min(args.client_max_connections, args.client_max_generations) < 0:
        raise ConfigError("--client-max-connections and --client-max-generations must be at least 0")
    if min(args.request_timeout, args.send_timeout) <= 0 or args.keepalive_timeout < 0:
        raise ConfigError("--request-timeout and --send-timeout must be positive, --keepalive-timeout at least 0")
    settings = ServeSettings(  # model_dir, served_model_name, model_created: the first model's
        model_dir=models[0].model_dir,
        served_model_name=models[0].name,
        model_created=models[0].created,
        host=args.host,
        port=args.port,
        workers=args.workers,
        threads=args.threads,
        config_file=str(Path(args.config).resolve()) if args.config else None,
        api_key_file=str(Path(args.api_key_file).resolve()) if args.api_key_file else None,
        admin_key_file=str(Path(args.admin_key_file).resolve()) if args.admin_key_file else None,
        allow_unauthenticated=args.allow_unauthenticated,
        tls_certfile=str(Path(args.tls_certfile).resolve()) if args.tls_certfile else None,
        tls_keyfile=str(Path(args.tls_keyfile).resolve()) if args.tls_keyfile else None,
        allowed_hosts=args.allowed_hosts,
        max_body_bytes=args.max_body_bytes,
        limits=_limits(args),
        max_queued=max(model.engine.max_queued for model in models),  # workers refuse what fits no model's queue
        graceful_timeout=args.graceful_timeout,
        request_timeout=args.request_timeout,
        send_timeout=args.send_timeout,
        keepalive_timeout=args.keepalive_timeout,
        client_max_connections=args.client_max_connections,
        client_max_generations=args.client_max_generations,
        tool_parser=args.tool_parser,
        reasoning_parser=args.reasoning_parser,
        log_level=args.log_level.lower(),
        access_log=args.access_log,
    )
    try:  # a misspelt parser fails here, not at the first tool call
        tool_prompt.choose_tool_parser(None, settings.tool_parser)
        tool_prompt.choose_reasoning_parser(None, settings.reasoning_parser)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    auth.check_exposure(settings)  # keys, open bind, TLS files, allowed hosts: before any model loads
    settings.models = models
    from appliance.server.config_file import MODEL_FLAGS  # what a reload keeps from the command line

    settings.startup_flags = {k: v for k, v in getattr(args, "pinned", {}).items() if k in MODEL_FLAGS}
    return settings, models[0].engine


def effective_config(args: argparse.Namespace) -> dict[str, Any]:
    """`appliance config`: every serve flag's value and where it came from (flag, env, file, default), and the
    models `serve` would load with their engine settings (a model's own key: "model")."""
    from appliance.server.config_file import ALIASES, MODEL_FLAGS

    settings, _ = _settings(args)
    entries = args.config_loaded.models if args.config_loaded and args.config_loaded.models else [{}]
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


def _limits(args: argparse.Namespace) -> limits.Limits:
    """The request bounds from their flags (appliance/limits.py names them); each at least 1."""
    try:
        return limits.from_flags(
            {f.name: getattr(args, f.metadata["flag"].replace("-", "_")) for f in limits.flag_fields()}
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:(tokens)|([kmgt])(?:i?b)?|(b))?")


def parse_kv_cache_size(text: str) -> tuple[str, int] | None:
    """--kv-cache-size -> ("bytes", n), ("tokens", n), or None for auto. A bare number is GB, as OVMS's
    cache_size; every unit is binary (1 GB = 2**30 bytes, what OVMS / openvino_genai allocate)."""
    word = text.strip().lower()
    if word == "auto":
        return None
    m = _SIZE.fullmatch(word)
    if m and m[2] and m[1].isdigit() and int(m[1]) > 0:
        return "tokens", int(m[1])
    if m and not m[2]:
        value = int(float(m[1]) * (_UNITS[m[3]] if m[3] else 1 if m[4] else 1 << 30))
        if value > 0:
            return "bytes", value
    raise ConfigError(
        f"--kv-cache-size {text!r}: use GB as a bare number (2, 1.5), a size with a unit "
        "(512MB, 2GiB), a token count (16384tokens) or auto"
    )


def _kv_size(args: argparse.Namespace) -> tuple[str, int] | None:
    """--kv-cache-size or its alias --kv-cache-tokens (not both); None = auto."""
    if args.kv_cache_size is not None and args.kv_cache_tokens is not None:
        raise ConfigError(
            "give --kv-cache-size or --kv-cache-tokens (its alias), not both "
            f"(check {env_name('kv-cache-size')} / {env_name('kv-cache-tokens')})"
        )
    if args.kv_cache_tokens is not None:
        return "tokens", args.kv_cache_tokens
    size = parse_kv_cache_size(args.kv_cache_size) if args.kv_cache_size is not None else None
    from appliance.runtime.backends.kv_budget import meminfo_bytes  # here: the backends package loads numpy

    total = meminfo_bytes("MemTotal")
    if size and size[0] == "bytes" and total and size[1] > total:
        raise ConfigError(
            f"--kv-cache-size {args.kv_cache_size} is more than this machine's memory "
            f"({total / 2**30:.1f} GB); a bare number is GB (a token count is written 16384tokens)"
        )
    return size


def _static_knobs(args: argparse.Namespace, manifest, paged_only: bool) -> tuple[bool, dict]:
    """(static slots?, the --static-* values given). Slots (NPU, --static, ONNX) have no pool to size, so the
    paged-only flags are refused there, and the --static-* ones elsewhere."""
    static = args.static or args.device.upper().startswith("NPU")
    slots = static or manifest.backend == "onnx"
    where = "static shapes (--static, --device NPU, an ONNX model)"
    if args.static is False and static:
        raise ConfigError("--device NPU needs static shapes; drop --no-static")
    if slots and paged_only:
        raise ConfigError(
            f"--kv-cache-size/-tokens/-precision do not apply to {where}: their KV is "
            "--static-batch slots x --static-context positions in the graph's type"
        )
    knobs = {
        k: getattr(args, k)
        for k in ("static_context", "static_batch", "static_prefill_chunk", "max_prompt_len")
        if getattr(args, k) is not None
    }
    if knobs and not slots:
        raise ConfigError(f"--{next(iter(knobs)).replace('_', '-')} applies to {where} only")
    return slots, knobs


def _cache_dir(word: str, manifest) -> Path | None:
    """--cache-dir: auto (appliance/paths.py compile_cache_dir), none (off), or a path. ONNX models have no compile
    cache: a path given on the command line is refused, one from APPLIANCE_CACHE_DIR (box-wide) is ignored."""
    if word.strip().lower() == "none":
        return None
    if manifest.backend == "onnx":
        if word.strip().lower() != "auto" and word != os.environ.get(env_name("cache-dir")):
            raise ConfigError("--cache-dir is OpenVINO's compiled-model cache; this is an ONNX model")
        return None
    cache_dir = compile_cache_dir() if word.strip().lower() == "auto" else Path(word).expanduser().resolve()
    if cache_dir.exists() and not cache_dir.is_dir():
        raise ConfigError(f"--cache-dir {word} is not a directory")
    return cache_dir


def _speculation(args: argparse.Namespace, slots: bool) -> dict[str, Any]:
    """EngineConfig's speculative-decoding settings, checked. Drafts are verified several positions per sequence in
    one step over the paged KV, so slots (static shapes, ONNX), which decode one token per slot and step, refuse
    them. A draft model must be an OpenVINO export (its own paged KV pool); the model itself is allowed as its own
    draft (every draft accepted: the cost of verifying, measured, not a speed-up). The engine checks the tokenizers
    match."""
    bound = limits.Limits().assistant_tokens, limits.Limits().ngram_size
    if not 1 <= args.num_assistant_tokens <= bound[0]:
        raise ConfigError(f"--num-assistant-tokens must be between 1 and {bound[0]} (a request may send 0)")
    if not 1 <= args.max_ngram_size <= bound[1]:
        raise ConfigError(f"--max-ngram-size must be between 1 and {bound[1]}")
    if args.speculation_max_batch < 1:
        raise ConfigError("--speculation-max-batch must be at least 1")
    if args.draft_device is not None and not args.draft_model:
        raise ConfigError("--draft-device needs --draft-model (it is the draft model's device)")
    if args.prompt_lookup and args.draft_model:
        raise ConfigError("give --prompt-lookup or --draft-model, not both (one proposer per model)")
    if slots and (args.prompt_lookup or args.draft_model):
        raise ConfigError(
            f"--{'draft-model' if args.draft_model else 'prompt-lookup'} needs paged attention: static "
            "shapes (--static, --device NPU) and ONNX models decode one token per slot and step, so they cannot "
            "verify draft tokens"
        )
    draft = None
    if args.draft_model:
        draft = resolve_model(args.draft_model).resolve()
        try:
            backend = Manifest.load(draft).backend
        except FileNotFoundError:
            raise ConfigError(
                f"--draft-model {args.draft_model} is not a model export (no {MANIFEST_NAME} there)"
            ) from None
        if backend != "openvino":
            raise ConfigError(f"--draft-model {args.draft_model} is an ONNX export; a draft must be OpenVINO")
    return {
        "prompt_lookup": bool(args.prompt_lookup),
        "draft_model": str(draft) if draft else None,
        "draft_device": args.draft_device,
        "num_assistant_tokens": args.num_assistant_tokens,
        "max_ngram_size": args.max_ngram_size,
        "speculation_max_batch": args.speculation_max_batch,
    }


def engine_config(args: argparse.Namespace | Mapping[str, Any], manifest) -> EngineConfig:
    """The engine's knobs from the parsed flags, checked here so a mistake is one line, not a traceback. `args` may
    be a mapping of the engine flags (by flag or attribute name): one model of a config file's model_config_list."""
    if isinstance(args, Mapping):
        args = argparse.Namespace(**{key.replace("-", "_"): value for key, value in args.items()})
    if args.precision not in ("f32", "default"):
        raise ConfigError("--precision must be 'f32' or 'default'")
    for name in (
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_queued",
        "num_threads",
        "kv_cache_tokens",
        "static_context",
        "static_batch",
        "static_prefill_chunk",
        "max_prompt_len",
    ):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    precision = args.kv_cache_precision.strip().lower()
    if precision not in ("u8", "f16", "f32", "auto"):
        raise ConfigError("--kv-cache-precision must be u8, f16, f32 or auto")
    size = _kv_size(args)
    slots, knobs = _static_knobs(args, manifest, paged_only=size is not None or precision != "auto")
    cache_dir = _cache_dir(args.cache_dir, manifest)
    speculation = _speculation(args, slots)
    sharing = args.prefix_cache_sharing.strip().lower()  # the prefix cache per API key or shared (docs/kv-cache.md)
    if sharing not in ("keys", "shared"):
        raise ConfigError("--prefix-cache-sharing must be keys or shared")
    engine = EngineConfig(
        device=args.device,
        precision="f32" if args.precision == "f32" else None,
        kv_cache_precision=None if precision == "auto" else precision,
        kv_cache_tokens=size[1] if size and size[0] == "tokens" else None,
        kv_cache_bytes=size[1] if size and size[0] == "bytes" else None,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_queued=args.max_queued,
        prefix_caching=args.enable_prefix_caching,
        prefix_cache_sharing=sharing,
        static=bool(args.static),
        num_threads=args.num_threads,
        cache_dir=str(cache_dir) if cache_dir else None,
        **knobs,
        **speculation,
    )
    seqs = min(engine.max_num_seqs, engine.static_batch) if slots else engine.max_num_seqs
    if engine.max_num_batched_tokens < seqs:
        raise ConfigError(
            f"--max-num-batched-tokens ({engine.max_num_batched_tokens}) must be at least "
            f"the sequences decoded per step ({seqs}): each takes one token of it"
        )
    return engine


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
    if args.command == "config":
        print(json.dumps(effective_config(args), indent=1))
        return 0
    if args.command == "serve":
        from appliance.server.supervisor import serve

        settings, engine = _settings(args)
        wanted = (d for spec in settings.models for d in (spec.engine.device, spec.engine.draft_device) if d)
        try:
            devices.require(wanted)  # one line naming those present
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return serve(settings, engine)
    if args.command == "devices":
        return devices.main(args.json)
    return 2


if __name__ == "__main__":
    sys.exit(main())
