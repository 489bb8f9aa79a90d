"""Images on every client API against a real server with the default text model: each API's image request is
refused in its own error shape (the engine's "reads text only" 400), hostile image inputs are refused in the worker
beside a live stream that never stalls, and remote URLs are fetched only from listed hosts with public addresses,
within the byte and time limits (the last in a network namespace of its own: image_fetch_netns.py).

And against a tiny VLM (tests/tiny_vlms.py's Qwen2-VL): files that pass the worker's magic-byte check but that the
engine process refuses (truncated, corrupt, a decompression bomb by its header, a PNG whose IHDR lies, a chunk bomb)
are a 400 naming the image's field in each API's shape beside a live stream; the picture modes and animations it
reads are answered; an image at --max-image-bytes is answered through each official client, one byte over is a 400
and a body past --max-body-bytes a 413 the client reads (never a dropped connection).

The worker-side checks are unit-tested in tests/api/test_images.py; a VLM's answers through the same clients are
tests/e2e/test_vlm_clients.py."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from appliance.api.images import sniff
from appliance.limits import image_body_bytes
from appliance.testing.loopback import ROOT
from tests.e2e.image_requests import LiveStream, clients, data_url, picture, refusal, requests_by_api
from tests.helpers import Server, many_scans

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
    fields = {
        "openai chat": "messages[0].content[1].image_url.url",
        "openai responses": "input[0].content[1].image_url",
    }
    for api, call in requests_by_api(clients(srv.base), name, picture()).items():
        status, message, body = refusal(call)
        assert status == 400, (api, message)
        assert "reads text only" in message, (api, message)
        if api.startswith("openai"):  # the first image's field, as each of OpenAI's APIs names it
            field = fields["openai chat" if api.startswith("openai chat") else api]
            assert body["type"] == "invalid_request_error" and body["param"] == field, (api, body)
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
    for fetched in ("ok.png", "to-ok", "https-trusted"):  # the file arrived: what follows is the engine's answer
        case = cases[fetched]  # (the text model's refusal, naming the image's field), never a fetch refusal
        assert case["status"] == 400 and "reads text only" in case["message"], (fetched, case)
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


# ---------------------------------------------------------------- a VLM: the engine's refusals and the byte limits

VLM_IMAGE_BYTES = 1 << 20  # --max-image-bytes of the VLM server; its --max-body-bytes is the least that carries one


@pytest.fixture(scope="module")
def vlm(vlm_export, tmp_path_factory):
    _, out, _ = vlm_export("qwen2_vl")
    with Server(
        out,
        tmp_path_factory.mktemp("vlm-images") / "serve.log",
        "--workers",
        "2",
        "--max-image-bytes",
        str(VLM_IMAGE_BYTES),
        "--max-body-bytes",
        str(image_body_bytes(VLM_IMAGE_BYTES)),
    ) as s:
        yield s


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png(width: int, height: int, rows: bytes, *chunks: bytes) -> bytes:
    """A PNG of 8-bit RGB `rows` (filter byte + pixels each) under an IHDR of width x height, `chunks` before it."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"".join(
        [PNG_HEAD, _chunk(b"IHDR", header), *chunks, _chunk(b"IDAT", zlib.compress(rows)), _chunk(b"IEND", b"")]
    )


def _saved(image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def engine_refused_files() -> list[tuple[str, bytes, str]]:
    """(what, file, words the refusal says): each passes the worker (magic bytes, size) and the engine refuses it."""
    from PIL import Image

    jpeg = picture(640, 480, fmt="JPEG")  # its half ends inside the scan data, after the header
    webp = bytearray(picture(64, 48, fmt="WEBP"))
    webp[30:60] = b"\xff" * 30
    rows = (b"\0" + bytes(64 * 3)) * 48
    progressive = _saved(Image.open(io.BytesIO(jpeg)), "JPEG", progressive=True)
    return [
        ("truncated JPEG", jpeg[: len(jpeg) // 2], "corrupt or truncated"),
        ("decompression bomb", _png(20000, 20000, bytes(64)), "more than the limit of 16777216 pixels"),
        ("corrupt WebP", bytes(webp), "corrupt or truncated"),
        ("IHDR lies", _png(2000, 2000, rows), "corrupt or truncated"),
        ("text chunk bomb", _png(64, 48, rows, _chunk(b"zTXt", b"k\0\0" + zlib.compress(bytes(64 << 20)))), "PNG"),
        ("GIF under a PNG signature", PNG_HEAD + _saved(Image.new("RGB", (8, 8)), "GIF")[6:], "not a JPEG, PNG"),
        ("JPEG of many scans", many_scans(progressive, 200), "scans, more than the limit"),
    ]


def image_bodies(name: str, data: bytes) -> list[tuple[str, dict, str]]:
    """(path, body, the image's field as the API names it) for one image on every route that takes images."""
    url, raw = data_url(data), b64(data)
    text = {"type": "text", "text": "What is it?"}
    declared = sniff(data)  # Anthropic's media_type must be the file's, or the worker refuses it first
    block = {"type": "image", "source": {"type": "base64", "media_type": declared, "data": raw}}
    anthropic = {"model": name, "max_tokens": 4, "messages": [{"role": "user", "content": [block, text]}]}
    responses_content = [{"type": "input_text", "text": "What?"}, {"type": "input_image", "image_url": url}]
    return [
        (
            "/v3/chat/completions",
            {"model": name, "max_tokens": 4, "messages": [{"role": "user", "content": [text, image_part(url)]}]},
            "messages[0].content[1].image_url.url",
        ),
        (
            "/v1/responses",
            {"model": name, "max_output_tokens": 4, "input": [{"role": "user", "content": responses_content}]},
            "input[0].content[1].image_url",
        ),
        ("/v1/messages", anthropic, "messages.0.content.0.source.data"),
        ("/v1/messages/count_tokens", anthropic, "messages.0.content.0.source.data"),
        (
            "/api/chat",
            {"model": name, "stream": False, "messages": [{"role": "user", "content": "What?", "images": [raw]}]},
            "messages[0].images[0]",
        ),
        ("/api/generate", {"model": name, "stream": False, "prompt": "What?", "images": [raw]}, "images[0]"),
    ]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_files_the_engine_refuses_are_400s_naming_their_field_beside_a_live_stream(vlm):
    """Each file the engine process cannot or must not read is a 400 in each API's shape whose message starts with
    the image's field (and OpenAI's `param` is it: chat's messages[...], Responses' input[...]), while a stream
    runs without a stall past STALL_BOUND; a plain image is answered afterwards."""
    name = vlm.model_id()
    failures = []
    with LiveStream(vlm.base, name, max_tokens=400) as live:  # the tiny model's context is 512
        start = time.monotonic()
        for what, data, words in engine_refused_files():
            for path, body, field in image_bodies(name, data):
                r = requests.post(vlm.base + path, json=body, timeout=60)
                message = message_of(path, r) if r.status_code == 400 else r.text[:300]
                param = r.json()["error"].get("param") if path.startswith(("/v3/", "/v1/r")) else field
                if r.status_code != 400 or not message.startswith(f"{field}: ") or words not in message:
                    failures.append((what, path, r.status_code, message))
                elif param != field:
                    failures.append((what, path, "param", param))
        end = time.monotonic()
    assert not failures, failures
    largest = live.largest_gap(start, end)
    assert largest <= STALL_BOUND, f"the live stream stalled {largest:.2f} s"
    for path, body, _ in image_bodies(name, picture()):
        assert requests.post(vlm.base + path, json=body, timeout=120).status_code == 200, path


def test_the_picture_modes_and_animations_the_engine_reads_are_answered(vlm):
    """CMYK JPEG, 16-bit grey and colour PNG, a palette with transparency, grey + alpha, animated PNG and WebP (the
    first frame): each answered on chat, with the image's tokens in the prompt."""
    from PIL import Image

    rgb = Image.open(io.BytesIO(picture(64, 48)))
    grey16 = Image.frombytes("I;16", (64, 48), bytes(range(256)) * 24)
    rows16 = (b"\0" + bytes(range(256)) * 3)[: 1 + 64 * 6] * 48
    header16 = struct.pack(">IIBBBBB", 64, 48, 16, 2, 0, 0, 0)
    colour16 = b"".join(
        [PNG_HEAD, _chunk(b"IHDR", header16), _chunk(b"IDAT", zlib.compress(rows16)), _chunk(b"IEND", b"")]
    )
    frames = [rgb, rgb.transpose(Image.Transpose.FLIP_LEFT_RIGHT)]
    files = {
        "CMYK JPEG": _saved(rgb.convert("CMYK"), "JPEG"),
        "16-bit grey PNG": _saved(grey16, "PNG"),
        "16-bit colour PNG": colour16,
        "palette + transparency": _saved(rgb.convert("P"), "PNG", transparency=0),
        "grey + alpha": _saved(rgb.convert("LA"), "PNG"),
        "animated PNG": _saved(frames[0], "PNG", save_all=True, append_images=frames[1:]),
        "animated WebP": _saved(frames[0], "WEBP", save_all=True, append_images=frames[1:]),
    }
    name = vlm.model_id()
    plain = {"model": name, "max_tokens": 1, "messages": [{"role": "user", "content": "What is it?"}]}
    without = requests.post(vlm.base + "/v3/chat/completions", json=plain, timeout=120).json()["usage"]
    for what, data in files.items():
        path, body, _ = image_bodies(name, data)[0]
        r = requests.post(vlm.base + path, json=body, timeout=120)
        assert r.status_code == 200, (what, r.text[:300])
        assert r.json()["usage"]["prompt_tokens"] > without["prompt_tokens"], what


def exactly(size: int) -> bytes:
    """A real PNG of exactly `size` bytes: a picture and a private ancillary chunk of padding (which readers skip)."""
    small = picture()
    pad = size - len(small) - 12
    assert pad >= 0
    return small[:33] + _chunk(b"prVt", bytes(pad)) + small[33:]


def test_an_image_at_the_byte_limit_is_answered_and_past_it_refused_by_every_client(vlm):
    """With --max-body-bytes the least that carries one --max-image-bytes image (limits.image_body_bytes), an
    image of exactly that many bytes is answered through each official client; one byte more is that API's 400;
    a body past --max-body-bytes is its 413, read by the client as an error answer, not a dropped connection."""
    name = vlm.model_id()
    at_limit, over = exactly(VLM_IMAGE_BYTES), exactly(VLM_IMAGE_BYTES + 1)
    too_big = exactly(VLM_IMAGE_BYTES * 2)  # its base64 is past the body limit
    assert len(data_url(too_big)) > image_body_bytes(VLM_IMAGE_BYTES) > len(data_url(at_limit)) + 1000
    for call in requests_by_api(clients(vlm.base), name, at_limit, max_tokens=2).values():
        call()  # answered: the client raised nothing
    for api, call in requests_by_api(clients(vlm.base), name, over).items():
        status, message, _ = refusal(call)
        assert status == 400 and f"larger than {VLM_IMAGE_BYTES} bytes (--max-image-bytes)" in message, (api, message)
    for api, call in requests_by_api(clients(vlm.base), name, too_big).items():
        status, message, body = refusal(call)
        assert status == 413 and "Request body too large" in message, (api, status, message)
        if api.startswith("anthropic"):
            assert body["error"]["type"] == "request_too_large", body
