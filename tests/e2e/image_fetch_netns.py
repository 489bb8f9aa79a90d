"""The remote image URL drill, run by test_image_inputs.py in a network namespace of its own (`unshare -n`): there
an image server can listen on a global address (`ADDRESS`, on the namespace's own loopback device), which is what a
listed host must resolve to before the worker fetches from it (appliance/api/image_fetch.py), and nothing leaves
the namespace. Beside it the same server over https twice, with a certificate the appliance trusts (its
SSL_CERT_FILE) and with one it does not. A real server (the default text model) runs with a live stream; each
case's answer and time, the paths the image servers were asked for and the stream's largest gap are printed as one
JSON object.

Usage: unshare -n python -m tests.e2e.image_fetch_netns MODEL_DIR LOG_DIR
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import requests

from tests.e2e.image_requests import LiveStream, picture
from tests.helpers import Server, self_signed_cert

ADDRESS = "45.33.32.156"  # any global unicast address: inside this namespace it is the box's own
IMAGE_BYTES = 65536
TIMEOUT = 2.0  # --image-url-timeout
asked: list[str] = []


class Images(BaseHTTPRequestHandler):
    """The listed host: a good image, a too-large one (with and without a Content-Length), one that drips, one
    that never answers, and redirects."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        asked.append(self.path)
        port = self.server.server_address[1]
        if self.path == "/ok.png":
            self.answer(picture())
        elif self.path == "/big.png":  # no Content-Length: the body passes the bound as it arrives
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"\x89PNG\r\n\x1a\n" + bytes(IMAGE_BYTES * 2))
        elif self.path == "/big-declared.png":
            self.send_response(200)
            self.send_header("Content-Length", str(50 * 2**20))
            self.end_headers()
            self.wfile.write(b"\x89PNG\r\n\x1a\n")
        elif self.path == "/drip.png":  # a byte at a time, each well within any per-read timeout
            self.send_response(200)
            self.end_headers()
            for byte in picture():
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.2)
        elif self.path == "/silent.png":
            time.sleep(TIMEOUT * 5)
        elif self.path == "/to-loopback":
            self.redirect(f"http://localhost:{port}/ok.png")
        elif self.path == "/to-unlisted":
            self.redirect("http://example.com/ok.png")
        elif self.path == "/to-ok":
            self.redirect("/ok.png")
        else:
            self.send_error(404)

    def answer(self, data: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()


PATHS = ("ok.png", "big.png", "big-declared.png", "drip.png", "silent.png", "to-loopback", "to-unlisted", "to-ok")


def https_images(folder: Path, name: str) -> tuple[ThreadingHTTPServer, Path]:
    """The image server over https with a new self-signed certificate for ADDRESS (`name`.pem)."""
    cert, key = self_signed_cert(folder / f"{name}.pem", folder / f"{name}-key.pem", ADDRESS, f"IP:{ADDRESS}")
    server = ThreadingHTTPServer((ADDRESS, 0), Images)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    return server, cert


def main(model_dir: Path, log_dir: Path) -> dict:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["ip", "addr", "add", f"{ADDRESS}/32", "dev", "lo"], check=True)
    images = ThreadingHTTPServer((ADDRESS, 0), Images)
    trusted, ca = https_images(log_dir, "trusted")
    untrusted, _ = https_images(log_dir, "untrusted")
    for server in (images, trusted, untrusted):
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://{ADDRESS}:{images.server_address[1]}"
    urls = {path: f"{base}/{path}" for path in PATHS}
    urls["https-trusted"] = f"https://{ADDRESS}:{trusted.server_address[1]}/ok.png"
    urls["https-untrusted"] = f"https://{ADDRESS}:{untrusted.server_address[1]}/ok.png"
    os.environ["SSL_CERT_FILE"] = str(ca)  # the server's CA store: the trusted certificate only
    flags = ("--workers", "2", "--max-image-bytes", str(IMAGE_BYTES), "--image-url-timeout", str(TIMEOUT))
    hosts = ("--image-url-hosts", f"{ADDRESS},localhost")
    out: dict = {"cases": {}}
    with Server(model_dir, log_dir / "serve.log", *flags, *hosts) as srv:
        model = srv.model_id()

        def ask(case: str) -> None:
            parts = [
                {"type": "text", "text": "What is it?"},
                {"type": "image_url", "image_url": {"url": urls[case]}},
            ]
            body = {"model": model, "messages": [{"role": "user", "content": parts}], "max_tokens": 4}
            began = time.monotonic()
            r = requests.post(srv.base + "/v3/chat/completions", json=body, timeout=60)
            error = r.json().get("error") if r.status_code != 200 else None
            out["cases"][case] = {
                "status": r.status_code,
                "message": (error or {}).get("message", ""),
                "seconds": time.monotonic() - began,
            }

        askers = [threading.Thread(target=ask, args=(case,)) for case in urls]
        with LiveStream(srv.base, model) as live:
            start = time.monotonic()
            for t in askers:
                t.start()
            for t in askers:
                t.join()
            end = time.monotonic()
        out["largest_gap"] = live.largest_gap(start, end)
        after = requests.post(
            srv.base + "/v3/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=120,
        )
        out["after"] = after.status_code
    out["asked"] = sorted(asked)
    for server in (images, trusted, untrusted):
        server.shutdown()
    return out


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]))))
