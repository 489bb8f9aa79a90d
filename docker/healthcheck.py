"""The image's HEALTHCHECK: is the server ready (GET /v2/health/ready -> 200)?

Runs inside the container as the serving user, against the port and scheme the server was started with
(APPLIANCE_PORT, https when APPLIANCE_TLS_CERTFILE is set: the certificate is for the box's name, not 127.0.0.1, so
it is not verified here). The probe is the cached readiness the load balancer sees too; the health endpoints need no
API key (appliance/auth.py). Stdlib only: it must not load the server's modules every 30 s.
"""

from __future__ import annotations

import os
import ssl
import sys
import urllib.request


def main() -> int:
    port = os.environ.get("APPLIANCE_PORT", "8000")
    tls = bool(os.environ.get("APPLIANCE_TLS_CERTFILE"))
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}/v2/health/ready"
    context = ssl._create_unverified_context() if tls else None  # loopback, our own server
    try:
        with urllib.request.urlopen(url, timeout=4, context=context) as response:
            return 0 if response.status == 200 else 1
    except OSError as exc:  # refused, 503 (HTTPError), timeout
        print(f"healthcheck: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
