"""The resolved `appliance serve` settings, shared with gunicorn's config and workers through one JSON file in
the private runtime directory (workers are separate processes started by gunicorn, not by us)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from appliance.config import EngineConfig
from appliance.limits import Limits, setting
from appliance.params import REASONING_FORMATS, TOOL_CALL_FORMATS

RUNTIME_DIR_ENV = "APPLIANCE_RUNTIME_DIR"
SETTINGS_FILE = "settings.json"
SOCKET_FILE = "engine.sock"
AUTHKEY_FILE = "authkey"
ENCODER_SCHEDS = ("idle", "normal")  # --encoder-sched: SCHED_IDLE, or the normal policy at --encoder-nice
# sysexits.h's EX_CONFIG: `appliance serve`'s exit status for a setting it cannot run with. A crash stays 1, so a
# service manager can tell them apart: systemd/appliance.service's RestartPreventExitStatus=78 leaves the unit
# failed after one start (a bad setting fails the same way every time) instead of restarting it every few seconds.
EX_CONFIG = 78


class ConfigError(ValueError):
    """A setting `appliance serve` cannot run with, as one line without the "appliance: " prefix. Raised by the
    start-up checks (appliance/options.py, appliance/auth.py, appliance/server/config_file.py) and turned into
    that line on stderr and exit EX_CONFIG in one place, cli.main. Not SystemExit: raised on a worker's request
    thread (a key file read lazily) or in the engine process (a reload), it is an ordinary exception there, which
    becomes an error answer instead of ending the process. A ValueError, so a reload's 400 catches it too."""


@dataclass
class ModelSpec:
    """One served model: its API name, its export, its own engine settings and output parsers. A plain `serve`
    has one (from --model and the engine flags); a config file's `model_config_list` several (OVMS's config.json,
    appliance/server/config_file.py). The engine process loads each into its own Engine; `model` routes."""

    name: str
    model_dir: str
    created: int = 0  # unix time of the export (OVMS `created` of /v3/models)
    engine: EngineConfig = field(default_factory=EngineConfig)
    tool_parser: str = "auto"
    reasoning_parser: str = "auto"
    # how long the model stays loaded when idle (appliance/keep_alive.py's spellings); None: --keep-alive's
    keep_alive: str | None = None

    @classmethod
    def from_dict(cls, data: dict) -> ModelSpec:
        """The inverse of dataclasses.asdict (settings.json)."""
        known = {f.name for f in fields(EngineConfig)}
        engine = EngineConfig(**{k: v for k, v in data.get("engine", {}).items() if k in known})
        return cls(**{**{k: v for k, v in data.items() if k in {f.name for f in fields(cls)}}, "engine": engine})


@dataclass
class ServeSettings:
    """What `appliance serve` runs with besides the engine's EngineConfig. A field with a `flag` is a serve option:
    its default and help are declared here once (appliance/limits.py `setting`; appliance/options.py derives the
    flag)."""

    model_dir: str = setting(
        help_text="exported model directory, or 'default': the default model's OpenVINO export for this CPU (int4 "
        "on the GGUF's own grid; int8 on CPUs without VNNI or bf16)",
        flag="model",
        cli="default",
    )
    served_model_name: str = setting(
        help_text="model name in the API, the `model` clients send and /v3/models lists",
        flag="served-model-name",
        cli=None,
        show="the export's name",
    )
    model_created: int = setting(help_text="unix time of the export (OVMS `created` of /v3/models)")
    host: str = setting("127.0.0.1", "address to listen on (loopback unless you ask for more)", flag="host")
    port: int = setting(8000, "TCP port", flag="port")
    workers: int = setting(1, "HTTP worker processes (they share one engine: one copy of the weights)", flag="workers")
    threads: int = setting(32, "threads per HTTP worker; each streaming client holds one", flag="threads")
    embedding_model: str = setting(
        "default",
        "embedding or rerank model served beside the chat model, under its export's name: 'default' serves "
        "all-MiniLM-L6-v2 beside `--model default` once `make model` has built it; 'none'; or an exported "
        "embedding / rerank model's directory (a config file's model_config_list names its models itself)",
        flag="embedding-model",
    )
    encoder_nice: int = setting(
        19,
        "nice (0-19, over the engine process's) of the thread embedding and rerank forwards run on while chat "
        "models have sequences running or waiting, so chat keeps its pace (appliance/server/encoders/priority.py); "
        "0: one thread at the process's priority",
        flag="encoder-nice",
    )
    encoder_sched: str = setting(
        "idle",
        "scheduling policy of that thread: idle (Linux SCHED_IDLE: it runs only on a core nothing else wants) or "
        "normal (only the nice)",
        flag="encoder-sched",
    )
    config_file: str | None = setting(
        None,
        "JSON config file: serve flags by name, and OVMS's `model_config_list` to serve several models "
        "(flags and APPLIANCE_* variables win over it)",
        flag="config",
    )
    api_key_file: str | None = setting(
        None,
        "file holding the API keys, one per line; clients then need 'Authorization: Bearer <key>' (401 otherwise)",
        flag="api-key-file",
    )
    admin_key_file: str | None = setting(
        None,
        "file holding the admin keys, one per line: they are accepted wherever client keys are, and only they may "
        "POST /v1/config/reload (without this file a reload is refused, except on a loopback server without keys)",
        flag="admin-key-file",
    )
    allow_unauthenticated: bool = setting(
        False,
        "serve a non-loopback --host without an API key (refused otherwise; a warning is logged)",
        flag="allow-unauthenticated",
    )
    tls_certfile: str | None = setting(None, "TLS certificate (PEM) to serve HTTPS with", flag="tls-certfile")
    tls_keyfile: str | None = setting(None, "TLS private key (PEM) of --tls-certfile", flag="tls-keyfile")
    allowed_hosts: str | None = setting(
        None,
        "comma-separated Host header names the server answers (others: 400); none: any, except on a loopback "
        "server without keys: localhost, 127.0.0.1, [::1]",
        flag="allowed-hosts",
    )
    # 16 MiB: one image at --max-image-bytes' 10 MiB is 13.3 MiB of base64, and the rest of the request needs
    # room (limits.image_body_bytes: `appliance serve` refuses a pair that cannot carry one image). OpenAI takes
    # 50 MB bodies, Anthropic 32 MB; the worker buffers at most two bodies per client (http/edge.py)
    max_body_bytes: int = setting(
        16 * 1024 * 1024,
        "largest request body accepted (413 above); at least one --max-image-bytes image as base64 + 1 MiB",
        flag="max-body-bytes",
        show="16777216 (16 MiB)",
    )
    image_url_hosts: str | None = setting(
        None,
        "comma-separated host names (or IP literals) whose http(s) image URLs the server fetches, each resolving to "
        "public addresses only; none: remote image URLs are refused (data URLs and base64 only)",
        flag="image-url-hosts",
    )
    image_url_timeout: float = setting(
        10.0,
        "seconds a remote image URL's fetch may take, resolving to the last byte (else 400)",
        flag="image-url-timeout",
    )
    limits: Limits = setting(
        default_factory=Limits,  # every request bound: their flags are Limits' own
        help_text="every request bound (appliance/limits.py)",
    )
    max_queued: int | None = setting(None, "the engine's --max-queued, so workers refuse n x prompts that never fit")
    graceful_timeout: int = setting(30, "seconds in-flight requests get to finish on SIGTERM", flag="graceful-timeout")
    request_timeout: float = setting(
        30.0,
        "seconds a client has to send a whole request (head and body); then the "
        "connection is closed, no thread was used",
        flag="request-timeout",
    )
    send_timeout: float = setting(
        30.0,
        "seconds a response write may wait on a client that stopped reading; then a "
        "stream is cancelled (its KV freed) and the connection reset",
        flag="send-timeout",
    )
    keepalive_timeout: int = setting(
        5, "seconds an idle kept-alive connection stays open (0: no keep-alive)", flag="keepalive-timeout"
    )
    client_max_connections: int = setting(
        0,
        "connections one client address may hold open in a worker (kept-alive ones included); past it a new one "
        "gets 503 (0: all but 64 of the worker's connection limit)",
        flag="client-max-connections",
    )
    client_max_generations: int = setting(
        0,
        "requests that make the engine work (completions, chat, responses, messages, embeddings, rerank, "
        "tokenize, count_tokens, Ollama's generate / chat / embed) one API key, and one client address, may run "
        "at once in a worker; past it 429 (0: no cap; behind a proxy every client has the proxy's address)",
        flag="client-max-generations",
    )
    tool_parser: str = setting(
        "auto",
        f"how the model writes tool calls: {', '.join(TOOL_CALL_FORMATS)}; auto: read off the chat template "
        "(hermes when it names none)",
        flag="tool-parser",
    )
    reasoning_parser: str = setting(
        "auto",
        f"{' or '.join(REASONING_FORMATS)} (a leading <think>...</think> goes to reasoning_content); auto: "
        "think when the chat template mentions <think>",
        flag="reasoning-parser",
    )
    state_dir: str | None = setting(
        None,
        "writable directory for what the server keeps: the Responses store (responses.sqlite3) and pulled models "
        "(models/hub/); checked at start-up: given here and unwritable, the start is refused (docs/deploy.md, State)",
        flag="state-dir",
        show="the data dir",
    )
    responses_retention: float = setting(
        30 * 86400.0,
        "seconds a stored Responses API response (`store: true`) is kept in <state dir>/responses.sqlite3",
        flag="responses-retention",
    )
    responses_max_bytes: int = setting(
        256 * 1024 * 1024,
        "bytes of stored Responses API responses per API key at most; a key's own oldest go first, never another key's",
        flag="responses-max-bytes",
    )
    # why the state dir cannot be written ("" when it can): found once at start-up (appliance/state.py
    # `check_state_dir`); the workers then refuse `store: true` before any work
    state_problem: str = ""
    keep_alive: str = setting(
        "-1",
        "how long an idle model stays loaded (Ollama's keep_alive): a duration (5m, 30s, 1h30m) or seconds; 0: "
        "unloaded after each request; negative: forever. Unloaded models stay listed and load again on their next "
        "request; a config file's model may set its own `keep_alive`, an Ollama request its own",
        flag="keep-alive",
        show="-1 (forever)",
    )
    models_memory_budget: str = setting(
        "none",
        "bytes all loaded models may take together (a size with a unit: 8GiB, 512MB), auto (three quarters of the "
        "memory available at start-up) or none; a model that would not fit unloads the least recently used idle "
        "ones first (appliance/server/residency.py)",
        flag="models-memory-budget",
    )
    models_load_wait: float = setting(
        60.0,
        "seconds a load waits for busy models to go idle when the memory budget is full; then its requests get a 503",
        flag="models-load-wait",
    )
    serve_pulled: bool = setting(
        True,
        "serve every model `appliance pull` put in the state dir (models/hub/) beside the ones named here, each "
        "listed at start-up and loaded by its first request (as Ollama's); --no-serve-pulled: only the named ones",
        flag="serve-pulled",
    )
    log_level: str = setting("info", "debug, info, warning or error (JSON lines on stderr)", flag="log-level")
    access_log: bool = setting(False, "log every HTTP request", flag="access-log")
    otlp_endpoint: str | None = setting(
        None,
        "OpenTelemetry collector's OTLP/HTTP URL (http://host:4318; /v1/traces is appended) to send each request's "
        "trace to; none: off, unless the OTEL_EXPORTER_OTLP_* variables name one (docs/serving.md, Tracing)",
        flag="otlp-endpoint",
    )
    # the served models (ModelSpec above); a plain `serve` has one: model_dir / served_model_name / model_created
    # and the engine flags
    models: list[ModelSpec] = field(default_factory=list)
    # the engine and parser flags given on the command line or in APPLIANCE_* at start-up (flag name -> value): a
    # config reload applies them over the re-read file, as start-up did (appliance/server/config_file.py)
    startup_flags: dict[str, Any] = field(default_factory=dict)
    runtime_dir: str = ""
    supervisor_pid: int = 0

    @property
    def socket_path(self) -> str:
        return str(Path(self.runtime_dir) / SOCKET_FILE)

    def authkey(self) -> bytes:
        return (Path(self.runtime_dir) / AUTHKEY_FILE).read_bytes()

    def save(self) -> None:
        path = Path(self.runtime_dir) / SETTINGS_FILE
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, runtime_dir: str | None = None) -> ServeSettings:
        runtime_dir = runtime_dir or os.environ[RUNTIME_DIR_ENV]
        data = json.loads((Path(runtime_dir) / SETTINGS_FILE).read_text())
        known = {f.name for f in fields(cls)}
        if isinstance(data.get("limits"), dict):  # asdict flattened it
            data["limits"] = Limits.from_dict(data["limits"])
        data["models"] = [ModelSpec.from_dict(m) for m in data.get("models", [])]
        return cls(**{k: v for k, v in data.items() if k in known})
