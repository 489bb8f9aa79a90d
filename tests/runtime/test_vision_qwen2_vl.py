"""Qwen2-VL's image path (appliance/runtime/vision: qwen2_vl.py, encoder.py) on the tiny random model's fp32 export,
against transformers in f32: pixel values (Qwen2VLImageProcessor), image features (the model's vision tower), the
expanded prompt ids (the processor's rule: N <|image_pad|> per image) and the M-RoPE positions (get_rope_index)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from appliance.config import EngineConfig
from appliance.manifest import Manifest
from appliance.runtime.tokenizer import Tokenizer
from appliance.runtime.vision import qwen2_vl as scheme
from appliance.runtime.vision.decode import decode
from appliance.runtime.vision.encoder import VisionEncoder
from appliance.runtime.vision.errors import ImageRejected
from appliance.runtime.vision.feature_cache import OVERHEAD
from tests import tiny_vlms

PIXEL_ATOL = 1e-5
FEATURE_ATOL = 1e-4
LIMIT = 16_777_216
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def _png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def _images() -> list:
    """A non-square image (tiny_vlms.IMAGE_SIZE), a wide one of another size, and one with transparency."""
    from PIL import Image

    rng = np.random.default_rng(7)
    wide = Image.fromarray(rng.integers(0, 256, (30, 90, 3), dtype=np.uint8), "RGB")
    clear = Image.fromarray(rng.integers(0, 256, (64, 48, 4), dtype=np.uint8), "RGBA")
    return [tiny_vlms.image(), wide, clear]


@pytest.fixture(scope="module")
def qwen(vlm_export) -> tuple[Path, Path, Manifest, VisionEncoder]:
    src, out, manifest = vlm_export("qwen2_vl")
    return src, out, manifest, VisionEncoder(out, manifest, EngineConfig(precision="f32"))


def _messages(images: int) -> list[dict]:
    """A chat whose user turns carry `images` images (Hugging Face's content parts), with text between."""
    first = [{"type": "image"}] * min(images, 2) + [{"type": "text", "text": "What does the gauge read?"}]
    messages = [{"role": "user", "content": first}]
    if images > 2:
        messages += [
            {"role": "assistant", "content": "About forty."},
            {"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image"}]},
        ]
    return messages


def test_pixel_values_equal_the_image_processor(qwen):
    from transformers import Qwen2VLImageProcessor

    src, _, manifest, _ = qwen
    processor = Qwen2VLImageProcessor.from_pretrained(src)
    images = _images()
    expected = processor(images=images, return_tensors="np")
    ours = [scheme.pixel_values(manifest.vision, decode(_png(image), LIMIT).image) for image in images]
    assert [list(grid) for _, grid in ours] == expected["image_grid_thw"].tolist()
    pixels = np.concatenate([p for p, _ in ours])
    assert pixels.shape == expected["pixel_values"].shape and pixels.dtype == np.float32
    assert np.abs(pixels - expected["pixel_values"]).max() < PIXEL_ATOL


def test_prepare_matches_transformers_ids_features_and_positions(qwen):
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessor

    src, out, manifest, encoder = qwen
    vision = manifest.vision
    images = _images()
    messages = _messages(len(images))
    prompt = Tokenizer.from_dir(out).encode_chat(messages)  # the serving path's chat prompt, one placeholder per image
    ids, media = tiny_vlms.prepared(encoder, prompt, [_png(image) for image in images], LIMIT)

    inputs = Qwen2VLImageProcessor.from_pretrained(src)(images=images, return_tensors="pt")
    grid = inputs["image_grid_thw"]
    tokenizer = AutoTokenizer.from_pretrained(src)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.count(PLACEHOLDER) == len(images)
    for n in (int(g.prod()) // vision.merge_size**2 for g in grid):  # Qwen2VLProcessor's expansion, image by image
        text = text.replace(PLACEHOLDER, "<|vision_start|>" + "<|placeholder|>" * n + "<|vision_end|>", 1)
    expected_ids = tokenizer(text.replace("<|placeholder|>", "<|image_pad|>"))["input_ids"]
    assert ids == expected_ids and media.prompt_len == len(ids)

    model = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32).eval()
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        features = model.model.get_image_features(inputs["pixel_values"], grid)
        positions, delta = model.model.get_rope_index(input_ids, grid, None, torch.ones_like(input_ids))
    assert len(media.images) == len(images)
    for span, expected in zip(media.images, features):
        assert span.features.shape == tuple(expected.shape) and span.features.dtype == np.float32
        assert np.abs(span.features - expected.numpy()).max() < FEATURE_ATOL
        assert set(ids[span.start : span.end]) == {vision.image_token_id}
        assert ids[span.start - 1] == vision.image_start_token_id and ids[span.end] == vision.image_end_token_id
    assert media.mrope is not None and np.array_equal(media.mrope, positions[:, 0].numpy())
    assert media.rope_delta == int(delta[0, 0])


def test_placeholders_must_match_the_images(qwen):
    _, out, _, encoder = qwen
    tokenizer = Tokenizer.from_dir(out)
    two = tokenizer.encode_chat(_messages(2))
    image = _png(tiny_vlms.image())
    with pytest.raises(ImageRejected, match="1 image.* but its chat prompt has 2 image place") as caught:
        tiny_vlms.prepared(encoder, two, [image], LIMIT)
    assert caught.value.image is None  # about no one image
    with pytest.raises(ImageRejected, match="3 image.* but its chat prompt has 2 image place"):
        tiny_vlms.prepared(encoder, two, [image] * 3, LIMIT)
    # a user's text spelling the placeholder is text, not an image place (encode_chat keeps special-token text as text)
    spoof = tokenizer.encode_chat([{"role": "user", "content": PLACEHOLDER + " hi"}])
    with pytest.raises(ImageRejected, match="has 0 image place"):
        tiny_vlms.prepared(encoder, spoof, [image], LIMIT)


def test_every_header_is_checked_before_any_image_is_encoded(qwen, monkeypatch: pytest.MonkeyPatch):
    _, out, _, encoder = qwen
    prompt = Tokenizer.from_dir(out).encode_chat(_messages(2))
    encoded = []
    monkeypatch.setattr(encoder, "encode_qwen2_vl", lambda *a: encoded.append(a))
    with pytest.raises(ImageRejected, match="GIF images are not accepted") as gif:
        tiny_vlms.prepared(encoder, prompt, [_png(tiny_vlms.image()), _gif()], LIMIT)
    with pytest.raises(ImageRejected, match="more than the limit of 1000 pixels") as large:
        tiny_vlms.prepared(encoder, prompt, [_png(tiny_vlms.image(1)), _png(tiny_vlms.image())], 1000)
    assert encoded == []
    assert (gif.value.image, large.value.image) == (1, 0)  # which image, so the refusal can name its field


def test_a_needle_thin_image_is_refused():
    from PIL import Image

    manifest_vision = _vision()
    with pytest.raises(ImageRejected, match="aspect ratio must be at most 200"):
        scheme.pixel_values(manifest_vision, Image.new("RGB", (402, 2)))


def _vision():
    from appliance.manifest import Vision

    return Vision(
        scheme="qwen2_vl", parts={}, part_inputs={}, image_token_id=5, patch_size=14, merge_size=2,
        image_mean=[0.5] * 3, image_std=[0.5] * 3, temporal_patch_size=2, min_pixels=3136, max_pixels=12544,
    )  # fmt: skip


def _gif() -> bytes:
    out = io.BytesIO()
    tiny_vlms.image().save(out, "GIF")
    return out.getvalue()


def test_concurrent_prepares_equal_serial_ones(qwen):
    """Job threads call prepare at once: the encodes take turns on the model's parts (one lock), each gets its own
    rows, and the token counts from the headers are what prepare writes. (The feature cache off: every prepare
    encodes.)"""
    from concurrent.futures import ThreadPoolExecutor

    _, out, manifest, _ = qwen
    encoder = VisionEncoder(out, manifest, EngineConfig(precision="f32", image_cache_bytes=0))
    prompt = Tokenizer.from_dir(out).encode_chat([{"role": "user", "content": [{"type": "image"}]}])
    files = [_png(image) for image in _images()] * 2
    serial = [tiny_vlms.prepared(encoder, prompt, [data], LIMIT) for data in files]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda data: tiny_vlms.prepared(encoder, prompt, [data], LIMIT), files))
    for (ids, media), (ids2, media2), data in zip(serial, together, files):
        assert ids == ids2 and len(ids) == len(prompt) - 1 + encoder.plans([data], LIMIT)[0].tokens
        assert np.array_equal(media.images[0].features, media2.images[0].features)
        assert media.images[0].digest == media2.images[0].digest
    assert encoder.encodes == 2 * len(files)


def test_a_repeated_file_skips_its_decode_and_encode_in_its_scope_only(qwen, monkeypatch: pytest.MonkeyPatch):
    """The same file again in the same scope: no decode, no encode, the same ids, digest and features; its header
    is still checked (a lower pixel limit refuses it). Another scope encodes it anew; so does the same picture in
    another file (the prefix cache still knows it by its pixel digest)."""
    from appliance.runtime.vision import encoder as module

    _, out, manifest, _ = qwen
    encoder = VisionEncoder(out, manifest, EngineConfig(precision="f32"))
    prompt = Tokenizer.from_dir(out).encode_chat(_messages(1))
    data = _png(tiny_vlms.image())
    ids, media = tiny_vlms.prepared(encoder, prompt, [data], LIMIT, "key-a")
    assert encoder.encodes == 1

    def no_decode(*args):
        raise AssertionError("a cached file decoded")

    with monkeypatch.context() as patch:
        patch.setattr(module, "decode", no_decode)
        again_ids, again = tiny_vlms.prepared(encoder, prompt, [data], LIMIT, "key-a")
        with pytest.raises(ImageRejected, match="more than the limit of 1000 pixels"):
            tiny_vlms.prepared(encoder, prompt, [data], 1000, "key-a")
    assert encoder.encodes == 1 and again_ids == ids and again.images[0].digest == media.images[0].digest
    assert np.array_equal(again.images[0].features, media.images[0].features)
    assert np.array_equal(again.mrope, media.mrope) and again.rope_delta == media.rope_delta
    other_ids, other = tiny_vlms.prepared(encoder, prompt, [data], LIMIT, "key-b")
    assert encoder.encodes == 2 and other_ids == ids
    assert np.array_equal(other.images[0].features, media.images[0].features)
    recompressed = io.BytesIO()
    tiny_vlms.image().save(recompressed, "PNG", compress_level=1)
    assert recompressed.getvalue() != data
    _, copy = tiny_vlms.prepared(encoder, prompt, [recompressed.getvalue()], LIMIT, "key-a")
    assert encoder.encodes == 3 and copy.images[0].digest == media.images[0].digest
    assert encoder.stats() == {
        "image_encodes": 3,
        "image_cache_hits": 1,  # the refusal never looked: its header failed first
        "image_cache_misses": 3,
        "image_cache_bytes": 3 * (media.images[0].features.nbytes + OVERHEAD),
    }


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_a_sideways_photo_is_read_upright(qwen, fmt: str):
    """A phone's portrait photo is stored landscape with EXIF orientation 6: its token count, settled from the
    header before any decode, is the upright picture's, and the features are the upright picture's (the same
    digest as the picture stored upright without EXIF)."""
    from PIL import Image

    _, out, manifest, _ = qwen
    encoder = VisionEncoder(out, manifest, EngineConfig(precision="f32", image_cache_bytes=0))
    rng = np.random.default_rng(11)
    upright = Image.fromarray(rng.integers(0, 256, (90, 30, 3), dtype=np.uint8), "RGB")  # 30 wide, 90 tall
    stored = upright.transpose(Image.Transpose.ROTATE_90)  # 90 wide, 30 tall, as the camera wrote it
    exif = Image.Exif()
    exif[0x0112] = 6
    sideways, plain = io.BytesIO(), io.BytesIO()
    lossless = {"JPEG": {"quality": 100}, "PNG": {}, "WEBP": {"lossless": True}}[fmt]
    stored.save(sideways, fmt, exif=exif, **lossless)
    (
        upright if fmt != "JPEG" else Image.open(io.BytesIO(sideways.getvalue())).transpose(Image.Transpose.ROTATE_270)
    ).save(plain, "PNG")
    prompt = Tokenizer.from_dir(out).encode_chat([{"role": "user", "content": [{"type": "image"}]}])
    ids, media = tiny_vlms.prepared(encoder, prompt, [sideways.getvalue()], LIMIT)
    grid = scheme.grid(manifest.vision, 30, 90)
    assert (
        encoder.plans([sideways.getvalue()], LIMIT)[0].tokens
        == grid[0] * grid[1] * grid[2] // manifest.vision.merge_size**2
    )
    assert len(ids) == len(prompt) - 1 + encoder.plans([sideways.getvalue()], LIMIT)[0].tokens
    _, again = tiny_vlms.prepared(encoder, prompt, [plain.getvalue()], LIMIT)
    assert media.images[0].digest == again.images[0].digest
    assert np.array_equal(media.images[0].features, again.images[0].features)
