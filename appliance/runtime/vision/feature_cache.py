"""The vision feature cache: an image file seen before skips its decoding, preprocessing and vision encode.

The prefix cache (runtime/kv_cache.py) already skips a repeated picture's language-model prefill, but the picture
still had to be decoded and encoded to learn its digest and features: on Qwen2-VL-2B at 448 x 448 that encode was
most of a repeated request's time to the first token (repeat / first TTFT 0.71). Here an encoded image is kept under
a digest of the client's file bytes, so the same file again goes from its header checks (still run for every file:
format and pixel count, the refusals do not depend on what is cached) straight to its features.

Keyed by the file's bytes (BLAKE2b-256), not the pixels: the pixels are what decoding costs. A re-encoded copy of the
picture (another JPEG quality) misses here, is decoded, and still hits the prefix cache by its pixel digest.

Tenants: the same rule as the prefix cache's. A request's scope is its prefix-cache scope (SamplingParams
.cache_scope: its API key with `--prefix-cache-sharing keys`, "" when shared or unauthenticated), and each scope
is a cache of its own with its own byte budget and LRU order: one key never hits another's entry (a hit's speed
would tell it what the other sent), never sees its size, and never evicts it (its traffic cannot make another
key's repeats slow). The price is memory: at most `budget` bytes per scope, so the API keys in the key file + 1
times the budget in all. A shared budget split among scopes would bound the total instead, but then one key's
images evict another's; the per-scope budget keeps the tenant rule without exceptions, and the number of keys is
the operator's. What a scope holds: Qwen2-VL-2B at 448 x 448 is 256 rows x 1536 x 4 bytes = 1.5 MiB a picture,
SmolVLM-256M's two 512-pixel tiles 0.3 MiB; an entry over the budget is not kept. Budget 0 turns the cache off.

Thread-safe: the engine process's job threads prepare requests concurrently; one lock guards the tables (a lookup
or an insert is a dict operation, never an encode). Two requests with the same new file at once both encode it
(the second insert replaces the first, equal, entry): the cache skips repeats, it does not queue concurrent ones.
Entries are read-only arrays, shared by every request that hits them (Media never writes its features).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

OVERHEAD = 256  # bytes counted per entry beyond its features: the key, the record, the table's slot


def file_key(data: bytes) -> bytes:
    """The cache key of an image file: BLAKE2b-256 of its bytes (collision-resistant: a crafted file cannot take
    another file's entry)."""
    return hashlib.blake2b(data, digest_size=32).digest()


@dataclass(frozen=True)
class Encoded:
    """One image as prepare needs it after the header checks: its pixel digest (the prefix cache's key), its
    feature rows (read-only) and the layout the features were made for (Qwen2-VL's grid (t, h, w), Idefics3's
    (rows, cols)), which prepare checks against the layout the header implies."""

    digest: bytes
    features: np.ndarray = field(repr=False)
    layout: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.features.nbytes + OVERHEAD


class FeatureCache:
    """scope -> an LRU of file key -> Encoded, each scope at most `budget` bytes."""

    def __init__(self, budget: int):
        self.budget = budget
        self._scopes: dict[str, OrderedDict[bytes, Encoded]] = {}
        self._bytes: dict[str, int] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, scope: str, key: bytes) -> Encoded | None:
        """The entry of `key` in `scope` (now its most recently used), or None."""
        if self.budget <= 0:
            return None
        with self._lock:
            entries = self._scopes.get(scope)
            entry = entries.get(key) if entries is not None else None
            if entry is None:
                self.misses += 1
                return None
            entries.move_to_end(key)  # type: ignore[union-attr]
            self.hits += 1
            return entry

    def put(self, scope: str, key: bytes, entry: Encoded) -> None:
        """Keeps `entry` in `scope`, evicting that scope's least recently used entries past the budget; an entry
        larger than the budget is not kept."""
        if entry.nbytes > self.budget:
            return
        entry.features.setflags(write=False)
        with self._lock:
            entries = self._scopes.setdefault(scope, OrderedDict())
            old = entries.pop(key, None)
            used = self._bytes.get(scope, 0) - (old.nbytes if old is not None else 0) + entry.nbytes
            entries[key] = entry
            while used > self.budget:
                _, evicted = entries.popitem(last=False)
                used -= evicted.nbytes
            self._bytes[scope] = used

    def scope_bytes(self, scope: str) -> int:
        """Bytes `scope` holds (entries' features + OVERHEAD each)."""
        with self._lock:
            return self._bytes.get(scope, 0)

    def stats(self) -> dict[str, int]:
        """hits, misses and bytes held over every scope (Engine.stats(), /metrics: totals, no scope named)."""
        with self._lock:
            return {
                "image_cache_hits": self.hits,
                "image_cache_misses": self.misses,
                "image_cache_bytes": sum(self._bytes.values()),
            }
