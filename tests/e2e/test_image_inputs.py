"""Images on every client API against a real server with the default text model: each API's image request is
refused in its own error shape (the engine's "reads text only" 400), hostile image inputs are refused in the worker
beside a live stream that never stalls, and remote URLs are fetched only from listed hosts with public addresses,
within the byte and time limits (the last in a network namespace of its own: image_fetch_netns.py).

The worker-side checks are unit-tested in tests/api/test_images.py; a VLM's answers through the same clients are
tests/e2e/test_vlm_clients.py."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from appliance.testing.loopback import ROOT
from tests.e2e.image_requests import LiveStream, clients, data_url, picture, refusal, requests_by_api
from tests.helpers import Server

pytestmark = pytest.mark.slow

MAX_IMAGES = 2
IMAGE_BYTES = 65536
STALL_BOUND = 1.0  # the largest gap a live stream may show while the hostile requests run


@pytest.fixture(scope="module")
def loopback_images():
    """An image server on loopback that must never be asked: the listed names below resolve to it."""
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            asked.append(self.path)
            self.send_error(404)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], asked
    server.shutdown()


@pytest.fixture(scope="module")
def srv(model_dir, tmp_path_factory):
    with Server(
        model_dir,
        tmp_path_factory.mktemp("images") / "serve.log",
        "--workers",
        "2",
        "--max-images",
        str(MAX_IMAGES),
        "--max-image-bytes",
        str(IMAGE_BYTES),
        "--image-url-hosts",
        "localhost,127.0.0.1,::1",  # listed, and still refused: they resolve to loopback
    ) as s:
        yield s


@pytest.fixture(scope="module")
def name(srv) -> str:
    return srv.model_id()


def test_a_text_model_refuses_images_in_each_api_shape(srv, name):
    """The engine's refusal (a text-only model given images) reaches each client as its own API's 400."""
    for api, call in requests_by_api(clients(srv.base), name, picture()).items():
        status, message, body = refusal(call)
        assert status == 400, (api, message)
        assert "reads text only" in message, (api, message)
        if api.startswith("openai"):
            assert body["type"] == "invalid_request_error" and body["param"] == "messages", (api, body)
        elif api.startswith("anthropic"):
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", (api, body)
    # the same questions without the image are answered
    for call in requests_by_api(clients(srv.base), name, None).values():
        call()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


PNG_HEAD = b"\x89PNG\r\n\x1a\n"


def hostile_requests(name: str, loopback_port: int) -> list[tuple[str, str, dict, str]]:
    """(path, what, body, words the refusal says) for every hostile input, in each API's spelling."""
    good = data_url(picture())

    def chat(*urls: str) -> dict:
        parts = [
            {"type": "text", "text": "What is it?"},
            *({"type": "image_url", "image_url": {"url": u}} for u in urls),
        ]
        return {"model": name, "messages": [{"role": "user", "content": parts}], "max_tokens": 4}

    def anthropic(source: dict) -> dict:
        content = [{"type": "image", "source": source}, {"type": "text", "text": "What is it?"}]
        return {"model": name, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}

    def ollama(*images: str) -> dict:
        return {
            "model": name,
            "stream": False,
            "messages": [{"role": "user", "content": "What?", "images": list(images)}],
        }

    oversize = PNG_HEAD + bytes(IMAGE_BYTES)
    loopback = f"http://localhost:{loopback_port}/a.png"
    return [
        ("/v3/chat/completions", "too many", chat(good, good, good), f"at most {MAX_IMAGES} images"),
        ("/v3/chat/completions", "oversize", chat(data_url(oversize)), f"larger than {IMAGE_BYTES} bytes"),
        ("/v3/chat/completions", "bad base64", chat("data:image/png;base64,iVBORw0K$$$"), "not valid base64"),
        ("/v3/chat/completions", "wrong magic", chat(data_url(b"GIF89a" + bytes(64))), "not a JPEG, PNG or WebP"),
        ("/v1/chat/completions", "unlisted host", chat("https://example.com/cat.png"), "not one this server fetches"),
        ("/v1/chat/completions", "listed, loopback", chat(loopback), "not a public address"),
        ("/v3/chat/completions", "listed literal", chat(f"http://127.0.0.1:{loopback_port}/a.png"), "not a public"),
        ("/v3/chat/completions", "listed IPv6 literal", chat(f"http://[::1]:{loopback_port}/a.png"), "not a public"),
        (
            "/v3/responses",
            "file_id",
            {"model": name, "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
            "file_id",
        ),
        (
            "/v3/responses",
            "listed, loopback",
            {"model": name, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": loopback}]}]},
            "not a public address",
        ),
        (
            "/v1/messages",
            "oversize",
            anthropic({"type": "base64", "media_type": "image/png", "data": b64(oversize)}),
            "larger than",
        ),
        (
            "/v1/messages",
            "media type",
            anthropic({"type": "base64", "media_type": "image/jpeg", "data": b64(picture())}),
            "not the declared image/jpeg",
        ),
        ("/v1/messages", "listed, loopback", anthropic({"type": "url", "url": loopback}), "not a public address"),
        (
            "/v1/messages/count_tokens",
            "bad base64",
            anthropic({"type": "base64", "media_type": "image/png", "data": "@@"}),
            "not valid base64",
        ),
        ("/api/chat", "bad base64", ollama("@@@@"), "not valid base64"),
        ("/api/chat", "too many", ollama(*[b64(picture())] * 3), f"at most {MAX_IMAGES} images"),
        (
            "/api/generate",
            "raw",
            {"model": name, "prompt": "x", "raw": True, "images": [b64(picture())], "stream": False},
            "raw",
        ),
    ]


def message_of(path: str, r: requests.Response) -> str:
    """The refusal's message, read from the API's own error shape (which it must have)."""
    body = r.json()
    if path.startswith("/api/"):
        assert set(body) == {"error"} and isinstance(body["error"], str), body
        return body["error"]
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        return body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error", body
    return body["error"]["message"]


def test_hostile_images_beside_a_live_stream(srv, name, loopback_images):
    """Every hostile input is a 400 in its API's shape while a stream runs; the stream never stalls past
    STALL_BOUND, nothing is fetched from loopback, and a plain request is answered afterwards."""
    port, asked = loopback_images
    failures = []
    with LiveStream(srv.base, name) as live:
        start = time.monotonic()
        for _ in range(3):
            for path, what, body, words in hostile_requests(name, port):
                r = requests.post(srv.base + path, json=body, timeout=60)
                if r.status_code != 400 or words not in message_of(path, r):
                    failures.append((path, what, r.status_code, r.text[:300]))
        end = time.monotonic()
    assert not failures, failures
    assert not asked, f"the worker fetched from loopback: {asked}"
    largest = live.largest_gap(start, end)
    assert largest <= STALL_BOUND, f"the live stream stalled {largest:.2f} s"
    plain = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert requests.post(srv.base + "/v3/chat/completions", json=plain, timeout=120).status_code == 200


def test_listed_hosts_are_fetched_within_the_limits(model_dir, tmp_path):
    """In a network namespace of its own (image_fetch_netns.py), a listed host with a global address serves a good
    image, too-large ones, a dripping and a silent one, and redirects, over http and over https (a certificate the
    server trusts, and one it does not): the good one (by a redirect too, and over trusted https) is fetched, every
    other is a 400 within the --image-url-timeout, a redirect to loopback or an unlisted host is refused, and the
    live stream beside them never stalls."""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-n", "true"], capture_output=True).returncode != 0:
        if os.environ.get("CI"):
            pytest.fail("unshare -n is not permitted here (CI: a failure, not a skip)")
        pytest.skip("unshare -n is not permitted here (no network namespace for a global test address)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(
        [unshare, "-n", sys.executable, "-m", "tests.e2e.image_fetch_netns", str(model_dir), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:] + (tmp_path / "serve.log").read_text()[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    cases = out["cases"]
    for fetched in (
        "ok.png",
        "to-ok",
        "https-trusted",
    ):  # the file arrived: what follows is the engine's answer (a text model's
        case = cases[fetched]  # refusal once the vision side serves), never a fetch refusal naming the URL
        assert "image_url.url" not in case["message"], (fetched, case)
    for case, words in (
        ("big.png", "larger than 65536 bytes"),
        ("big-declared.png", "larger than 65536 bytes"),
        ("drip.png", "did not arrive within 2 s"),
        ("silent.png", "did not arrive within 2 s"),
        ("to-loopback", "not a public address"),
        ("to-unlisted", "not one this server fetches"),
        ("https-untrusted", "TLS failed"),
    ):
        assert cases[case]["status"] == 400 and words in cases[case]["message"], (case, cases[case])
        assert cases[case]["seconds"] < 2.0 + 3.0, (case, cases[case])  # the timeout, and a loaded box's slack
    assert out["asked"].count("/ok.png") == 3 and "/to-ok" in out["asked"]  # http, its redirect, trusted https
    assert out["largest_gap"] <= STALL_BOUND, out
    assert out["after"] == 200
