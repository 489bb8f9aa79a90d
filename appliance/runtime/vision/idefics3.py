"""Idefics3's image scheme (also SmolVLM's layout) in numpy, from the manifest's `Vision` record alone (its docstring
has the rules): what transformers' Idefics3ImageProcessor and Idefics3Processor compute, so pixel values and the
prompt's ids equal theirs (tests/runtime/test_vision_idefics3.py checks them in f32).

An image is resized (PIL, the manifest's filter) to a longest edge of resize_longest_edge, then up to whole tiles,
cut into tile_size squares, and followed by the whole image resized to one tile (the global tile); each tile gives
tokens_per_tile prompt tokens, written between wrap tokens with its row and column. Transformers converts to RGB
after resizing, compositing transparency onto white: an RGBA picture is resized as RGBA and composited per tile,
as there. (A grey or palette file is converted to RGB first: transformers resizes those as palette indices with
nearest-neighbour, a quirk not copied.) Every tile is a full tile_size square, so the patch mask is all ones and
the patch positions are the same for every tile (`patch_positions`).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from PIL import Image

from appliance.manifest import Vision
from appliance.runtime.vision.decode import normalized

MAX_SIDE = 4096  # transformers' cap on the resized longest edge


def resized_size(vision: Vision, width: int, height: int) -> tuple[int, int]:
    """(height, width) after the longest-edge resize (transformers' get_resize_output_image_size: the short side
    truncated, then made even)."""
    assert vision.resize_longest_edge is not None
    longest, aspect = vision.resize_longest_edge, width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_SIDE:
        width, height = MAX_SIDE, int(MAX_SIDE / aspect)
    elif height > width and height > MAX_SIDE:
        height, width = MAX_SIDE, int(MAX_SIDE * aspect)
    return max(height, 1), max(width, 1)


def tiled_size(vision: Vision, height: int, width: int) -> tuple[int, int]:
    """(height, width) rounded up to whole tiles, the aspect ratio kept as transformers' resize_for_vision_encoder."""
    assert vision.tile_size is not None
    tile, aspect = vision.tile_size, width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def layout(vision: Vision, width: int, height: int) -> tuple[int, int]:
    """(rows, cols) of tiles of an image of width x height pixels; (0, 0): the global tile alone."""
    assert vision.tile_size is not None
    if not vision.image_splitting:
        return 0, 0
    h, w = tiled_size(vision, *resized_size(vision, width, height))
    if h > vision.tile_size or w > vision.tile_size:
        return h // vision.tile_size, w // vision.tile_size
    return 0, 0


def num_tokens(vision: Vision, width: int, height: int) -> int:
    assert vision.tokens_per_tile is not None
    rows, cols = layout(vision, width, height)
    return (rows * cols + 1) * vision.tokens_per_tile


def pixel_values(vision: Vision, image: Image.Image) -> tuple[np.ndarray, tuple[int, int]]:
    """The vision part's pixel_values for one decoded image (RGB or RGBA): float32 [tiles, 3, tile, tile], the
    tiles row by row then the global tile, and the (rows, cols) of the split."""
    assert vision.tile_size is not None
    tile, resample = vision.tile_size, vision.resample
    height, width = resized_size(vision, image.width, image.height)
    image = image.resize((width, height), resample=resample)
    if not vision.image_splitting:
        tiles, rows, cols = [image.resize((tile, tile), resample=resample)], 0, 0
    else:
        height, width = tiled_size(vision, height, width)
        image = image.resize((width, height), resample=resample)
        rows, cols = (height // tile, width // tile) if height > tile or width > tile else (0, 0)
        tiles = [
            image.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile)) for r in range(rows) for c in range(cols)
        ]
        tiles.append(image if (rows, cols) == (0, 0) else image.resize((tile, tile), resample=resample))
    return np.stack([normalized(vision, _rgb(t)) for t in tiles]), (rows, cols)


@lru_cache(maxsize=8)
def patch_positions(side: int) -> np.ndarray:
    """int64 [side * side]: a full tile's patch_position_ids, bucket(i / side * (1 - 1e-6)) * side + bucket(j ...)
    in f32 as Idefics3VisionEmbeddings computes them (every patch valid)."""
    boundaries = np.arange(1, side, dtype=np.float32) / np.float32(side)
    fractions = (np.arange(side, dtype=np.float32) / np.float32(side) * np.float32(1 - 1e-6)).astype(np.float32)
    buckets = np.searchsorted(boundaries, fractions, side="right")
    return (buckets[:, None] * side + buckets[None, :]).reshape(-1).astype(np.int64)


def image_text(vision: Vision, rows: int, cols: int) -> str:
    """The prompt text one `<image>` becomes: per tile `W<row_r_col_c>T`, a newline after each row, then `\\nWGTW`
    (unsplit: `WGTW`), with W the wrap token, G the global token and T tokens_per_tile image tokens."""
    wrap, glob = vision.image_wrap_token, vision.global_image_token
    tokens = "<image>" * (vision.tokens_per_tile or 0)
    if rows == cols == 0:
        return f"{wrap}{glob}{tokens}{wrap}"
    grid = "".join(
        "".join(f"{wrap}<row_{r}_col_{c}>{tokens}" for c in range(1, cols + 1)) + "\n" for r in range(1, rows + 1)
    )
    return f"{grid}\n{wrap}{glob}{tokens}{wrap}"


def _rgb(tile: Image.Image) -> Image.Image:
    """RGB as transformers' Idefics3 convert_to_rgb: transparency composited onto white."""
    if tile.mode == "RGB":
        return tile
    white = Image.new("RGBA", tile.size, (255, 255, 255))
    return Image.alpha_composite(white, tile.convert("RGBA")).convert("RGB")
