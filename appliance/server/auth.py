"""Who may talk to the server: API keys, the Host-header allow-list, and the start-up refusal of an open bind.
HTTP worker side (no numpy/OpenVINO): cli.py calls `check_exposure` before anything loads, app.py calls
`api_keys(...).accepts` and `host_allowed` per request, gunicorn_conf logs `exposure_warning`.

* **Keys**: a file, one key per line (blank lines and `#` comments ignored), so keys can be rotated by adding the
  new one, moving clients, then removing the old one. A token is checked against every key, each compare over
  SHA-256 digests (`hmac.compare_digest` on equal lengths: neither a key's content nor its length leaks through
  timing) and without an early exit, so the time does not say which key matched or how many there are.
* **Open binds**: an address other than loopback without keys is refused at start-up unless
  --allow-unauthenticated says it is meant (a lab network, a proxy in front that authenticates); then every
  start logs a warning. A hostname other than localhost counts as open: it is not resolved here.
* **Host allow-list** (--allowed-hosts): a browser on the LAN can be pointed at the server by a page whose domain
  resolves to it (DNS rebinding); its requests carry the attacker's name in Host, and are refused with 400.
  Entries are exact names, `.example.com` (the domain and its subdomains, as Django) or `*`; the port is ignored,
  case too; IPv6 literals in brackets. Loopback names are always allowed (a rebinding page cannot send them). The
  health probes are exempt, as from the key: kubelet and load balancers probe with the pod IP as Host, and the
  probes say nothing but "alive"/"ready".
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import ssl
from functools import cache
from pathlib import Path

from appliance.server.settings import ServeSettings

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


# ---- API keys
def load_keys(path: str) -> list[str]:
    """The keys of a key file; SystemExit for an unreadable or empty file or a malformed key (start-up errors)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"appliance: cannot read the API key file {path}: {exc}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise SystemExit(f"appliance: the API key file {path} holds no key (one per line; # starts a comment)")
    for number, key in enumerate(keys, 1):
        if not (key.isascii() and key.isprintable() and " " not in key and "\t" not in key):
            raise SystemExit(
                f"appliance: API key {number} in {path} is not printable ASCII without spaces "
                "(what an HTTP header can carry)"
            )
    return keys


class ApiKeys:
    """The accepted keys, as digests: a token is hashed once and compared with every one."""

    def __init__(self, keys: list[str]):
        self.digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def accepts(self, authorization: str) -> bool:
        """True for 'Bearer <one of the keys>' (the scheme case-insensitive, RFC 9110)."""
        scheme, _, token = authorization.strip().partition(" ")
        digest = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        matched = False
        for key in self.digests:  # no early exit: every key is compared
            matched |= hmac.compare_digest(digest, key)
        return matched and scheme.lower() == "bearer"


@cache
def api_keys(path: str | None) -> ApiKeys | None:
    """The worker's keys (read once per process); None: no key file, every client is let in."""
    return ApiKeys(load_keys(path)) if path else None


# ---- Host allow-list
def host_part(header: str) -> str:
    """'Example.COM:8000' -> 'example.com', '[::1]:8000' -> '::1' (a trailing dot dropped too)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0].rstrip(".") if header.count(":") <= 1 else header


@cache
def allowed_patterns(allowed_hosts: str) -> tuple[str, ...]:
    return tuple(host_part(p) if not p.strip().startswith(".") else p.strip().lower() for p in allowed_hosts.split(","))


def host_allowed(header: str | None, allowed_hosts: str | None) -> bool:
    """Whether a request's Host header names this server (--allowed-hosts; None: any)."""
    if not allowed_hosts:
        return True
    host = host_part(header or "")
    if not host:
        return False
    for pattern in allowed_patterns(allowed_hosts) + tuple(LOOPBACK_NAMES):
        if (
            pattern == "*"
            or host == pattern
            or (pattern.startswith(".") and (host == pattern[1:] or host.endswith(pattern)))
        ):
            return True
    return False


# ---- start-up checks (cli.py, before a model loads)
def is_loopback(host: str) -> bool:
    if host.strip().lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname: not resolved here, so not trusted to be local


def exposure_problem(host: str, has_keys: bool, allow_unauthenticated: bool) -> str | None:
    """Why serving `host` this way is refused; None when it is fine."""
    if has_keys or allow_unauthenticated or is_loopback(host):
        return None
    return (
        f"appliance: --host {host} is reachable from other machines and no API key is set: give clients keys "
        "with --api-key-file FILE (one per line), or pass --allow-unauthenticated (APPLIANCE_ALLOW_UNAUTHENTICATED=1) "
        "to serve everyone"
    )


def exposure_warning(settings: ServeSettings) -> str | None:
    """The warning every start of an open, unauthenticated server logs (gunicorn_conf's when_ready)."""
    if settings.api_key_file or is_loopback(settings.host):
        return None
    return f"serving {settings.host} without an API key (--allow-unauthenticated): anyone who can reach it may use it"


def check_exposure(settings: ServeSettings) -> None:
    """cli.py's start-up check of the exposure settings: SystemExit with one line for each mistake."""
    if settings.api_key_file:
        load_keys(settings.api_key_file)
    problem = exposure_problem(settings.host, bool(settings.api_key_file), settings.allow_unauthenticated)
    if problem:
        raise SystemExit(problem)
    if bool(settings.tls_certfile) != bool(settings.tls_keyfile):
        raise SystemExit("appliance: --tls-certfile and --tls-keyfile go together (the certificate and its key)")
    for path in filter(None, (settings.tls_certfile, settings.tls_keyfile)):
        if not os.access(path, os.R_OK) or not Path(path).is_file():
            raise SystemExit(f"appliance: cannot read the TLS file {path}")
    if settings.tls_certfile:
        try:  # what gunicorn will load: a wrong pair fails here, in one line
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                settings.tls_certfile, settings.tls_keyfile
            )
        except (ssl.SSLError, OSError) as exc:
            raise SystemExit(f"appliance: the TLS certificate and key do not load: {exc}") from None
    if settings.allowed_hosts is not None and not any(p.strip() for p in settings.allowed_hosts.split(",")):
        raise SystemExit("appliance: --allowed-hosts is empty (a comma-separated list of names, or * for any)")


def base_url(settings: ServeSettings) -> str:
    """Where clients reach the server: https with --tls-certfile (the log lines and docs say this one)."""
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return f"{'https' if settings.tls_certfile else 'http'}://{host}:{settings.port}"
