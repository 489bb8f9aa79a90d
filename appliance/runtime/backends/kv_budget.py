"""How many KV blocks the paged pool gets: an explicit budget (bytes or tokens) or, by default, one derived
from the memory that is free once the model is loaded.

Only the backend knows the bytes per block (KV precision, the device's layout, a u8 key cache's scale rows),
so it calls `pool_blocks` after compiling the model. Static-shape backends (NPU, ONNX Runtime) do not use a
budget: their KV is `static_batch` slots x `static_context` positions.
"""

from __future__ import annotations

import logging

from appliance.host import meminfo_bytes

log = logging.getLogger(__name__)

# The auto budget: AUTO_FRACTION of MemAvailable, measured after the weights are compiled (so they are already
# out of it). A quarter, because an edge box runs other software too, MemAvailable still counts reclaimable page
# cache (mmapped weight files among it), and the OS and the HTTP workers need room to grow. Pages are mapped as
# blocks are first used, so an idle server does not hold the whole budget. Never more than
# max_num_seqs full-context sequences can use, never less than AUTO_FLOOR (or the ceiling, if smaller).
AUTO_FRACTION = 0.25
AUTO_FLOOR = 256 << 20


def auto_kv_bytes(ceiling: int, available: int | None) -> int:
    """AUTO_FRACTION x available, clamped to [min(AUTO_FLOOR, ceiling), ceiling]; the floor when unknown."""
    floor = min(AUTO_FLOOR, ceiling)
    return floor if available is None else max(floor, min(ceiling, int(AUTO_FRACTION * available)))


def pool_blocks(config, block_size: int, bytes_per_block: int, max_context: int) -> int:
    """Blocks for the pool: config.kv_cache_bytes if set, else config.kv_cache_tokens, else the auto budget
    (capped at what config.max_num_seqs sequences of max_context tokens could ever hold)."""
    if config.kv_cache_bytes is not None:
        if config.kv_cache_bytes < bytes_per_block:
            raise ValueError(
                f"the KV cache budget ({config.kv_cache_bytes} bytes) is smaller than one block "
                f"({bytes_per_block} bytes, {block_size} tokens)"
            )
        return config.kv_cache_bytes // bytes_per_block
    if config.kv_cache_tokens is not None:
        return max(1, -(-config.kv_cache_tokens // block_size))
    ceiling = config.max_num_seqs * -(-max_context // block_size) * bytes_per_block
    available = meminfo_bytes("MemAvailable")
    budget = auto_kv_bytes(ceiling, available)
    log.info(
        "KV cache size auto: %.0f MB (%.0f%% of %s MB available, clamped to [%.0f, %.0f] MB; the ceiling is "
        "%d sequences x %d tokens)",
        budget / 2**20,
        AUTO_FRACTION * 100,
        "unknown" if available is None else f"{available / 2**20:.0f}",
        min(AUTO_FLOOR, ceiling) / 2**20,
        ceiling / 2**20,
        config.max_num_seqs,
        max_context,
    )
    return max(1, budget // bytes_per_block)
