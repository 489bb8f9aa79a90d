"""The resolved `appliance serve` settings, shared with gunicorn's config and workers through one JSON file in
the private runtime directory (workers are separate processes started by gunicorn, not by us)."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from appliance.limits import Limits

RUNTIME_DIR_ENV = "APPLIANCE_RUNTIME_DIR"
SETTINGS_FILE = "settings.json"
SOCKET_FILE = "engine.sock"
AUTHKEY_FILE = "authkey"


@dataclass
class ServeSettings:
    model_dir: str
    served_model_name: str
    model_created: int                 # unix time of the export (OVMS `created` of /v3/models)
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    threads: int = 32                  # per worker; each streaming client holds one thread
    api_key_file: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    limits: Limits = field(default_factory=Limits)   # every request bound (appliance/limits.py)
    max_queued: int | None = None      # the engine's --max-queued, so workers refuse n x prompts that never fit
    graceful_timeout: int = 30
    request_timeout: float = 30.0      # seconds to receive a whole request (head and body); then it is closed
    send_timeout: float = 30.0         # seconds a response write may block on a client that stopped reading
    keepalive_timeout: int = 5         # seconds an idle kept-alive connection stays open
    log_level: str = "info"
    access_log: bool = False
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
    def load(cls, runtime_dir: str | None = None) -> "ServeSettings":
        runtime_dir = runtime_dir or os.environ[RUNTIME_DIR_ENV]
        data = json.loads((Path(runtime_dir) / SETTINGS_FILE).read_text())
        known = {f.name for f in fields(cls)}
        if isinstance(data.get("limits"), dict):   # asdict flattened it
            data["limits"] = Limits.from_dict(data["limits"])
        return cls(**{k: v for k, v in data.items() if k in known})
