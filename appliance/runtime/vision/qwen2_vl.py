"""Qwen2-VL's image scheme in numpy, from the manifest's `Vision` record alone (its docstring has the rules): what
transformers' Qwen2VLImageProcessor, the vision tower's rotary table and Qwen2VLModel.get_rope_index compute, so
pixel values, features and positions equal theirs (tests/runtime/test_vision_qwen2_vl.py checks each in f32).

An image is resized (PIL, the manifest's filter) to a grid of patch_size patches whose sides are multiples of
merge_size; each patch (repeated temporal_patch_size times, an image being a one-frame video) becomes one row of
flattened pixels in 2x2-merge order; every merge_size**2 patches become one prompt token.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from appliance.manifest import Vision
from appliance.runtime.vision.decode import normalized
from appliance.runtime.vision.errors import ImageRejected

MAX_ASPECT = 200  # transformers refuses a more elongated image (smart_resize)


def smart_resize(vision: Vision, height: int, width: int) -> tuple[int, int]:
    """The resized (height, width): each side a multiple of patch_size * merge_size, the aspect ratio kept as far as
    that allows, the pixel count in [min_pixels, max_pixels] (transformers' smart_resize, same arithmetic)."""
    assert vision.min_pixels is not None and vision.max_pixels is not None
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ImageRejected(f"the image is {width} x {height} pixels: its aspect ratio must be at most {MAX_ASPECT}")
    factor = vision.patch_size * vision.merge_size
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > vision.max_pixels:
        beta = math.sqrt(height * width / vision.max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < vision.min_pixels:
        beta = math.sqrt(vision.min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def grid(vision: Vision, width: int, height: int) -> tuple[int, int, int]:
    """(t, h, w) in patches of an image of width x height pixels."""
    h, w = smart_resize(vision, height, width)
    return 1, h // vision.patch_size, w // vision.patch_size


def num_tokens(vision: Vision, grid_thw: tuple[int, int, int]) -> int:
    """The prompt tokens of an image of this grid: one per merge_size**2 patches."""
    t, h, w = grid_thw
    return t * h * w // vision.merge_size**2


def pixel_values(vision: Vision, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
    """The vision part's input for one decoded image (RGB or RGBA: alpha dropped, as transformers' convert("RGB")):
    float32 [patches, 3 * temporal_patch_size * patch_size**2] and its grid (t, h, w)."""
    assert vision.temporal_patch_size is not None
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    height, width = smart_resize(vision, rgb.height, rgb.width)
    chw = normalized(vision, rgb.resize((width, height), resample=vision.resample))
    p, m, tp = vision.patch_size, vision.merge_size, vision.temporal_patch_size
    gh, gw = height // p, width // p
    frames = np.repeat(chw[None], tp, axis=0)  # [tp, C, H, W]: an image is tp identical frames
    patches = frames.reshape(1, tp, 3, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(patches.reshape(gh * gw, 3 * tp * p * p)), (1, gh, gw)


def rotary_pos_emb(vision: Vision, grid_thw: tuple[int, int, int]) -> np.ndarray:
    """float32 [patches, rotary_dim]: per patch in 2x2-merge order, its row's angles then its column's, angle =
    pos * inv_freq with inv_freq = 1 / 10000 ** (2i / rotary_dim) in f32 (the vision tower's rot_pos_emb)."""
    assert vision.rotary_dim is not None
    t, h, w = grid_thw
    m = vision.merge_size
    rows = np.broadcast_to(np.arange(h)[:, None], (h, w)).reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3)
    cols = np.broadcast_to(np.arange(w)[None, :], (h, w)).reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3)
    dim = vision.rotary_dim
    inv_freq = (1.0 / (np.float32(10000.0) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))).astype(
        np.float32
    )
    table = np.arange(max(h, w), dtype=np.float32)[:, None] * inv_freq[None, :]  # [max side, dim / 2]
    emb = np.concatenate([table[rows.reshape(-1)], table[cols.reshape(-1)]], axis=1)
    return np.tile(emb, (t, 1)).astype(np.float32)


def expand(vision: Vision, prompt_ids: list[int], tokens: list[int]) -> tuple[list[int], list[int]]:
    """The prompt with its i-th image placeholder (the one image_token_id between image_start_token_id and
    image_end_token_id, as the chat template writes it) repeated tokens[i] times, and each image's first index."""
    out: list[int] = []
    starts: list[int] = []
    for i, token in enumerate(prompt_ids):
        if token == vision.image_token_id and _placeholder(vision, prompt_ids, i):
            if len(starts) == len(tokens):
                raise ImageRejected.placeholders(len(tokens), _count(vision, prompt_ids))
            starts.append(len(out))
            out.extend([token] * tokens[len(starts) - 1])
        else:
            out.append(token)
    if len(starts) != len(tokens):
        raise ImageRejected.placeholders(len(tokens), len(starts))
    return out, starts


def mrope(ids_len: int, spans: list[tuple[int, tuple[int, int, int]]], merge: int) -> tuple[np.ndarray, int]:
    """M-RoPE positions int64 [3, ids_len] and rope_delta, as get_rope_index: text advances all three axes by one;
    an image's tokens (start, grid) take start position + (t, row, col) over its merged grid; the text after it
    resumes at its largest position + 1. rope_delta = the largest position + 1 - ids_len."""
    positions = np.empty((3, ids_len), np.int64)
    index = next_pos = 0
    for start, (t, h, w) in spans:
        h, w = h // merge, w // merge
        positions[:, index:start] = np.arange(next_pos, next_pos + start - index)
        base = next_pos + start - index
        end = start + t * h * w
        positions[0, start:end] = base + np.repeat(np.arange(t), h * w)
        positions[1, start:end] = base + np.tile(np.repeat(np.arange(h), w), t)
        positions[2, start:end] = base + np.tile(np.arange(w), t * h)
        index, next_pos = end, base + max(t, h, w)
    positions[:, index:] = np.arange(next_pos, next_pos + ids_len - index)
    top = int(positions.max()) if ids_len else -1
    return positions, top + 1 - ids_len


def _placeholder(vision: Vision, ids: list[int], i: int) -> bool:
    return (
        0 < i < len(ids) - 1 and ids[i - 1] == vision.image_start_token_id and ids[i + 1] == vision.image_end_token_id
    )


def _count(vision: Vision, ids: list[int]) -> int:
    return sum(1 for i, t in enumerate(ids) if t == vision.image_token_id and _placeholder(vision, ids, i))
