"""The vision feature cache alone (appliance/runtime/vision/feature_cache.py): a hit within a scope only, a byte
budget per scope with least-recently-used eviction inside that scope, entries read-only, 0 turning it off, and
its tables consistent under concurrent job threads. The encoder's use of it: tests/runtime/test_vision_qwen2_vl.py,
tests/runtime/test_vision_admission.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from appliance.runtime.vision.feature_cache import OVERHEAD, Encoded, FeatureCache, file_key

ROWS = 4  # an entry: ROWS x 8 float32 features
SIZE = ROWS * 8 * 4 + OVERHEAD


def _entry(seed: int) -> Encoded:
    features = np.random.default_rng(seed).standard_normal((ROWS, 8)).astype(np.float32)
    return Encoded(seed.to_bytes(16, "little"), features, (1, 2, 2))


def test_a_hit_is_the_same_entry_in_the_same_scope_only():
    cache = FeatureCache(10 * SIZE)
    key = file_key(b"file one")
    entry = _entry(1)
    assert cache.get("a", key) is None
    cache.put("a", key, entry)
    assert cache.get("a", key) is entry
    assert cache.get("b", key) is None and cache.get("", key) is None  # another key's scope, the shared one
    assert cache.get("a", file_key(b"file two")) is None
    assert cache.stats() == {"image_cache_hits": 1, "image_cache_misses": 4, "image_cache_bytes": SIZE}
    assert len(key) == 32


def test_each_scope_evicts_its_own_least_recently_used_entries_only():
    cache = FeatureCache(3 * SIZE)
    keys = [file_key(bytes([i])) for i in range(5)]
    for i in range(3):
        cache.put("a", keys[i], _entry(i))
        cache.put("b", keys[i], _entry(i))
    assert cache.get("a", keys[0]) is not None  # now a's most recently used: keys[1] is its oldest
    cache.put("a", keys[3], _entry(3))
    cache.put("a", keys[4], _entry(4))
    assert [cache.get("a", k) is not None for k in keys] == [True, False, False, True, True]
    assert [cache.get("b", k) is not None for k in keys] == [True, True, True, False, False]  # b untouched
    assert cache.scope_bytes("a") == cache.scope_bytes("b") == 3 * SIZE
    cache.put("a", keys[3], _entry(3))  # the same key again: replaced, not counted twice
    assert cache.scope_bytes("a") == 3 * SIZE


def test_an_entry_over_the_budget_is_not_kept_and_0_turns_the_cache_off():
    cache = FeatureCache(SIZE - 1)
    cache.put("a", file_key(b"x"), _entry(1))
    assert cache.get("a", file_key(b"x")) is None and cache.scope_bytes("a") == 0
    off = FeatureCache(0)
    off.put("a", file_key(b"x"), _entry(1))
    assert off.get("a", file_key(b"x")) is None
    assert off.stats() == {"image_cache_hits": 0, "image_cache_misses": 0, "image_cache_bytes": 0}


def test_kept_features_are_read_only():
    cache = FeatureCache(SIZE)
    entry = _entry(1)
    cache.put("a", file_key(b"x"), entry)
    with pytest.raises(ValueError, match="read-only"):
        entry.features[0, 0] = 1.0


def test_concurrent_threads_keep_the_tables_consistent():
    """8 threads insert and look up in 3 scopes at once: every hit is the entry put under that scope and key, and
    each scope's byte count is what its entries hold, within the budget."""
    cache = FeatureCache(5 * SIZE)
    entries = {(scope, i): _entry(i * 7 + len(scope)) for scope in ("a", "b", "c") for i in range(12)}
    wrong: list[tuple] = []
    start = threading.Barrier(8)

    def work(t: int) -> None:
        start.wait()
        for n in range(300):
            scope, i = "abc"[(t + n) % 3], (t * 5 + n) % 12
            key = file_key(f"{scope}{i}".encode())
            got = cache.get(scope, key)
            if got is None:
                cache.put(scope, key, entries[(scope, i)])
            elif got is not entries[(scope, i)]:
                wrong.append((scope, i))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []
    for scope in "abc":
        held = [i for i in range(12) if cache.get(scope, file_key(f"{scope}{i}".encode())) is not None]
        assert cache.scope_bytes(scope) == len(held) * SIZE <= 5 * SIZE
