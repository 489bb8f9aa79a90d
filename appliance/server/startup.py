"""The one start-up log line: the effective settings of this server, so an unattended box's journal says what it
ran with (which device, which precision, where the compile cache is, the limits) without reading its env file.

Structured (a JSON line, appliance/logs.py) and safe to ship to a log collector: the API key file is named
as "api keys: on", never read or printed, and no prompt or request is part of it. Limits are summarised as the
values that differ from their defaults (the full set is `appliance serve --help`)."""

from __future__ import annotations

import logging
from dataclasses import fields
from typing import Any

import appliance
from appliance import limits
from appliance.config import EngineConfig
from appliance.settings import ModelSpec, ServeSettings

log = logging.getLogger("appliance.serve")


def _kv(engine: EngineConfig) -> str:
    if engine.static or engine.device.upper().startswith("NPU"):
        return f"static {engine.static_batch} slots x {engine.static_context} positions"
    if engine.kv_cache_bytes is not None:
        return f"{engine.kv_cache_bytes / 2**30:.2f} GiB"
    if engine.kv_cache_tokens is not None:
        return f"{engine.kv_cache_tokens} tokens"
    return "auto"


def model_record(spec: ModelSpec) -> dict[str, Any]:
    e = spec.engine
    static = e.static or e.device.upper().startswith("NPU")
    record: dict[str, Any] = {
        "name": spec.name,
        "model_dir": spec.model_dir,
        "device": e.device,
        "precision": e.precision or "default",
        "kv_cache": _kv(e),
        "kv_cache_precision": e.kv_precision() or "device default",
        "max_num_seqs": e.max_num_seqs,
        "max_num_batched_tokens": e.max_num_batched_tokens,
        "prefix_caching": e.prefix_caching and not static,
        "compile_cache": e.compile_cache() or "off",  # where it applies (EngineConfig.compile_cache)
    }
    if static:
        record["max_prompt_len"] = e.max_prompt_len
    return record


def changed_limits(bounds: limits.Limits) -> dict[str, Any]:
    """The request limits that differ from their defaults."""
    return {
        f.name: getattr(bounds, f.name) for f in fields(bounds) if getattr(bounds, f.name) != limits.field_default(f)
    }


def record(settings: ServeSettings) -> dict[str, Any]:
    s = settings
    return {
        "version": appliance.__version__,
        "host": s.host,
        "port": s.port,
        "workers": s.workers,
        "threads": s.threads,
        "tls": bool(s.tls_certfile),
        "api_keys": "on" if s.api_key_file else "off",
        "allowed_hosts": s.allowed_hosts or "any",
        "models": [model_record(spec) for spec in s.models],
        "max_queued": s.max_queued,
        "max_body_bytes": s.max_body_bytes,
        "limits_changed": changed_limits(s.limits),
        "timeouts": {
            "request": s.request_timeout,
            "send": s.send_timeout,
            "keepalive": s.keepalive_timeout,
            "graceful": s.graceful_timeout,
        },
        "config_file": s.config_file,
        "log_level": s.log_level,
    }


def log_settings(settings: ServeSettings) -> None:
    log.info("starting", extra={"settings": record(settings)})
