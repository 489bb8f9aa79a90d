"""`appliance serve`: flags, else APPLIANCE_* environment variables (e.g. APPLIANCE_WORKERS=4), else defaults."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from appliance.manifest import MANIFEST_NAME, Manifest
from appliance.paths import resolve_model

# flag -> (type, default, help). The environment variable is APPLIANCE_<FLAG IN UPPER SNAKE CASE>.
SERVE_OPTIONS: dict[str, tuple] = {
    "model": (str, "default", "exported model directory, or 'default' for the default model"),
    "host": (str, "127.0.0.1", "address to listen on"),
    "port": (int, 8000, "TCP port"),
    "device": (str, "CPU", "OpenVINO device: CPU, GPU, NPU, AUTO, ..."),
    "workers": (int, 1, "HTTP worker processes (they share one engine: one copy of the weights)"),
    "threads": (int, 32, "threads per HTTP worker; each streaming client holds one"),
    "api-key-file": (str, None, "file holding the API key; clients then need 'Authorization: Bearer <key>'"),
    "served-model-name": (str, None, "model name in the API (default: the export's name)"),
    "precision": (str, "default", "inference precision: 'f32' (transformers parity) or 'default' (fastest)"),
    "kv-cache-tokens": (int, None, "KV cache budget in tokens, all sequences together"),
    "max-num-seqs": (int, None, "sequences decoded together in one step"),
    "max-queued": (int, None, "waiting requests before answering 429"),
    "max-body-bytes": (int, 4 * 1024 * 1024, "largest request body accepted (413 above)"),
    "max-tokens-limit": (int, None, "largest max_tokens a request may ask for (400 above)"),
    "graceful-timeout": (int, 30, "seconds in-flight requests get to finish on SIGTERM"),
    "log-level": (str, "info", "debug, info, warning or error"),
    "access-log": (bool, False, "log every HTTP request"),
}


def env_name(flag: str) -> str:
    return "APPLIANCE_" + flag.upper().replace("-", "_")


def _env_default(flag: str, kind, default):
    raw = os.environ.get(env_name(flag))
    if raw is None or raw == "":
        return default
    if kind is bool:
        return raw.strip().lower() in ("1", "true", "yes", "on")
    try:
        return kind(raw)
    except ValueError:
        raise SystemExit(f"appliance: {env_name(flag)}={raw!r} is not a valid {kind.__name__}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="appliance", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API (OVMS flavour)",
                           description="Serve a model over the OVMS-compatible OpenAI API. Every flag can also "
                                       "be set with an APPLIANCE_* environment variable, e.g. APPLIANCE_WORKERS=4.")
    for flag, (kind, default, help_text) in SERVE_OPTIONS.items():
        value = _env_default(flag, kind, default)
        if kind is bool:
            serve.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=value, help=help_text)
        else:
            serve.add_argument(f"--{flag}", type=kind, default=value,
                               help=f"{help_text} (env {env_name(flag)}, default {default})")
    return parser


def _settings(args: argparse.Namespace):
    from appliance.config import EngineConfig
    from appliance.server.settings import ServeSettings

    model_dir = resolve_model(args.model)
    try:
        manifest = Manifest.load(model_dir)
    except FileNotFoundError as exc:
        hint = " (build it with `make model` or `python -m export.default_model`)" if args.model == "default" else ""
        raise SystemExit(f"appliance: {exc}{hint}") from None
    if args.precision not in ("f32", "default"):
        raise SystemExit("appliance: --precision must be 'f32' or 'default'")
    if args.workers < 1 or args.threads < 1:
        raise SystemExit("appliance: --workers and --threads must be at least 1")
    settings = ServeSettings(
        model_dir=str(model_dir), served_model_name=args.served_model_name or manifest.name,
        model_created=int((Path(model_dir) / MANIFEST_NAME).stat().st_mtime), host=args.host, port=args.port,
        workers=args.workers, threads=args.threads,
        api_key_file=str(Path(args.api_key_file).resolve()) if args.api_key_file else None,
        max_body_bytes=args.max_body_bytes, max_tokens_limit=args.max_tokens_limit,
        graceful_timeout=args.graceful_timeout, log_level=args.log_level.lower(), access_log=args.access_log)
    if settings.api_key_file and not Path(settings.api_key_file).read_text().strip():
        raise SystemExit(f"appliance: the API key file {settings.api_key_file} is empty")
    engine = EngineConfig(device=args.device, precision="f32" if args.precision == "f32" else None)
    for name in ("kv_cache_tokens", "max_num_seqs", "max_queued"):
        if getattr(args, name) is not None:
            setattr(engine, name, getattr(args, name))
    return settings, engine


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from appliance.server.supervisor import serve
        settings, engine = _settings(args)
        return serve(settings, engine)
    return 2


if __name__ == "__main__":
    sys.exit(main())
