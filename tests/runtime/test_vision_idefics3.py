"""Idefics3's image path (appliance/runtime/vision: idefics3.py, encoder.py) on the tiny random model's fp32 export,
against transformers in f32: pixel values (Idefics3ImageProcessor: tiles + global tile), image features (the model's
vision encoder and connector) and the prompt ids (Idefics3Processor's input_ids for the same chat)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from appliance.config import EngineConfig
from appliance.manifest import Manifest
from appliance.runtime.tokenizer import Tokenizer
from appliance.runtime.vision import idefics3 as scheme
from appliance.runtime.vision.decode import decode
from appliance.runtime.vision.encoder import VisionEncoder
from appliance.runtime.vision.errors import ImageRejected
from tests import tiny_vlms

PIXEL_ATOL = 1e-5
FEATURE_ATOL = 1e-4
LIMIT = 16_777_216


def _png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def _images() -> list:
    """A wide non-square image (tiny_vlms.IMAGE_SIZE), a tall one, a small one (scaled up) and one with
    transparency (composited onto white after resizing, as transformers does)."""
    from PIL import Image

    rng = np.random.default_rng(11)
    tall = Image.fromarray(rng.integers(0, 256, (90, 30, 3), dtype=np.uint8), "RGB")
    small = Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8), "RGB")
    clear = Image.fromarray(rng.integers(0, 256, (50, 70, 4), dtype=np.uint8), "RGBA")
    return [tiny_vlms.image(), tall, small, clear]


@pytest.fixture(scope="module")
def idefics(vlm_export) -> tuple[Path, Path, Manifest, VisionEncoder]:
    src, out, manifest = vlm_export("idefics3")
    return src, out, manifest, VisionEncoder(out, manifest, EngineConfig(precision="f32"))


def _messages() -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Which is wider?"}],
        },
        {"role": "assistant", "content": "The first."},
        {"role": "user", "content": [{"type": "text", "text": "And these?"}, {"type": "image"}, {"type": "image"}]},
    ]


def test_pixel_values_equal_the_image_processor(idefics):
    from transformers import AutoProcessor

    src, _, manifest, _ = idefics
    processor = AutoProcessor.from_pretrained(src).image_processor
    for image in _images():
        expected = processor([[image]], return_tensors="np", return_row_col_info=True)
        pixels, (rows, cols) = scheme.pixel_values(manifest.vision, decode(_png(image), LIMIT).image)
        assert (rows, cols) == (expected["rows"][0][0], expected["cols"][0][0])
        assert (rows, cols) == scheme.layout(manifest.vision, image.width, image.height)
        assert pixels.shape == expected["pixel_values"][0].shape and pixels.dtype == np.float32
        assert np.abs(pixels - expected["pixel_values"][0]).max() < PIXEL_ATOL
        assert expected["pixel_attention_mask"].all()  # full tiles: the encoder's all-ones patch mask is theirs


def test_prepare_matches_the_processor_ids_and_the_model_features(idefics):
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    src, out, manifest, encoder = idefics
    vision = manifest.vision
    images = _images()
    prompt = Tokenizer.from_dir(out).encode_chat(_messages())  # the serving path: one <image> per image
    ids, media = tiny_vlms.prepared(encoder, prompt, [_png(image) for image in images], LIMIT)

    processor = AutoProcessor.from_pretrained(src)
    text = processor.apply_chat_template(_messages(), add_generation_prompt=True)
    inputs = processor(text=text, images=[images], return_tensors="pt")
    assert ids == inputs["input_ids"][0].tolist() and media.prompt_len == len(ids) and media.mrope is None

    model = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        features = model.model.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"]).numpy()
    assert len(media.images) == len(features)  # one span per tile, every image's tiles in prompt order
    for span, expected in zip(media.images, features):
        assert span.length == vision.tokens_per_tile and set(ids[span.start : span.end]) == {vision.image_token_id}
        assert np.abs(span.features - expected).max() < FEATURE_ATOL
    assert media.num_image_tokens == ids.count(vision.image_token_id)
    assert len({span.digest for span in media.images}) == len(media.images)  # tiles never share prefix-cache keys


def test_placeholders_must_match_the_images(idefics):
    _, out, _, encoder = idefics
    prompt = Tokenizer.from_dir(out).encode_chat(_messages())
    with pytest.raises(ImageRejected, match="3 image.* but its chat prompt has 4 image place"):
        tiny_vlms.prepared(encoder, prompt, [_png(tiny_vlms.image())] * 3, LIMIT)


def test_num_tokens_is_what_prepare_writes(idefics):
    _, out, _, encoder = idefics
    prompt = Tokenizer.from_dir(out).encode_chat([{"role": "user", "content": [{"type": "image"}]}])
    for image in _images():
        ids, _ = tiny_vlms.prepared(encoder, prompt, [_png(image)], LIMIT)
        assert len(ids) == len(prompt) - 1 + encoder.plans([_png(image)], LIMIT)[0].tokens


def test_a_repeated_file_is_encoded_once_and_tiled_alike(idefics):
    """The same file twice in one prompt (and again in the next request): one encode; every copy gets the same
    tile rows and the same per-tile digests, so the prefix cache keys the copies alike."""
    _, out, manifest, _ = idefics
    encoder = VisionEncoder(out, manifest, EngineConfig(precision="f32"))
    message = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Again:"}, {"type": "image"}]}
    prompt = Tokenizer.from_dir(out).encode_chat([message])
    wide = _png(_images()[1])  # split into tiles: several spans an image
    _, media = tiny_vlms.prepared(encoder, prompt, [wide, wide], LIMIT)
    tiles = len(media.images) // 2
    assert tiles > 1 and encoder.encodes == 1
    first, second = media.images[:tiles], media.images[tiles:]
    assert [s.digest for s in first] == [s.digest for s in second]
    assert all(np.array_equal(a.features, b.features) for a, b in zip(first, second))
    _, later = tiny_vlms.prepared(encoder, prompt, [wide, wide], LIMIT)
    assert encoder.encodes == 1 and [s.digest for s in later.images] == [s.digest for s in media.images]
