"""The images a chat request carries, as the HTTP worker takes them from every client API: base64 decoded and
bounded, checked to be a JPEG, PNG or WebP file by its first bytes, counted, and passed on in the order their parts
appear in the messages (`protocol.PromptSpec.images`).

Each adapter turns its own spelling into an `Image` inside a message's list content, `{"type": "image", "image":
Image}`: OpenAI's `image_url` parts (parsers.messages), Responses' `input_image` (as chat `image_url` parts),
Anthropic's `image` blocks, Ollama's `images`. An `Image` is a Python object, so no JSON body can spell that part
itself. `chat_job` (request.py) takes them out: the prompt keeps `{"type": "image"}` where each was (Hugging Face's
chat-template convention, which the VLM chat templates read) and the files travel beside it. A remote URL
(`Image.url`) is fetched by image_fetch.py before the job is built.

What is checked here, each refusal a 400 naming the field, in the message and as the OpenAI error's `param`, in the
client API's own spelling (`messages[0].content[1].image_url.url`, Responses' `input[0].content[1].image_url`,
Anthropic's `messages.0.content.0.source.data`, Ollama's `messages[0].images[0]`): at most `Limits.images` per
request (counted before one more is decoded), each file at most `Limits.image_bytes` (a longer base64 text is
refused by its length, before it is decoded), strict base64, a data URL's media type, and the file's magic bytes.
The worker never decodes pixels (no Pillow, numpy or OpenVINO in a worker): the engine process decodes each image,
checks `Limits.image_pixels` from its header and refuses a corrupt or truncated file (appliance/runtime/vision/);
its refusal names the image's field too (`PromptSpec.image_fields`, which `split_images` gives beside the files).
"""

from __future__ import annotations

import binascii
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from appliance.api.errors import invalid
from appliance.limits import Limits, base64_chars

MEDIA_TYPES = ("image/jpeg", "image/png", "image/webp")  # what the engine process decodes
KINDS = "JPEG, PNG or WebP"


@dataclass(frozen=True)
class Image:
    """One image of a request: its file (`data`), or a remote http(s) URL that image_fetch.py fetches into one.
    `where`: the field it came from (messages[1].content[0].image_url.url), which every refusal names (message and
    `param`), the engine's too."""

    where: str
    data: bytes = b""
    url: str | None = None


def sniff(data: bytes) -> str | None:
    """The media type the file's first bytes say (JPEG's SOI marker, PNG's signature, WebP's RIFF....WEBP header),
    None for anything else.

    The engine process reads each header again (Pillow, restricted to the same three formats), and this check stays
    anyway: the two run in different processes. Here a file that is no image is refused before its bytes (up to
    image_bytes each) are carried to the engine, in the API's own words (Anthropic's declared `media_type`), by a
    worker that never loads Pillow; there, where the C decoder runs, nothing a worker checked is taken on trust.
    Twelve bytes compared, not a parse: the header itself is read once, in the engine (runtime/vision/encoder.py's
    ImagePlan)."""
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def checked_file(data: bytes, where: str, limits: Limits, declared: str | None = None) -> bytes:
    """`data` if it is at most image_bytes and a JPEG, PNG or WebP file by its magic bytes (and, when `declared` is
    given, the type the client declared for it: Anthropic's `media_type`)."""
    if len(data) > limits.image_bytes:
        raise invalid(f"{where}: the image is larger than {limits.image_bytes} bytes (--max-image-bytes)", where)
    found = sniff(data)
    if found is None:
        raise invalid(f"{where}: the file is not a {KINDS} image (by its first bytes)", where)
    if declared is not None and found != declared:
        raise invalid(f"{where}: the image is {found}, not the declared {declared}", where)
    return data


def decode_base64(text: Any, where: str, limits: Limits) -> bytes:
    """Standard base64 (RFC 4648, padded, no whitespace) -> the file, at most image_bytes: a longer text is refused
    by its length, before anything is decoded."""
    if not isinstance(text, str) or not text:
        raise invalid(f"{where}: the image must be a non-empty base64 string", where)
    if len(text) > base64_chars(limits.image_bytes):
        raise invalid(f"{where}: the image is larger than {limits.image_bytes} bytes (--max-image-bytes)", where)
    try:
        return binascii.a2b_base64(text.encode("ascii"), strict_mode=True)
    except (UnicodeEncodeError, binascii.Error):
        raise invalid(f"{where}: the image is not valid base64", where) from None


def base64_image(text: Any, where: str, limits: Limits, media_type: str | None = None) -> Image:
    """A base64 file (Ollama's `images`, Anthropic's base64 source with its `media_type`) -> an Image."""
    if media_type is not None and media_type not in MEDIA_TYPES:
        raise invalid(f"{where}: media type {media_type!r} is not one of {', '.join(MEDIA_TYPES)}", where)
    return Image(where, checked_file(decode_base64(text, where, limits), where, limits, media_type))


def url_image(url: Any, where: str, limits: Limits) -> Image:
    """A `data:image/...;base64,...` URL (decoded here) or an http(s) URL (fetched later, if its host is listed:
    image_fetch.py). A data URL's declared type must be one the engine decodes; the file's own bytes decide what
    it is (OpenAI's clients often label every file image/jpeg)."""
    if not isinstance(url, str) or not url:
        raise invalid(f"{where}: the image URL must be a non-empty string", where)
    scheme = url[: url.find(":") + 1].lower()
    if scheme == "data:":
        head, comma, body = url.partition(",")
        fields = head[5:].split(";")
        if not comma or fields[-1].lower() != "base64":
            raise invalid(f"{where}: a data URL must be data:<media type>;base64,<data>", where)
        media_type = fields[0].lower()
        if media_type not in MEDIA_TYPES:
            raise invalid(
                f"{where}: the data URL's media type {media_type!r} is not one of {', '.join(MEDIA_TYPES)}", where
            )
        return Image(where, checked_file(decode_base64(body, where, limits), where, limits))
    if scheme in ("http:", "https:"):
        return Image(where, url=url)
    raise invalid(f"{where}: the image URL must be a data: URL (base64) or an http(s) URL", where)


class ImageCount:
    """Counts a request's images as its parts are read, refusing the one past `Limits.images` before it is
    decoded. `seen`: images the request already carries elsewhere (Responses: its previous response's)."""

    def __init__(self, limits: Limits, seen: int = 0):
        self.limits, self.seen = limits, seen

    def next(self, where: str) -> None:
        self.seen += 1
        if self.seen > self.limits.images:
            raise invalid(f"{where}: a request may carry at most {self.limits.images} images (--max-images)", where)


def images_of(messages: Any) -> Iterator[Image]:
    """Every Image in chat messages, in order."""
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if part.get("type") == "image" and isinstance(part.get("image"), Image):
                    yield part["image"]


def map_images(messages: tuple[dict, ...], change: Callable[[Image], Image]) -> tuple[dict, ...]:
    """The messages with each Image replaced by `change(image)` (the others as they are)."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(p.get("type") == "image" for p in content):
            parts = [{**p, "image": change(p["image"])} if p.get("type") == "image" else p for p in content]
            message = {**message, "content": parts}
        out.append(message)
    return tuple(out)


def split_images(messages: tuple[dict, ...]) -> tuple[list[dict], list[bytes] | None, list[str] | None]:
    """(the messages as the chat template reads them: each image a `{"type": "image"}` part, the files in order,
    each file's field in the client's request); None, None when there are no images. Every Image must have its
    file by now (remote ones fetched)."""
    files: list[bytes] = []
    fields: list[str] = []
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") == "image":
                    image = part["image"]
                    if image.url is not None:
                        raise RuntimeError(f"{image.where}: a remote image was not fetched before the job")
                    files.append(image.data)
                    fields.append(image.where)
                    parts.append({"type": "image"})
                else:
                    parts.append(dict(part))
            message = {**message, "content": parts}
        out.append(dict(message))
    return out, files or None, fields or None
