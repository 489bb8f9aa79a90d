"""Image files from clients (appliance/runtime/vision/decode.py): the formats taken, the pixel bound checked from the
header before anything is decoded, corrupt and truncated files refused with a message, the pixel digest."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

from appliance.runtime.vision.decode import decode
from appliance.runtime.vision.errors import ImageRejected
from tests.helpers import many_scans

LIMIT = 16_777_216


def _picture(seed: int = 0, size: tuple[int, int] = (40, 56), mode: str = "RGB") -> Image.Image:
    channels = len(mode)
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, channels), dtype=np.uint8)
    return Image.fromarray(pixels, mode)


def _file(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png_claiming(width: int, height: int) -> bytes:
    """A valid PNG header for width x height RGB pixels, with a few bytes of (deflated zero) pixel data."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + _chunk(b"IEND", b"")
    )


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_the_accepted_formats_decode_to_rgb(fmt: str):
    image = _picture()
    decoded = decode(_file(image, fmt), LIMIT)
    assert decoded.image.mode == "RGB" and decoded.size == (56, 40)
    if fmt == "PNG":  # lossless: the very pixels
        assert np.array_equal(np.asarray(decoded.image), np.asarray(image))


def test_transparency_is_kept_as_rgba_and_grey_becomes_rgb():
    rgba = decode(_file(_picture(mode="RGBA"), "PNG"), LIMIT)
    assert rgba.image.mode == "RGBA"
    grey = decode(_file(_picture().convert("L"), "PNG"), LIMIT)
    assert grey.image.mode == "RGB"
    palette = _picture().convert("P")
    palette.info["transparency"] = 0
    assert decode(_file(palette, "PNG", transparency=0), LIMIT).image.mode == "RGBA"


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # pytest resets decode.py's filter
def test_a_decompression_bomb_is_refused_from_its_header_without_decoding(monkeypatch: pytest.MonkeyPatch):
    loads = []
    original = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loads.append(self) or original(self))
    with pytest.raises(ImageRejected, match=r"is 10000000000 pixels, more than the limit of 16777216 pixels"):
        decode(_png_claiming(100_000, 100_000), LIMIT)  # (Pillow's own bound, 179M pixels, speaks first)
    with pytest.raises(ImageRejected, match=r"is 10000 x 10000 = 100000000 pixels, more than the limit of 16777216"):
        decode(_png_claiming(10_000, 10_000), LIMIT)
    with pytest.raises(ImageRejected, match="more than the limit of 9999 pixels"):
        decode(_file(_picture(size=(100, 100)), "PNG"), 9999)
    assert loads == []  # neither was decoded
    assert decode(_file(_picture(size=(100, 100)), "PNG"), 10_000).size == (100, 100) and loads


def test_a_jpeg_of_more_scans_than_encoders_write_is_refused_before_decoding(monkeypatch: pytest.MonkeyPatch):
    """Each scan is a pass over every pixel (decode.MAX_JPEG_SCANS); a progressive file as encoders write it reads."""
    from appliance.runtime.vision import decode as module

    jpeg = _file(_picture(size=(64, 64)), "JPEG", progressive=True)
    assert 5 <= jpeg.count(b"\xff\xda") <= module.MAX_JPEG_SCANS
    assert decode(jpeg, LIMIT).size == (64, 64)
    assert decode(many_scans(jpeg, 3), LIMIT).size == (64, 64)  # repeated scans are still a readable file
    monkeypatch.setattr(Image.Image, "load", lambda self: pytest.fail("decoded a file refused by its scans"))
    scans = jpeg.count(b"\xff\xda") + 200
    with pytest.raises(ImageRejected, match=f"has {scans} scans, more than the limit of 64"):
        decode(many_scans(jpeg, 200), LIMIT)


def test_truncated_and_corrupt_files_are_refused():
    assert not ImageFile.LOAD_TRUNCATED_IMAGES  # truncated files are never padded out
    jpeg = _file(_picture(size=(64, 64)), "JPEG", quality=95)
    with pytest.raises(ImageRejected, match="the JPEG file is corrupt or truncated"):
        decode(jpeg[: len(jpeg) // 2], LIMIT)
    png = bytearray(_file(_picture(size=(64, 64)), "PNG"))
    png[len(png) // 2 : len(png) // 2 + 16] = b"\xff" * 16  # inside the pixel data: the CRC or inflate fails
    with pytest.raises(ImageRejected, match="the PNG file is corrupt or truncated"):
        decode(bytes(png), LIMIT)
    with pytest.raises(ImageRejected, match="corrupt or truncated"):
        decode(_png_claiming(64, 64), LIMIT)  # a valid header, too little pixel data


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_file(_picture(), "GIF"), "GIF images are not accepted: send a JPEG, PNG or WebP file"),
        (_file(_picture(), "BMP"), "BMP images are not accepted: send a JPEG, PNG or WebP file"),
        (_file(_picture(), "TIFF"), "TIFF images are not accepted"),
        (bytes(range(256)) * 4, "the data is not a JPEG, PNG or WebP image"),
        (b"", "the image is empty"),
    ],
)
def test_other_formats_and_garbage_are_refused_by_name(data: bytes, message: str):
    with pytest.raises(ImageRejected, match=message):
        decode(data, LIMIT)


def test_a_photo_is_turned_upright_by_its_exif_orientation():
    image = _picture()
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: shown turned 90 degrees clockwise
    decoded = decode(_file(image, "PNG", exif=exif), LIMIT)
    assert decoded.size == (40, 56)
    assert np.array_equal(np.asarray(decoded.image), np.rot90(np.asarray(image), k=-1))


def test_the_digest_follows_the_pixels_not_the_file():
    image = _picture()
    png = decode(_file(image, "PNG", compress_level=1), LIMIT)
    again = decode(_file(image, "PNG", compress_level=9), LIMIT)
    webp = decode(_file(image, "WEBP", lossless=True), LIMIT)
    assert png.digest == again.digest == webp.digest and len(png.digest) == 16
    changed = np.asarray(image).copy()
    changed[3, 5, 1] ^= 1
    assert decode(_file(Image.fromarray(changed), "PNG"), LIMIT).digest != png.digest
    rotated = decode(_file(image.transpose(Image.Transpose.ROTATE_90), "PNG"), LIMIT)
    assert rotated.digest != png.digest  # the same bytes in another shape are another picture


def _png16(values: np.ndarray, colour: int) -> bytes:
    """A 16-bit PNG of `values` (uint16, [h, w] grey or [h, w, 3] RGB: colour type 0 or 2), which Pillow cannot
    write itself in colour."""
    height, width = values.shape[:2]
    rows = values.reshape(height, -1).astype(">u2")
    raw = b"".join(b"\0" + row.tobytes() for row in rows)
    header = struct.pack(">IIBBBBB", width, height, 16, colour, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw)) + _chunk(b"IEND", b"")


def test_sixteen_bit_pngs_are_scaled_not_clipped():
    """Pillow's convert("RGB") clips a 16-bit grey value to 255: every such picture was white."""
    grey = np.array([[0, 257, 1000], [32768, 40000, 65535]], np.uint16)
    decoded = decode(_png16(grey, 0), LIMIT)
    assert decoded.image.mode == "RGB"
    assert np.asarray(decoded.image)[..., 0].tolist() == [[0, 1, 4], [128, 156, 255]]
    transparent = Image.open(io.BytesIO(_png16(grey, 0)))
    out = io.BytesIO()
    transparent.save(out, "PNG", transparency=1000)
    rgba = decode(out.getvalue(), LIMIT)
    assert rgba.image.mode == "RGBA" and np.asarray(rgba.image)[..., 3].tolist() == [[255, 255, 0], [255, 255, 255]]
    every = np.arange(65536, dtype=np.uint16).reshape(256, 256)  # each 16-bit value, rounded as v / 257
    assert np.array_equal(np.asarray(decode(_png16(every, 0), LIMIT).image)[..., 0], np.round(every / 257))
    colour = np.random.default_rng(1).integers(0, 65536, (4, 5, 3), dtype=np.uint16)
    assert np.array_equal(np.asarray(decode(_png16(colour, 2), LIMIT).image), colour >> 8)  # Pillow's own high byte


@pytest.mark.parametrize(
    ("mode", "options", "expected"),
    [("CMYK", {}, "RGB"), ("1", {}, "RGB"), ("LA", {}, "RGBA"), ("P", {"transparency": 3}, "RGBA")],
)
def test_other_modes_become_rgb_or_rgba(mode: str, options: dict, expected: str):
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    image = _picture().convert(mode)
    decoded = decode(_file(image, fmt, **options), LIMIT)
    assert decoded.image.mode == expected and decoded.size == (56, 40)
    if fmt == "PNG":
        assert np.array_equal(np.asarray(decoded.image), np.asarray(image.convert(expected)))


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_an_animation_is_read_as_its_first_frame(fmt: str):
    frames = [_picture(seed) for seed in range(3)]
    options = {"lossless": True} if fmt == "WEBP" else {}
    animated = decode(_file(frames[0], fmt, save_all=True, append_images=frames[1:], **options), LIMIT)
    assert np.array_equal(np.asarray(animated.image), np.asarray(frames[0]))


def test_corrupt_webp_and_chunk_bombs_are_refused():
    webp = _file(_picture(), "WEBP")
    with pytest.raises(ImageRejected):
        decode(webp[: len(webp) // 2], LIMIT)
    broken = bytearray(webp)
    broken[30:60] = b"\xff" * 30
    with pytest.raises(ImageRejected, match="corrupt or truncated"):
        decode(bytes(broken), LIMIT)
    png = _file(_picture(), "PNG")
    text_bomb = png[:-12] + _chunk(b"zTXt", b"k\0\0" + zlib.compress(b"a" * (64 << 20), 9)) + png[-12:]
    with pytest.raises(ImageRejected):  # Pillow bounds decompressed text (MAX_TEXT_CHUNK)
        decode(text_bomb, LIMIT)
    profile_bomb = png[:33] + _chunk(b"iCCP", b"p\0\0" + zlib.compress(b"a" * (64 << 20), 9)) + png[33:]
    with pytest.raises(ImageRejected):
        decode(profile_bomb, LIMIT)
