"""KV block pool: the runtime's bookkeeping of the cache memory a backend allocated once at load.

Sequences own lists of block ids (their block table). Blocks are reference counted so that later features
(prefix sharing, n > 1 copy-on-write) can hand one block to several sequences without copying it.
A static-shape backend is the special case of one block per sequence, block_size = the slot length.
"""
from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"KV pool exhausted: need {n} blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def fork(self, blocks: list[int]) -> None:
        for b in blocks:
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
            elif self._refs[b] < 0:
                raise RuntimeError(f"block {b} freed twice")
