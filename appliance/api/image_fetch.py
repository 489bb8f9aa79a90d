"""Remote image URLs (`http(s)://...` in an `image_url`, an `input_image` or an Anthropic `url` source), fetched by
the HTTP worker before the job is built, only from the hosts the operator lists (`--image-url-hosts`; none by
default: data URLs and base64 only).

Why each rule: a server that fetches what a request names can be pointed at what only it can reach (the box's
own services, the LAN, a cloud metadata address) and made to wait or fill its memory. So a fetch
- goes only to a listed host (exact names or IP literals, compared lowercase), by http or https on any port;
- resolves the name once and refuses it if any address it resolves to is not a global unicast one (loopback,
  private, shared, link-local, multicast, reserved, unspecified, IPv4-mapped forms of those), then connects to a
  vetted address itself, so a second resolution cannot swap the address after the check (DNS rebinding);
- verifies https with the system's CA store and the URL's host name (SNI and the certificate's name);
- follows at most MAX_REDIRECTS redirects, each checked as a new URL (its host listed, its addresses vetted);
- reads at most `Limits.image_bytes` per image (a larger Content-Length is refused before the body, a longer body
  when it passes the bound), all of a request's images within `--image-url-timeout` seconds from the first
  resolution to the last byte: a watchdog shuts the socket down at the deadline, so a server that drips a byte a
  second cannot hold the worker's thread longer;
- sends no credentials: URLs with a user or password are refused, no cookies, no proxy from the environment.
Each refusal is a 400 naming the field; the file is then checked as any other (images.checked_file).
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import threading
import time
from urllib.parse import urljoin, urlsplit

from appliance.api.errors import invalid
from appliance.api.images import Image, checked_file, map_images
from appliance.limits import Limits

MAX_REDIRECTS = 3
CHUNK = 65536
USER_AGENT = "appliance-image-fetch"


def listed_hosts(setting: str | None) -> frozenset[str]:
    """`--image-url-hosts` -> the host names (lowercase; an IPv6 literal without brackets)."""
    return frozenset(h.strip().lower().strip("[]") for h in (setting or "").split(",") if h.strip())


def vetted(address: str) -> bool:
    """A global unicast address (what a public server has): not loopback, private, shared (100.64/10),
    link-local, multicast, reserved or unspecified, nor the IPv4-mapped IPv6 form of one (::ffff:127.0.0.1)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


class _Refused(Exception):
    pass


class _Fetch:
    """One remote image: `run()` -> the file, or _Refused with the reason."""

    def __init__(self, hosts: frozenset[str], limits: Limits, seconds: float):
        self.hosts, self.limits, self.seconds = hosts, limits, seconds
        self.deadline = time.monotonic() + seconds

    def late(self) -> _Refused:
        return _Refused(f"the image did not arrive within {self.seconds:g} s (--image-url-timeout)")

    def left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self.late()
        return left

    def run(self, url: str) -> bytes:
        for _ in range(MAX_REDIRECTS + 1):
            status, location, data = self.get(url)
            if location is None:
                if status != 200:
                    raise _Refused(f"the image URL answered HTTP {status}")
                return data
            url = urljoin(url, location)
        raise _Refused(f"the image URL redirected more than {MAX_REDIRECTS} times")

    def target(self, url: str) -> tuple[str, str, int, str]:
        """(scheme, host, port, path and query) of a URL this server may fetch."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise _Refused("only http and https image URLs are fetched")
        if parts.username is not None or parts.password is not None:
            raise _Refused("image URLs with a user or password are not fetched")
        try:
            port = parts.port or (443 if scheme == "https" else 80)
        except ValueError:
            raise _Refused("the image URL's port is not a number in 1-65535") from None
        host = (parts.hostname or "").lower()
        if host not in self.hosts:
            raise _Refused(
                f"the host {host!r} is not one this server fetches images from (its operator lists them: "
                "--image-url-hosts); send the image as a data URL (base64)"
            )
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return scheme, host, port, path

    def addresses(self, host: str, port: int) -> list[tuple]:
        """Every address `host` resolves to, all vetted (any other one refuses the host), within the deadline."""
        found: list = []
        failure: list[BaseException] = []

        def resolve() -> None:
            try:
                found.extend(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
            except (OSError, UnicodeError) as exc:
                failure.append(exc)

        thread = threading.Thread(target=resolve, name="image-url-resolve", daemon=True)
        thread.start()
        thread.join(self.left())
        if thread.is_alive():
            raise self.late()
        if failure or not found:
            raise _Refused(f"the host {host!r} does not resolve")
        for info in found:
            if not vetted(info[4][0]):
                raise _Refused(
                    f"the host {host!r} resolves to {info[4][0]}, which is not a public address (loopback, private, "
                    "link-local, multicast and reserved addresses are never fetched)"
                )
        return found

    def connect(self, host: str, port: int) -> socket.socket:
        last: OSError | None = None
        for family, kind, proto, _, address in self.addresses(host, port):
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(self.left())
                sock.connect(address)
                return sock
            except OSError as exc:
                sock.close()
                last = exc
        self.left()
        raise _Refused(f"cannot connect to the image URL's host {host!r}: {last}")

    def get(self, url: str) -> tuple[int, str | None, bytes]:
        """One GET: (status, a redirect's Location or None, the body when 200)."""
        scheme, host, port, path = self.target(url)
        held = [self.connect(host, port)]  # the socket in use: TLS wraps it into another object
        fired = threading.Event()  # the watchdog shut the socket: what was read by then is cut, not the file

        def shut() -> None:
            fired.set()
            _shut(held[-1])

        watchdog = threading.Timer(max(self.deadline - time.monotonic(), 0), shut)
        watchdog.daemon = True
        watchdog.start()
        try:
            sock = held[0]
            if scheme == "https":
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
                held.append(sock)
            conn = http.client.HTTPConnection(host, port, timeout=self.left())
            conn.sock = sock  # the vetted, connected socket: http.client never resolves the name again
            default = 443 if scheme == "https" else 80
            conn.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
            name = f"[{host}]" if ":" in host else host  # an IPv6 literal
            conn.putheader("Host", name if port == default else f"{name}:{port}")
            conn.putheader("User-Agent", USER_AGENT)
            conn.putheader("Accept", "image/jpeg, image/png, image/webp")
            conn.putheader("Connection", "close")
            conn.endheaders()
            response = conn.getresponse()
            if response.status in (301, 302, 303, 307, 308):
                location = response.getheader("Location")
                if not location:
                    raise _Refused(f"the image URL answered HTTP {response.status} without a Location")
                return response.status, location, b""
            if response.status != 200:
                return response.status, None, b""
            length = response.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) > self.limits.image_bytes:
                raise _Refused(f"the image is larger than {self.limits.image_bytes} bytes (--max-image-bytes)")
            data = bytearray()
            while chunk := response.read1(CHUNK):
                data += chunk
                if len(data) > self.limits.image_bytes:
                    raise _Refused(f"the image is larger than {self.limits.image_bytes} bytes (--max-image-bytes)")
            if fired.is_set():
                raise self.late()
            return 200, None, bytes(data)
        except ssl.SSLError as exc:
            if fired.is_set():
                raise self.late() from None
            self.left()
            raise _Refused(f"the image URL's TLS failed: {exc.reason or exc}") from None
        except (OSError, http.client.HTTPException) as exc:
            if fired.is_set():
                raise self.late() from None
            self.left()  # past the deadline: say so
            raise _Refused(f"fetching the image failed: {exc or type(exc).__name__}") from None
        finally:
            watchdog.cancel()
            held[-1].close()


def _shut(sock: socket.socket) -> None:
    """The watchdog: ends a fetch that passed its deadline (a blocked read returns at once)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def fetch_images(messages: tuple[dict, ...], hosts: frozenset[str], limits: Limits, seconds: float) -> tuple[dict, ...]:
    """The messages with each remote image's file fetched (the module docstring's rules), all of them within one
    deadline of `seconds`; the other images as they are."""
    fetch = _Fetch(hosts, limits, seconds)

    def get(image: Image) -> Image:
        if image.url is None:
            return image
        try:
            data = fetch.run(image.url)
        except _Refused as exc:
            raise invalid(f"{image.where}: {exc}", image.where) from None
        return Image(image.where, checked_file(data, image.where, limits))

    return map_images(messages, get)
