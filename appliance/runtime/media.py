"""A prompt's images as the engine sees them: feature rows that replace placeholder tokens, and the positions they
imply. The vision side (runtime/vision/) builds a `Media` off the engine thread; a Sequence carries it until it
ends, so a preempted or chunked prefill feeds the same rows again without re-encoding the image.

Data only, no OpenVINO: the scheduler and the backends read it. Three questions it answers:
- which rows a forward over prompt positions [begin, end) takes instead of token embeddings (`rows`);
- the M-RoPE position ids of positions [begin, end) (Qwen2-VL: 3-D, `position_ids`), or None for 1-D positions;
- what the prefix cache hashes for positions [begin, end) (`key_tokens`): an image's placeholder tokens are the same
  ids for every picture, so each is replaced by a key derived from the picture's pixel digest and the token's index
  in the image. The same picture again hashes to the same block names (a hit, in RAM and in the disk tier); a
  different one never does. Keys are negative, so they never equal a real token id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

KEY_BITS = 62  # a key is -1 - ((digest's first 8 bytes + index) mod 2**62): negative, and fits an int64


@dataclass(frozen=True)
class ImageSpan:
    """One image in a prompt: `length` placeholder tokens from prompt index `start`, replaced by `features`."""

    start: int
    length: int
    digest: bytes  # BLAKE2b of the decoded pixels (mode, size, RGB bytes), never of the file: a re-encode still hits
    features: np.ndarray = field(repr=False)  # float32 [length, hidden]

    def __post_init__(self) -> None:
        if self.features.shape[0] != self.length:
            raise ValueError(f"an image of {self.length} tokens has {self.features.shape[0]} feature rows")

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class Media:
    """The images of one prompt, in prompt order and not overlapping, and its positions when they are 3-D."""

    images: tuple[ImageSpan, ...]
    prompt_len: int
    # M-RoPE (qwen2_vl): int64 [3, prompt_len], the prompt's (temporal, height, width) positions; a position past the
    # prompt (generated or draft tokens) is index + rope_delta on all three axes. None: 1-D positions (the index).
    mrope: np.ndarray | None = field(default=None, repr=False)
    rope_delta: int = 0

    def __post_init__(self) -> None:
        end = 0
        for image in self.images:
            if image.start < end or image.end > self.prompt_len:
                raise ValueError("images must be in prompt order, inside the prompt, and not overlap")
            end = image.end
        if self.mrope is not None and self.mrope.shape != (3, self.prompt_len):
            raise ValueError(f"M-RoPE positions must be [3, {self.prompt_len}], got {list(self.mrope.shape)}")

    @property
    def num_image_tokens(self) -> int:
        return sum(image.length for image in self.images)

    def rows(self, begin: int, end: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The image rows of positions [begin, end): (offsets from begin, int64 [k]; rows, float32 [k, hidden]),
        or None when no image token is in the range."""
        offsets, rows = [], []
        for image in self.images:
            lo, hi = max(begin, image.start), min(end, image.end)
            if lo < hi:
                offsets.append(np.arange(lo - begin, hi - begin, dtype=np.int64))
                rows.append(image.features[lo - image.start : hi - image.start])
        if not rows:
            return None
        return np.concatenate(offsets), np.concatenate(rows).astype(np.float32, copy=False)

    def position_ids(self, begin: int, end: int) -> np.ndarray | None:
        """M-RoPE position ids of positions [begin, end) as int64 [3, end - begin]; None for 1-D positions."""
        if self.mrope is None:
            return None
        inside = min(end, self.prompt_len)
        head = self.mrope[:, begin:inside] if begin < inside else np.empty((3, 0), np.int64)
        tail = np.arange(max(begin, self.prompt_len), end, dtype=np.int64) + self.rope_delta
        return np.concatenate([head, np.broadcast_to(tail, (3, tail.size))], axis=1)

    def key_tokens(self, tokens: Sequence[int], begin: int) -> tuple[int, ...]:
        """`tokens` (the ids of positions begin, begin + 1, ...) with each image token replaced by its key: what
        the prefix cache hashes instead of the ids."""
        keys = list(tokens)
        end = begin + len(keys)
        for image in self.images:
            lo, hi = max(begin, image.start), min(end, image.end)
            if lo < hi:
                base = int.from_bytes(image.digest[:8], "little")
                mask = (1 << KEY_BITS) - 1
                for pos in range(lo, hi):
                    keys[pos - begin] = -1 - ((base + pos - image.start) & mask)
        return tuple(keys)
