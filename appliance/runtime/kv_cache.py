"""KV block pool: the runtime's bookkeeping of the cache memory a backend allocated once at load.

Sequences own lists of block ids (their block table). Blocks are reference counted so one block can serve
several sequences (a shared prompt prefix, n > 1, beam search) without copying it.

Prefix caching: a full block is named by a hash chained over all tokens up to its end. When its last owner
lets go, the block keeps its contents and its name while it waits in the free list (least recently freed
is reused first), so a later prompt that starts with the same tokens picks it up instead of recomputing it.
A static-shape backend is the special case of one block per sequence, block_size = the slot length, and no
prefix caching.

The name must be collision-resistant: a reused block is checked against its own tokens only, so two different
prefixes with one name would hand one user KV computed in another user's context (vLLM's CVE-2025-25183, with
Python's unsalted 64-bit hash()). It is a keyed BLAKE2b (16 bytes) over the parent's name and the block's token
ids, keyed with a per-process random salt (a fresh one per BlockPool), so nobody can search for a collision
offline. Cost: about 1.5 us per full block (timeit, 16 or 32 tokens, on the 2-core dev box; hash() was 0.15 us),
once per block a prompt fills or looks up, never per token.

Tenants: a hit is visible (`usage.prompt_tokens_details.cached_tokens`, and the time to the first token), so a
cache shared by several API keys tells one key, block by block, what another key sent (a guessed document: 96 of
its 104 tokens "cached"). So a request carries a namespace (`SamplingParams.cache_scope`: the id of its API key,
unless the operator chose `--prefix-cache-sharing shared`), and the chain of its blocks starts from that
namespace's root, a keyed hash of the scope instead of the all-zero parent: two scopes never name a block alike,
so a prompt finds only its own scope's blocks. The shared namespace ("") keeps the all-zero root.

Disk tier (kv_disk.py, optional): every block `register` names is also handed to the tier (its bytes copied out
of the backend now, written by the tier's thread), and a match that misses RAM asks the tier, which fills a free
RAM block with the stored bytes (the block is then named and taken like a RAM hit); `prefetch`, at submission,
has the tier read those blocks on its own thread first, so the engine thread only copies them in. The salt then
comes from the tier's directory, so names match across restarts of the same export.

A vision-language prompt's image tokens are hashed as keys of the picture (Sequence.cache_tokens, runtime/media.py):
every caller hands these functions the keyed tokens, so the same picture names the same blocks, in RAM and on disk,
and another picture behind the same placeholder ids never does.

A prompt's chain is hashed once: `prefetch` returns the names it computed (a `BlockChain`, carried on the
Sequence), and `match_prefix` at admission takes them instead of hashing the blocks again (1.5 us a block, on the
engine thread). A chain is reused only in the pool and namespace it was computed in; past its end (a preempted
sequence's generated tokens) or without one (no disk tier: prefetch did nothing) the match hashes as it goes,
and stops hashing at its first miss.
"""

from __future__ import annotations

import hashlib
import os
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from appliance.runtime.kv_disk import DiskTier

DIGEST_SIZE = 16  # bytes of a block name
_ROOT = bytes(DIGEST_SIZE)  # the parent of a prompt's first block


def chain_hash(salt: bytes, parent: bytes | None, tokens: tuple[int, ...]) -> bytes:
    """The name of a full block: keyed BLAKE2b over the parent block's name (fixed length) and the tokens as int64."""
    data = (parent or _ROOT) + array("q", tokens).tobytes()
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE, key=salt).digest()


@dataclass(frozen=True)
class BlockChain:
    """The names of the first full blocks of one prompt, in the namespace `scope` of the pool salted `salt`: what
    `prefetch` computed at submission, for `match_prefix` at admission. Valid for that prompt only (a Sequence
    carries its own; its prompt tokens never change)."""

    salt: bytes
    scope: str
    names: list[bytes]


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False, salt: bytes | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._key: list[tuple[bytes, tuple[int, ...]] | None] = [None] * num_blocks  # (name, tokens) of a full block
        self._by_hash: dict[bytes, int] = {}
        # per process and pool (or the disk tier's, kept secret on disk): names cannot be precomputed elsewhere
        self.salt = salt or os.urandom(DIGEST_SIZE)
        self.disk: DiskTier | None = None
        self._read_block: Callable[[int], bytes] | None = None
        self._write_block: Callable[[int, bytes], None] | None = None
        self.hits = 0  # prompt tokens served from the cache
        self.queries = 0  # prompt tokens looked up

    def attach_disk(
        self, disk: DiskTier, read_block: Callable[[int], bytes], write_block: Callable[[int, bytes], None]
    ) -> None:
        """Spill named blocks to `disk` and load misses from it; read_block / write_block move one block's KV
        bytes out of / into the backend."""
        self.disk, self._read_block, self._write_block = disk, read_block, write_block

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
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._forget(block)
            self._refs[block] = 1
            out.append(block)
        return out

    def fork(self, blocks: list[int]) -> None:
        for b in blocks:
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in reversed(blocks):  # a sequence's tail blocks are the least likely to be shared: reuse first
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None
            elif self._refs[b] < 0:
                raise RuntimeError(f"block {b} freed twice")

    # ---- prefix caching ----
    def root(self, scope: str) -> bytes | None:
        """The parent of the first block of a prompt in namespace `scope` (None: the shared namespace, "")."""
        if not scope:
            return None
        return hashlib.blake2b(b"scope\0" + scope.encode(), digest_size=DIGEST_SIZE, key=self.salt).digest()

    def match_prefix(
        self, tokens: Sequence[int], scope: str = "", chain: BlockChain | None = None
    ) -> tuple[list[int], list[bytes]]:
        """Cached blocks for the longest run of full blocks at the start of `tokens` in namespace `scope`, taken
        (ref + 1), and their chained hashes. At least one token is left to compute: its logits give the first
        sample. `chain`: the names `prefetch` computed for these tokens, reused when they are this pool's and
        namespace's (the rest are hashed here)."""
        if not self.prefix_caching:
            return [], []
        bs, blocks, hashes, parent = self.block_size, [], [], self.root(scope)
        known = chain.names if chain is not None and chain.salt == self.salt and chain.scope == scope else []
        self.queries += len(tokens)
        for j, start in enumerate(range(0, len(tokens) - 1 - bs + 1, bs)):
            key = tuple(tokens[start : start + bs])
            h = known[j] if j < len(known) else chain_hash(self.salt, parent, key)
            block = self._by_hash.get(h)
            if block is None or self._key[block] != (h, key):
                block = self._from_disk(h, key)
                if block is None:
                    break
            else:
                if self._refs[block] == 0:
                    del self._free[block]
                self._refs[block] += 1
            blocks.append(block)
            hashes.append(h)
            parent = h
        self.hits += len(blocks) * bs
        return blocks, hashes

    def prefetch(self, tokens: Sequence[int], scope: str = "") -> BlockChain | None:
        """Any thread, at submission: have the disk tier read ahead the blocks match_prefix will want from it
        (the full blocks after the run RAM holds now), so the engine thread only copies them in at admission.
        A hint: RAM's index is read without the engine thread's cooperation, and a miss still loads. Returns the
        names it computed, for the admission's match_prefix (None: no disk tier, nothing computed)."""
        if self.disk is None or not self.prefix_caching:
            return None
        bs, parent = self.block_size, self.root(scope)
        names: list[bytes] = []
        wanted: list[tuple[bytes, tuple[int, ...]]] = []
        for start in range(0, len(tokens) - 1 - bs + 1, bs):
            key = tuple(tokens[start : start + bs])
            h = chain_hash(self.salt, parent, key)
            if wanted or self._by_hash.get(h) is None:
                wanted.append((h, key))
            names.append(h)
            parent = h
        self.disk.prefetch(wanted)
        return BlockChain(self.salt, scope, names)

    def register(self, block: int, parent: bytes | None, tokens: tuple[int, ...]) -> bytes:
        """Name a block that just became full; returns its name (the parent of the next block; a prompt's first
        block has its namespace's `root`). Without prefix caching nothing is named: every block gets the same
        placeholder."""
        if not self.prefix_caching:
            return _ROOT
        h = chain_hash(self.salt, parent, tokens)
        if h not in self._by_hash:
            self._forget(block)
            self._key[block] = (h, tokens)
            self._by_hash[h] = block
            if self.disk is not None and self._read_block is not None and not self.disk.has(h):
                t0 = time.perf_counter()
                self.disk.save(h, tokens, self._read_block(block))
                self.disk.counters["kv_disk_copy_seconds"] += time.perf_counter() - t0
        return h

    def _from_disk(self, name: bytes, tokens: tuple[int, ...]) -> int | None:
        """A block missing from RAM loaded from the disk tier into a free block, named and taken (ref 1); None
        if the tier does not have it (or its file was corrupt) or no block is free."""
        if self.disk is None or self._write_block is None or not self._free:
            return None
        payload = self.disk.load(name, tokens)
        if payload is None:
            return None
        block = self.allocate(1)[0]
        try:
            self._write_block(block, payload)
        except (ValueError, OSError):  # a payload of another length: recompute instead
            self.free([block])
            return None
        self._key[block] = (name, tokens)
        self._by_hash[name] = block
        return block

    def _forget(self, block: int) -> None:
        key = self._key[block]
        if key is not None:
            if self._by_hash.get(key[0]) == block:
                del self._by_hash[key[0]]
            self._key[block] = None
