"""The image's HEALTHCHECK: is the server ready (GET /v2/health/ready -> 200)?

Runs inside the container as the serving user (`docker exec`), so it finds the server the way `appliance serve`
found its settings, with the same precedence: the flags on the container's command line (PID 1 is tini, whose
arguments are `appliance serve ...`: /proc/1/cmdline), else the APPLIANCE_* variables, else the --config file's
`port` / `host` / `tls_certfile`, else the defaults. A bind to every address (0.0.0.0, ::) is probed on 127.0.0.1;
a specific address on itself. https when a TLS certificate is set: it is for the box's name, not the address
probed, so it is not verified here. The probe is the cached readiness the load balancer sees too; the health
endpoints need no API key (appliance/auth.py). Stdlib only: it must not load the server's modules every 30 s.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import urllib.request
from pathlib import Path

CMDLINE = Path("/proc/1/cmdline")
SETTINGS = ("port", "host", "tls-certfile")
DEFAULTS = {"port": "8000", "host": "127.0.0.1", "tls-certfile": ""}
WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def _flags(argv: list[str]) -> dict[str, str]:
    """`--port 9000` / `--port=9000` (and --host, --tls-certfile, --config) from `serve`'s arguments."""
    found: dict[str, str] = {}
    for i, arg in enumerate(argv):
        for name in (*SETTINGS, "config"):
            if arg == f"--{name}" and i + 1 < len(argv):
                found[name] = argv[i + 1]
            elif arg.startswith(f"--{name}="):
                found[name] = arg.split("=", 1)[1]
    return found


def settings(argv: list[str], environ: dict[str, str] | os._Environ) -> dict[str, str]:
    flags = _flags(argv)
    config = flags.get("config") or environ.get("APPLIANCE_CONFIG")
    in_file: dict = {}
    if config:
        try:
            in_file = json.loads(Path(config).read_text())
        except (OSError, ValueError):
            in_file = {}
    out = {}
    for name in SETTINGS:
        env = environ.get("APPLIANCE_" + name.upper().replace("-", "_"))
        file_value = in_file.get(name.replace("-", "_"), in_file.get(name)) if isinstance(in_file, dict) else None
        out[name] = str(flags.get(name) or env or file_value or DEFAULTS[name])
    return out


def url(found: dict[str, str]) -> str:
    host = found["host"]
    host = "127.0.0.1" if host in WILDCARDS else f"[{host.strip('[]')}]" if ":" in host else host
    return f"{'https' if found['tls-certfile'] else 'http'}://{host}:{found['port']}/v2/health/ready"


def main() -> int:
    try:
        argv = CMDLINE.read_bytes().decode(errors="replace").split("\0")
    except OSError:
        argv = []
    found = settings(argv, os.environ)
    target = url(found)
    context = ssl._create_unverified_context() if found["tls-certfile"] else None  # our own server
    try:
        with urllib.request.urlopen(target, timeout=4, context=context) as response:
            return 0 if response.status == 200 else 1
    except OSError as exc:  # refused, 503 (HTTPError), timeout
        print(f"healthcheck: {target}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
