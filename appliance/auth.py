"""Who may talk to the server: API keys, the Host-header allow-list, and the start-up refusal of an open bind.
HTTP worker side (no numpy/OpenVINO): cli.py calls `check_exposure` before anything loads, app.py calls
`api_keys(...).accepts` and `host_allowed` per request, gunicorn_conf logs `exposure_warning`.

* **Keys**: a file, one key per line (blank lines and `#` comments ignored), so keys can be rotated by adding the
  new one, moving clients, then removing the old one. A token is checked against every key, each compare over
  SHA-256 digests (`hmac.compare_digest` on equal lengths: neither a key's content nor its length leaks through
  timing) and without an early exit, so the time does not say which key matched or how many there are.
* **Admin keys** (--admin-key-file, the same format): accepted wherever a client key is, and the only keys that
  may POST /v1/config/reload, which loads models (memory, seconds to minutes of the engine's time) and so is not
  every client's to call. Without an admin key file a reload is refused (403), except on a loopback server
  without any keys (the developer's box), and there not from a browser page: a request carrying `Origin` is
  refused, since any page the user visits may POST to 127.0.0.1 without a preflight.
* **Secret files**: the key files and the TLS key are refused at start-up when every user of the box may read or
  write them (world bits set and every directory on the way searchable by others). Group read is fine: the
  installer makes the key file root:appliance 0640, readable by the service's group only.
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

from appliance.settings import ConfigError, ServeSettings

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


# ---- API keys
def load_keys(path: str, what: str = "API key file") -> list[str]:
    """The keys of a key file; ConfigError for an unreadable or empty file or a malformed key."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ConfigError(f"the {what} {path} holds no key (one per line; # starts a comment)")
    for number, key in enumerate(keys, 1):
        if not (key.isascii() and key.isprintable() and " " not in key and "\t" not in key):
            raise ConfigError(
                f"key {number} in the {what} {path} is not printable ASCII without spaces (what an HTTP header "
                "can carry)"
            )
    return keys


def bearer_token(authorization: str) -> str:
    """The token of an Authorization header value: the part after the scheme ('Bearer <token>'), stripped, whatever
    the scheme's case. The one reading of a presented key: the key checks, the tenant id and the edge's per-key
    counts (appliance/http/edge_policy.py) all take it from here, so no spelling counts as another key."""
    _, _, token = authorization.strip().partition(" ")
    return token.strip()


def token_digest(authorization: str) -> bytes:
    """The SHA-256 of the token in an Authorization header value (`bearer_token`). The one hashing of a presented
    key: the key checks compare it, and it is the tenant id (`tenant_id`)."""
    return hashlib.sha256(bearer_token(authorization).encode("utf-8", "surrogateescape")).digest()


def tenant_id(authorization: str) -> str:
    """Who a keyed request is, as a non-secret id: the hex SHA-256 of its key (`token_digest`). Derived from the key
    itself, not from its place in a key file, so it survives restarts and key-file edits (reordering, the rotation's
    add-then-remove) and two keys never share one. It names the request's namespace in the prefix cache and the KV
    disk tier (which hash it again with their per-install salt before anything reaches the disk: kv_cache.py) and
    the owner of a stored response. app.py sets it as `g.tenant` ("" for a request without a key: one tenant)."""
    return token_digest(authorization).hex()


class ApiKeys:
    """The accepted keys, as digests: a token is hashed once and compared with every one."""

    def __init__(self, keys: list[str]):
        self.digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def accepts(self, authorization: str) -> bool:
        """True for 'Bearer <one of the keys>' (the scheme case-insensitive, RFC 9110)."""
        scheme = authorization.strip().partition(" ")[0]
        digest = token_digest(authorization)
        matched = False
        for key in self.digests:  # no early exit: every key is compared
            matched |= hmac.compare_digest(digest, key)
        return matched and scheme.lower() == "bearer"


def authorization(header: str | None, api_key: str | None) -> str:
    """The credentials a request carries, as an Authorization header: that header, else Anthropic's `x-api-key`
    as a bearer token (the same key file, the same checks; the edge worker's per-key counts read it the same way,
    appliance/http/worker.py)."""
    if header or not api_key:
        return header or ""
    return f"Bearer {api_key.strip()}"


@cache
def api_keys(path: str | None) -> ApiKeys | None:
    """The worker's keys (read once per process; a failed read is not kept); None: no key file."""
    return ApiKeys(load_keys(path)) if path else None


def reload_refusal(
    settings: ServeSettings, admin: bool, origin: str | None, what: str = "Reloading the config"
) -> tuple[int, str] | None:
    """Why POST /v1/config/reload is refused to this request, as (status, message); None: allowed. `admin`: it
    carries an admin key. The rule is the module docstring's; Ollama's /api/pull and /api/delete (which download,
    load and delete models) follow it too, named by `what`."""
    if settings.admin_key_file:
        if admin:
            return None
        if settings.api_key_file:  # it passed the key check: a client key
            return 403, f"{what} needs an admin key (--admin-key-file); this is a client key"
        return 401, f"{what} needs an admin key: send 'Authorization: Bearer <admin key>'"
    if settings.api_key_file or not is_loopback(settings.host):
        return 403, f"{what} needs an admin key: start the server with --admin-key-file"
    if origin is not None:
        return 403, f"{what} is refused to a web page (the request has an Origin header)"
    return None


def exposed_problem(path: str, what: str) -> str | None:
    """Why secret file `path` (keys, a TLS key) is refused: every user of the box may read or write it. A
    directory on its path that others cannot enter (a 0700 directory) keeps it private whatever its own mode."""
    real = Path(os.path.realpath(path))
    mode = real.stat().st_mode & 0o777
    if not mode & 0o006 or any(not parent.stat().st_mode & 0o001 for parent in real.parents):
        return None
    how = "readable and writable" if mode & 0o006 == 0o006 else "writable" if mode & 0o002 else "readable"
    return (
        f"the {what} {path} is {how} by every user (mode {mode:04o}): chmod o-rwx {path} (the service reads it "
        "as its owner or through its group, as `make install`'s root:appliance 0640 key file)"
    )


# ---- Host allow-list
def host_and_port(header: str) -> tuple[str, str]:
    """'Example.COM:8000' -> ('example.com', '8000'), '[::1]:8000' -> ('::1', '8000'), 'x' -> ('x', '') (a trailing
    dot dropped from the name)."""
    header = header.strip().lower()
    if header.startswith("["):
        if "]" not in header:
            return header, ""
        name, _, rest = header[1:].partition("]")
        return name, rest[1:] if rest.startswith(":") else ""
    if header.count(":") > 1:  # a bare IPv6 literal: no port
        return header, ""
    name, _, port = header.partition(":")
    return name.rstrip("."), port


def host_part(header: str) -> str:
    """'Example.COM:8000' -> 'example.com', '[::1]:8000' -> '::1' (a trailing dot dropped too)."""
    return host_and_port(header)[0]


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


def host_checked(header: str | None, settings: ServeSettings) -> bool:
    """Whether a request's Host header names this server, as `settings` say: --allowed-hosts when given. Without
    it, a keyless server on loopback answers only loopback names (localhost, 127.0.0.1, [::1]) with no port or its
    own port: a page a browser on this box loads from any site can point its own name at 127.0.0.1 (DNS
    rebinding) and, with no key to stop it, chat or unload models; its requests carry the site's name. A server
    with keys, or one bound beyond loopback, answers any name unless --allowed-hosts is given (the names it is
    reached by are not known here; a rebinding page has no key)."""
    if settings.allowed_hosts:
        return host_allowed(header, settings.allowed_hosts)
    if settings.api_key_file or not is_loopback(settings.host):
        return True
    name, port = host_and_port(header or "")
    return name in LOOPBACK_NAMES and port in ("", str(settings.port))


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
        f"--host {host} is reachable from other machines and no API key is set: give clients keys "
        "with --api-key-file FILE (one per line), or pass --allow-unauthenticated (APPLIANCE_ALLOW_UNAUTHENTICATED=1) "
        "to serve everyone"
    )


def exposure_warning(settings: ServeSettings) -> str | None:
    """The warning every start of an open, unauthenticated server logs (gunicorn_conf's when_ready)."""
    if settings.api_key_file or is_loopback(settings.host):
        return None
    return f"serving {settings.host} without an API key (--allow-unauthenticated): anyone who can reach it may use it"


def check_exposure(settings: ServeSettings) -> None:
    """cli.py's start-up check of the exposure settings: ConfigError with one line for each mistake."""
    for path, what in ((settings.api_key_file, "API key file"), (settings.admin_key_file, "admin key file")):
        if path:
            load_keys(path, what)  # readable, keys well-formed
            if problem := exposed_problem(path, what):
                raise ConfigError(problem)
    problem = exposure_problem(settings.host, bool(settings.api_key_file), settings.allow_unauthenticated)
    if problem:
        raise ConfigError(problem)
    if bool(settings.tls_certfile) != bool(settings.tls_keyfile):
        raise ConfigError("--tls-certfile and --tls-keyfile go together (the certificate and its key)")
    for path in filter(None, (settings.tls_certfile, settings.tls_keyfile)):
        if not os.access(path, os.R_OK) or not Path(path).is_file():
            raise ConfigError(f"cannot read the TLS file {path}")
    if settings.tls_keyfile and (problem := exposed_problem(settings.tls_keyfile, "TLS key file")):
        raise ConfigError(problem)
    if settings.tls_certfile:
        try:  # what gunicorn will load: a wrong pair fails here, in one line
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                settings.tls_certfile, settings.tls_keyfile
            )
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"the TLS certificate and key do not load: {exc}") from None
    if settings.allowed_hosts is not None and not any(p.strip() for p in settings.allowed_hosts.split(",")):
        raise ConfigError("--allowed-hosts is empty (a comma-separated list of names, or * for any)")


def base_url(settings: ServeSettings) -> str:
    """Where clients reach the server: https with --tls-certfile (the log lines and docs say this one)."""
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return f"{'https' if settings.tls_certfile else 'http'}://{host}:{settings.port}"
