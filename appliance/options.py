"""The serve options and their checks: one table of flags (from the fields of ServeSettings, EngineConfig and
Limits, which declare each default and help once) and the functions that turn their values into what the server
runs with, or refuse them with a ConfigError of one line.

Two callers share it: appliance/cli.py at start-up (argparse, then `main` turns a ConfigError into one line on
stderr and exit 78) and appliance/server/config_file.py, which runs the same checks on a --config file's models at
start-up and on a reload in the engine process (where a ConfigError becomes a 400, not an exit). So this module
is shared by the root's rules: it imports only the package root, never the CLI, the server or the runtime
(tests/test_architecture.py), and no numpy or OpenVINO (the memory check reads /proc/meminfo via
appliance/host.py). What stays in cli.py is what only a command line has: argparse, the APPLIANCE_* variables
and the precedence of flag, variable and file."""

from __future__ import annotations

import argparse
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import Field
from pathlib import Path
from typing import Any, NamedTuple, get_args, get_type_hints

from appliance import host, limits, tracing
from appliance.config import EngineConfig
from appliance.keep_alive import parse_keep_alive
from appliance.manifest import MANIFEST_NAME, Manifest
from appliance.paths import compile_cache_dir, default_embedding_dir, resolve_model
from appliance.settings import ENCODER_SCHEDS, ConfigError, ModelSpec, ServeSettings

__all__ = [
    "FIELDS",
    "GROUPS",
    "SERVE_OPTIONS",
    "ConfigError",
    "Option",
    "check_server",
    "embedding_spec",
    "engine_config",
    "env_name",
    "limits_from",
    "options_table",
    "parse_kv_cache_size",
    "parse_memory_budget",
    "shown_default",
]

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


def env_name(flag: str) -> str:
    return "APPLIANCE_" + flag.upper().replace("-", "_")


def options_table() -> str:
    """docs/serving.md's "Options" table (tests/server/test_cli.py checks the document holds exactly this)."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for _, cls in GROUPS:
        for f in limits.flag_fields(cls):
            flag = f.metadata["flag"]
            name = f"`--{flag}` / `--no-{flag}`" if SERVE_OPTIONS[flag].kind is bool else f"`--{flag}`"
            rows.append(f"| {name} | {shown_default(f)} | {f.metadata['help']} |")
    return "\n".join(rows) + "\n"


def check_server(args: argparse.Namespace) -> None:
    """The ranges of the server's own settings (argparse checks only their types): worker and thread counts,
    per-client caps, timeouts, the Responses API's store, the trace exporter's settings, the encoder's priority,
    and a body limit that carries one image at the image limit (limits.image_body_bytes)."""
    if args.responses_retention <= 0 or args.responses_max_bytes < 0:
        raise ConfigError("--responses-retention must be positive, --responses-max-bytes at least 0")
    if args.workers < 1 or args.threads < 1:
        raise ConfigError("--workers and --threads must be at least 1")
    if min(args.client_max_connections, args.client_max_generations) < 0:
        raise ConfigError("--client-max-connections and --client-max-generations must be at least 0")
    if min(args.request_timeout, args.send_timeout) <= 0 or args.keepalive_timeout < 0:
        raise ConfigError("--request-timeout and --send-timeout must be positive, --keepalive-timeout at least 0")
    if args.image_url_timeout <= 0:
        raise ConfigError("--image-url-timeout must be positive")
    if args.max_image_bytes >= 1 and args.max_body_bytes < limits.image_body_bytes(args.max_image_bytes):
        most = (args.max_body_bytes - limits.IMAGE_BODY_ROOM) // 4 * 3
        raise ConfigError(
            f"--max-body-bytes {args.max_body_bytes} cannot carry one image of --max-image-bytes "
            f"{args.max_image_bytes} (base64: {limits.base64_chars(args.max_image_bytes)} bytes, and "
            f"{limits.IMAGE_BODY_ROOM} for the rest of the request): raise --max-body-bytes to at least "
            f"{limits.image_body_bytes(args.max_image_bytes)}"
            + (f" or lower --max-image-bytes to at most {most}" if most >= 1 else "")
        )
    tracing.endpoint(args.otlp_endpoint)  # OpenTelemetry: a URL or OTEL_* setting it cannot export with
    try:
        parse_keep_alive(args.keep_alive)
    except ValueError as exc:
        raise ConfigError(f"--keep-alive: {exc}") from None
    parse_memory_budget(args.models_memory_budget)
    if args.models_load_wait <= 0:
        raise ConfigError("--models-load-wait must be positive")
    if not 0 <= args.encoder_nice <= 19:
        raise ConfigError("--encoder-nice must be 0 to 19")
    if args.encoder_sched not in ENCODER_SCHEDS:
        raise ConfigError(f"--encoder-sched must be one of {', '.join(ENCODER_SCHEDS)}")


def embedding_spec(args: argparse.Namespace, chat_model: str) -> ModelSpec | None:
    """The model `--embedding-model` adds beside the chat model, or None: 'none'; 'default' when the chat model is
    not the default one or the default embedding model is not built (an info line says so); else a directory,
    which must hold an embedding or rerank export."""
    word = args.embedding_model.strip()
    if word.lower() == "none":
        return None
    if word.lower() == "default":
        if args.model != "default":
            return None
        directory = default_embedding_dir()  # what `make model` builds
        if not (directory / MANIFEST_NAME).is_file():
            logging.getLogger("appliance.serve").info(
                "the default embedding model is not built (make model): serving without it",
                extra={"embedding_model": str(directory)},
            )
            return None
    else:
        directory = Path(word).expanduser().resolve()
    try:
        manifest = Manifest.load(directory)
    except (FileNotFoundError, ValueError, TypeError) as exc:
        raise ConfigError(f"--embedding-model {word}: {exc}") from None
    if not manifest.is_encoder:
        raise ConfigError(f"--embedding-model {word} is not an embedding or rerank model (its task: {manifest.task})")
    if manifest.name == chat_model:
        raise ConfigError(f"--embedding-model {word} has the chat model's name {chat_model!r}")
    created = int((directory / MANIFEST_NAME).stat().st_mtime)
    return ModelSpec(manifest.name, str(directory), created, EngineConfig(device=args.device))


def limits_from(args: argparse.Namespace) -> limits.Limits:
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


AUTO_BUDGET_FRACTION = 0.75  # of MemAvailable at start-up: the rest for the OS, the HTTP workers and page cache


def parse_memory_budget(text: str) -> int | None:
    """--models-memory-budget -> bytes, or None for none. A size with a unit (binary: 8GiB, 512MB, 1.5g) or bytes as
    a bare number; auto: AUTO_BUDGET_FRACTION of MemAvailable now (None when the kernel does not say)."""
    word = str(text).strip().lower()
    if word == "none":
        return None
    if word == "auto":
        available = host.meminfo_bytes("MemAvailable")
        return int(available * AUTO_BUDGET_FRACTION) if available else None
    m = _SIZE.fullmatch(word)
    if m and not m[2]:
        value = int(float(m[1]) * (_UNITS[m[3]] if m[3] else 1))
        if value > 0:
            return value
    raise ConfigError(
        f"--models-memory-budget {text!r}: use a size with a unit (8GiB, 512MB), bytes as a number, auto or none"
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
    total = host.meminfo_bytes("MemTotal")
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
    kernels = str(getattr(args, "kernels", "auto")).strip().lower()
    if kernels not in ("auto", "ours", "openvino"):
        raise ConfigError("--kernels must be auto, ours or openvino")
    precision = args.kv_cache_precision.strip().lower()
    if precision not in ("u8", "f16", "f32", "auto"):
        raise ConfigError("--kv-cache-precision must be u8, f16, f32 or auto")
    size = _kv_size(args)
    if getattr(args, "kv_disk_bytes", 1) < 1 or not getattr(args, "kv_disk_max_age", 1) > 0:
        raise ConfigError("--kv-disk-bytes must be at least 1 and --kv-disk-max-age positive")
    image_cache = getattr(args, "image_cache_bytes", EngineConfig.image_cache_bytes)
    if image_cache < 0:
        raise ConfigError("--image-cache-bytes must be at least 0 (0 turns the cache off)")
    slots, knobs = _static_knobs(args, manifest, paged_only=size is not None or precision != "auto")
    cache_dir = _cache_dir(args.cache_dir, manifest)
    speculation = _speculation(args, slots)
    sharing = args.prefix_cache_sharing.strip().lower()  # the prefix cache per API key or shared (docs/kv-cache.md)
    if sharing not in ("keys", "shared"):
        raise ConfigError("--prefix-cache-sharing must be keys or shared")
    engine = EngineConfig(
        device=args.device,
        precision="f32" if args.precision == "f32" else None,
        kernels=kernels,
        kv_cache_precision=None if precision == "auto" else precision,
        kv_cache_tokens=size[1] if size and size[0] == "tokens" else None,
        kv_cache_bytes=size[1] if size and size[0] == "bytes" else None,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_queued=args.max_queued,
        prefix_caching=args.enable_prefix_caching,
        prefix_cache_sharing=sharing,
        kv_disk_dir=str(Path(args.kv_disk_dir).expanduser()) if getattr(args, "kv_disk_dir", None) else None,
        kv_disk_bytes=getattr(args, "kv_disk_bytes", EngineConfig.kv_disk_bytes),
        kv_disk_max_age=getattr(args, "kv_disk_max_age", EngineConfig.kv_disk_max_age),
        image_cache_bytes=image_cache,
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
