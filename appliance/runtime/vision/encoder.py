"""The vision side of a VLM: a prompt's image files -> its expanded token ids and the `Media` the engine splices in
(runtime/media.py). Called from the engine process's job threads (server/admit.py), never the engine thread.

The cheap checks for every image come before the costly work for any, in two steps: `plans` reads each header once
(format, pixel count) into an ImagePlan, the layout and token count it implies, with which the engine's admission
fits the prompt to the context (server/prompts.py); `prepare` then checks the placeholders the chat template wrote
(one per image) and only then decodes each image, preprocesses it (qwen2_vl.py, idefics3.py) and runs it through the
exported vision parts, one image at a time, so a request holds one decoded picture at most. Both steps attribute
a refusal to its image in one place (errors.py's `each_image`). The parts run one encode at a time per model (a
lock): an encode uses every core it is given, so two at once only interleave, and the lock bounds the memory of the
activations to one image's. The parts are compiled once, with the engine's device and properties (its precision:
f32 under --precision f32, which the parity tests pin; else the device's default, bf16 on a bf16-capable CPU, as
openvino_genai's VLMPipeline compiles its vision parts with the properties it is given).

A file seen before in the request's prefix-cache scope skips decoding, preprocessing and the encode: the feature
cache (feature_cache.py) hands back its digest and features after its header checks (`plans` runs them for every
file, cached or not). `stats` counts the encodes run and the cache's hits.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from appliance.config import EngineConfig
from appliance.manifest import Manifest, Vision
from appliance.runtime.media import ImageSpan, Media
from appliance.runtime.vision import idefics3, qwen2_vl
from appliance.runtime.vision.decode import Decoded, decode, open_header, upright_size
from appliance.runtime.vision.errors import ImageRejected, each_image
from appliance.runtime.vision.feature_cache import Encoded, FeatureCache, file_key


@dataclass(frozen=True)
class ImagePlan:
    """One image file as the engine's admission read it from its header, once (nothing decoded): the layout its
    upright size gives (Qwen2-VL's grid (t, h, w), Idefics3's tiles (rows, cols)) and the prompt tokens it becomes,
    which fit the prompt to the context and then expand it (`prepare`) without reading the header again. No parser
    is kept open between the two: Pillow's WebP parser holds a copy of the file and allocates the picture's canvas
    when it opens, so one per image of a request would hold every image's pixels at once; decode() opens the file
    for its own decoding, one image at a time."""

    data: bytes  # the file
    layout: tuple[int, ...]
    tokens: int  # prompt tokens, its placeholder's included


class VisionEncoder:
    """One VLM's vision parts, compiled, and the rules that turn its images into prompt tokens and feature rows."""

    def __init__(self, model_dir: Path, manifest: Manifest, config: EngineConfig):
        from appliance.runtime.backends.openvino_common import compile_properties, core

        assert manifest.vision is not None, "a VLM's manifest"
        self.vision: Vision = manifest.vision
        self.hidden_size = manifest.hidden_size
        props = compile_properties(config, kv_precision=False)
        roles = ["vision_embeddings"] + (["vision_merger"] if self.vision.scheme == "qwen2_vl" else [])
        self._requests: dict[str, Any] = {}
        for role in roles:
            compiled = core().compile_model(str(Path(model_dir) / self.vision.parts[role]), config.device, props)
            self._requests[role] = compiled.create_infer_request()
        self._lock = threading.Lock()  # one encode at a time (the module docstring says why)
        self.encodes = 0  # images run through the vision parts (under the lock)
        self.cache = FeatureCache(config.image_cache_bytes)
        self._tile_ids: dict[tuple[int, int], list[int]] = {}
        self._tokenizer = None
        if self.vision.scheme == "idefics3":
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(Path(model_dir) / manifest.tokenizer_file))

    def plans(self, files: Sequence[bytes], max_pixels: int) -> list[ImagePlan]:
        """Each file's ImagePlan, from its header alone: every image checked (format, pixel count, Qwen2-VL's aspect
        ratio) before any is decoded; ImageRejected for the first that fails, naming which (`image`)."""
        return each_image(lambda data: self._plan(data, max_pixels), files)

    def prepare(
        self, prompt_ids: list[int], images: Sequence[ImagePlan], max_pixels: int, scope: str = ""
    ) -> tuple[list[int], Media]:
        """prompt_ids from the chat template (one placeholder per image, as the template writes it) -> the expanded
        ids (each image's N tokens, Idefics3's tile text) and the Media (features, digests, M-RoPE), the images
        encoded one at a time. ImageRejected for a file that cannot be decoded (naming which: `image`), or images
        that do not match the placeholders. `scope`: the request's prefix-cache scope (SamplingParams.cache_scope),
        the feature cache's namespace."""
        vision = self.vision
        if vision.scheme == "qwen2_vl":
            ids, starts = qwen2_vl.expand(vision, prompt_ids, [image.tokens for image in images])
        else:
            ids, starts = self._idefics3_text(prompt_ids, images)
        encoded = each_image(lambda image: self._encoded(image, max_pixels, scope), images)
        spans: list[ImageSpan] = []
        for image, start, features in zip(images, starts, encoded):
            assert features.layout == image.layout, "the layout from the header is the layout of the decoded picture"
            spans += self._spans(image, start, features)
        if vision.scheme == "qwen2_vl":
            grids = [(start, image.layout) for start, image in zip(starts, images)]
            positions, delta = qwen2_vl.mrope(len(ids), grids, vision.merge_size)  # type: ignore[arg-type]
            return ids, Media(tuple(spans), len(ids), positions, delta)
        return ids, Media(tuple(spans), len(ids))

    def stats(self) -> dict[str, int]:
        """Encodes run and the feature cache's hits, misses and bytes (Engine.stats())."""
        return {"image_encodes": self.encodes, **self.cache.stats()}

    def _plan(self, data: bytes, max_pixels: int) -> ImagePlan:
        with open_header(data, max_pixels) as header:
            width, height = upright_size(header)  # as decode() turns it: EXIF orientation
        if self.vision.scheme == "qwen2_vl":
            grid = qwen2_vl.grid(self.vision, width, height)
            return ImagePlan(data, grid, qwen2_vl.num_tokens(self.vision, grid))
        layout = idefics3.layout(self.vision, width, height)
        return ImagePlan(data, layout, len(self._tile_text(*layout)))

    def _idefics3_text(self, prompt_ids: list[int], images: Sequence[ImagePlan]) -> tuple[list[int], list[int]]:
        """The prompt with each image's placeholder replaced by its tile text, and where each tile text begins."""
        places = [i for i, token in enumerate(prompt_ids) if token == self.vision.image_token_id]
        if len(places) != len(images):
            raise ImageRejected.placeholders(len(images), len(places))
        ids: list[int] = []
        starts = []
        for token in prompt_ids:
            if token == self.vision.image_token_id:
                starts.append(len(ids))
                ids.extend(self._tile_text(*images[len(starts) - 1].layout))
            else:
                ids.append(token)
        return ids, starts

    def _spans(self, image: ImagePlan, start: int, encoded: Encoded) -> list[ImageSpan]:
        """The image's spans in the expanded prompt: Qwen2-VL's one run of tokens; Idefics3's one per tile (its
        tiles are not contiguous: row and wrap tokens between), each with its own digest."""
        if self.vision.scheme == "qwen2_vl":
            return [ImageSpan(start, len(encoded.features), encoded.digest, encoded.features)]
        text = self._tile_text(*image.layout)
        token = self.vision.image_token_id
        runs = [start + j for j, t in enumerate(text) if t == token and (j == 0 or text[j - 1] != t)]
        assert len(runs) == len(encoded.features), "one run of image tokens per tile"
        return [
            ImageSpan(run, len(rows), tile_digest(encoded.digest, k), rows)
            for k, (run, rows) in enumerate(zip(runs, encoded.features))
        ]

    def _encoded(self, image: ImagePlan, max_pixels: int, scope: str) -> Encoded:
        """One file's digest and features (and the layout they have): from the feature cache in `scope`, else
        decoded, preprocessed and encoded by the scheme's parts, and kept there."""
        key = file_key(image.data) if self.cache.budget > 0 else None
        cached = self.cache.get(scope, key) if key is not None else None
        if cached is not None:
            return cached
        decoded = decode(image.data, max_pixels)  # its own parse: the plan kept no parser (ImagePlan says why)
        featurize = self._qwen2_vl_features if self.vision.scheme == "qwen2_vl" else self._idefics3_features
        rows, layout = featurize(decoded)
        encoded = Encoded(decoded.digest, rows, layout)
        if key is not None:
            self.cache.put(scope, key, encoded)
        return encoded

    def _qwen2_vl_features(self, decoded: Decoded) -> tuple[np.ndarray, tuple[int, ...]]:
        pixels, grid_thw = qwen2_vl.pixel_values(self.vision, decoded.image)
        return self.encode_qwen2_vl(pixels, grid_thw), grid_thw

    def _idefics3_features(self, decoded: Decoded) -> tuple[np.ndarray, tuple[int, ...]]:
        pixels, rows_cols = idefics3.pixel_values(self.vision, decoded.image)
        return self.encode_idefics3(pixels), rows_cols

    def encode_qwen2_vl(self, pixels: np.ndarray, grid_thw: tuple[int, int, int]) -> np.ndarray:
        """float32 [tokens, hidden]: patch embeddings, then the vision transformer and 2x2 merger over one image
        (its attention mask all zeros: the patches of one image see each other)."""
        rotary = qwen2_vl.rotary_pos_emb(self.vision, grid_thw)
        with self._lock:
            self.encodes += 1
            patches = self._infer("vision_embeddings", {"hidden_states": pixels})
            n = len(patches)
            feed = {
                "hidden_states": patches,
                "attention_mask": np.zeros((1, n, n), np.float32),
                "rotary_pos_emb": rotary,
            }
            return self._infer("vision_merger", feed)

    def encode_idefics3(self, pixels: np.ndarray) -> np.ndarray:
        """float32 [tiles, tokens_per_tile, hidden] for one image's tiles (all full: the mask is all ones)."""
        assert self.vision.tile_size is not None
        side = self.vision.tile_size // self.vision.patch_size
        positions = idefics3.patch_positions(side)
        feed = {
            "pixel_values": pixels,
            "patch_attention_mask": np.ones((len(pixels), side, side), bool),
            "patch_position_ids": np.broadcast_to(positions, (len(pixels), side * side)).copy(),
        }
        with self._lock:
            self.encodes += 1
            return self._infer("vision_embeddings", feed)

    def _infer(self, role: str, feed: dict[str, np.ndarray]) -> np.ndarray:
        request = self._requests[role]
        request.infer(feed)
        return np.array(request.get_output_tensor(0).data, dtype=np.float32)  # a copy: the request's buffer is reused

    def _tile_text(self, rows: int, cols: int) -> list[int]:
        """The ids of the text one image becomes (idefics3.image_text), from the model's own tokenizer: the text
        begins and ends with the wrap token, a special token, so its ids are those it gets inside the prompt."""
        ids = self._tile_ids.get((rows, cols))
        if ids is None:
            assert self._tokenizer is not None
            text = idefics3.image_text(self.vision, rows, cols)
            ids = self._tokenizer.encode(text, add_special_tokens=False).ids
            expected = (rows * cols + 1) * (self.vision.tokens_per_tile or 0)
            if sum(1 for t in ids if t == self.vision.image_token_id) != expected:
                raise RuntimeError(f"the tokenizer does not spell the image text as {expected} image tokens")
            self._tile_ids[(rows, cols)] = ids
        return ids


def tile_digest(digest: bytes, tile: int) -> bytes:
    """Tile k's own digest: an Idefics3 image is one span per tile, and the prefix cache's key of a span's token j
    comes from its digest and j, so tiles must not share one."""
    return hashlib.blake2b(digest + tile.to_bytes(4, "little"), digest_size=16).digest()
