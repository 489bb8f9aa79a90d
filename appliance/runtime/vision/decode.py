"""An image file from a client -> the pixels the preprocessing reads, or ImageRejected with a message for the client.

Untrusted bytes meet a C decoder here, so the order is the defence:
- the format is sniffed by Pillow restricted to JPEG, PNG and WebP (`Image.open(formats=...)`): no other plugin's
  parser ever runs on the bytes; a GIF, BMP, TIFF, ... is named in the refusal when its magic bytes say what it is;
- `Image.open` reads the header only: the pixel count (width x height) is checked against the limit before a
  single pixel is decoded, so a 100k x 100k PNG of a few kB (a decompression bomb, 30 GB decoded) costs nothing;
  so is a JPEG's count of scans (MAX_JPEG_SCANS), each a pass over every pixel;
- `load` decodes with Pillow's LOAD_TRUNCATED_IMAGES off (its default, never changed here): a truncated or corrupt
  file is refused, never padded with grey. Whatever the decoder raises becomes ImageRejected: no traceback reaches
  the client, and nothing about the server leaks but the decoder's own one-line reason.

The picture is turned upright by its EXIF orientation (as transformers' load_image does for a file or URL, and as
any viewer shows it: a gauge photographed with a phone held upright is stored sideways), and normalised to one of
two modes, RGB or (when the file has transparency) RGBA, because the two schemes' processors in transformers treat
alpha differently (Qwen2-VL drops it, Idefics3 composites onto white after resizing): the preprocessing does either
from these two. A 16-bit greyscale PNG (Pillow's mode I;16) is scaled to 8 bits first: Pillow's convert("RGB")
clips each value to 255, so every such picture became white (transformers' load_image does the same; one of the two
places the pixels differ from its processors, docs/vision.md). 16-bit colour PNGs, CMYK JPEGs, palettes with
transparency, animated PNG and WebP files (their first frame: a still picture is what the model reads) need
nothing: Pillow reads them right. Its digest (BLAKE2b-128 over the mode, the
size and the pixel bytes, never the file) names the picture in the prefix cache (runtime/media.py): the same
picture re-encoded (another JPEG quality, PNG instead of WebP losslessly) is the same picture.
"""

from __future__ import annotations

import hashlib
import io
import re
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image

from appliance.manifest import Vision
from appliance.runtime.vision.errors import ImageRejected

FORMATS = ("JPEG", "PNG", "WEBP")
ACCEPTED = "JPEG, PNG or WebP"
# Formats recognised by their first bytes only to name them in a refusal (their decoders never run)
_MAGIC = (
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"8BPS", "PSD"),
    (b"%PDF", "PDF"),
    (b"<?xml", "SVG"),
    (b"<svg", "SVG"),
)
_ORIENTATION = 0x0112  # EXIF: how the camera was held; a phone's photo is stored sideways with 6 or 8
_UPRIGHT = {  # orientation -> the transpose that shows the picture as it was taken (Pillow's ImageOps.exif_transpose)
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
# Pillow warns past 89M pixels: here the operator's limit (checked from the header in open_header) is the bound,
# and a warning per large image would only fill the log
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
_HEIF = (b"ftypheic", b"ftypheix", b"ftypmif1", b"ftypavif")
# A progressive JPEG is decoded scan by scan, each a pass over the whole picture: scans of a few bytes each (runs of
# empty blocks) would make one 10 MiB file cost ~100k passes over 16M pixels, and libjpeg, which Pillow calls, has no
# limit of its own (libjpeg-turbo's is in djpeg and TurboJPEG only). Encoders write 10 (libjpeg's progressive
# script) to ~20; a file with more is refused from its bytes, before the decoder runs. Counted as SOS markers
# (FF DA), which entropy-coded data cannot hold (its FF bytes are stuffed as FF 00): an upper bound, as an EXIF
# thumbnail's own scan counts too. Measured: the same 10-scan 1024 x 1024 file with one scan repeated 1000 times
# decoded in 0.4-4.9 s (its repeats are large: the cost grows with both scans and bytes).
MAX_JPEG_SCANS = 64


@dataclass(frozen=True)
class Decoded:
    """A decoded picture (mode RGB or RGBA, loaded) and the digest of its pixels."""

    image: Image.Image
    digest: bytes  # BLAKE2b-128 of mode, size and pixel bytes

    @property
    def size(self) -> tuple[int, int]:
        """(width, height), as PIL has it."""
        return self.image.size


def open_header(data: bytes, max_pixels: int) -> Image.Image:
    """The image's header parsed (nothing decoded yet), or ImageRejected for a format not taken or more pixels than
    `max_pixels`."""
    if not data:
        raise ImageRejected(f"the image is empty (0 bytes); send a {ACCEPTED} file")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as exc:  # Pillow's own bound (179M pixels), checked in open(), before ours
        count = re.search(r"\((\d+) pixels\)", str(exc))
        raise ImageRejected(_too_large(count.group(1) if count else "too many", max_pixels)) from None
    except Exception:  # UnidentifiedImageError, or a header the plugin chokes on
        raise ImageRejected(_unreadable(data)) from None
    scans = data.count(b"\xff\xda") if image.format == "JPEG" else 0
    if scans > MAX_JPEG_SCANS:
        raise ImageRejected(
            f"the JPEG file has {scans} scans, more than the limit of {MAX_JPEG_SCANS}; save it again as a baseline "
            "or standard progressive JPEG"
        )
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageRejected(f"the image is {width} x {height} pixels: nothing to read")
    if width * height > max_pixels:
        raise ImageRejected(_too_large(f"{width} x {height} = {width * height}", max_pixels))
    return image


def orientation(image: Image.Image) -> int:
    """The EXIF orientation (1-8) of an opened, not yet decoded image, from the metadata its header carries: a
    JPEG's APP1, a WebP's EXIF chunk, a PNG's eXIf chunk when it comes before the pixel data. Not from
    `getexif()`, which decodes a PNG whose eXIf chunk follows its pixels: the token count of every image is settled
    from headers before any is decoded, and decode() turns the picture by this same value, so the two agree (such a
    rare PNG is read as stored)."""
    raw = image.info.get("exif")
    if not raw:
        return 1
    try:
        exif = Image.Exif()
        exif.load(raw)
        value = int(exif.get(_ORIENTATION, 1))
    except Exception:  # an EXIF block Pillow cannot parse: read as stored, as decode() then does too
        return 1
    return value if value in _UPRIGHT else 1


def upright_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) of the picture as decode() returns it: turned upright, so a phone's portrait photo stored
    sideways (orientation 5-8) is taller than wide."""
    width, height = image.size
    return (height, width) if orientation(image) in (5, 6, 7, 8) else (width, height)


def decode(data: bytes, max_pixels: int) -> Decoded:
    """`data` (a client's file) decoded, checked first against `max_pixels` from its header; ImageRejected when it
    cannot or must not be read."""
    image = open_header(data, max_pixels)
    kind = image.format or "image"
    turn = _UPRIGHT.get(orientation(image))  # from the header, before load: as upright_size saw it
    try:
        image.load()
        picture = _eight_bit(image).convert("RGBA" if _has_alpha(image) else "RGB")  # a copy, even of RGB
        if turn is not None:
            picture = picture.transpose(turn)
    except Exception as exc:  # OSError (truncated), SyntaxError (broken PNG chunk), zlib, struct, ValueError, ...
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ImageRejected(f"the {kind} file is corrupt or truncated ({reason})") from None
    finally:
        image.close()  # the parser and its buffer; `picture` owns its pixels
    return Decoded(picture, digest(picture))


def digest(image: Image.Image) -> bytes:
    """BLAKE2b-128 over the mode, the size and the pixel bytes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.mode} {image.size[0]}x{image.size[1]}\n".encode())
    h.update(image.tobytes())
    return h.digest()


def normalized(vision: Vision, image: Image.Image) -> np.ndarray:
    """float32 [C, H, W] of an RGB picture: x * rescale_factor (in f64, then f32, as transformers' rescale), minus
    image_mean, over image_std (in f32, as its normalize): both schemes' last step, bit for bit theirs."""
    pixels = np.asarray(image).astype(np.float64) * vision.rescale_factor
    mean = np.asarray(vision.image_mean, np.float32)
    std = np.asarray(vision.image_std, np.float32)
    return ((pixels.astype(np.float32) - mean) / std).transpose(2, 0, 1)


def _too_large(pixels: str, max_pixels: int) -> str:
    return f"the image is {pixels} pixels, more than the limit of {max_pixels} pixels per image; send a smaller image"


def _eight_bit(image: Image.Image) -> Image.Image:
    """A 16-bit greyscale picture (I;16, or I from a PNG) as 8-bit L (LA when its tRNS names a transparent value),
    each value rounded from 0..65535 to 0..255: round(v / 257) is (v * 255 + 32895) >> 16 for every v (checked
    over all 65536 in the test), in uint32 in place, no division; a 16M-pixel picture takes 64 MiB beside its own
    32. Any other picture as it is."""
    if not image.mode.startswith("I"):
        return image
    values = np.asarray(image)
    scaled = (values if values.dtype == np.uint16 else np.clip(values, 0, 65535)).astype(np.uint32)
    scaled *= 255
    scaled += 32895
    scaled >>= 16
    grey = Image.fromarray(scaled.astype(np.uint8), "L")
    del scaled
    transparent = image.info.get("transparency")
    if not isinstance(transparent, int):
        return grey
    alpha = Image.fromarray(np.where(values == transparent, 0, 255).astype(np.uint8), "L")
    return Image.merge("LA", (grey, alpha))


def _has_alpha(image: Image.Image) -> bool:
    return image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info


def _unreadable(data: bytes) -> str:
    head = data[:16]
    kind = next((name for magic, name in _MAGIC if head.startswith(magic)), None)
    if kind is None and head[4:12] in _HEIF:
        kind = "HEIF/AVIF"
    if kind is not None:
        return f"{kind} images are not accepted: send a {ACCEPTED} file"
    return f"the data is not a {ACCEPTED} image (or its header is corrupt)"
