"""The one small interface every inference backend implements.

The runtime owns the KV memory layout decisions (block pool, block tables); a backend owns the device tensors
that hold the cache and runs the graph over a batch of sequences in one call.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np


@dataclass
class StepBatch:
    """One forward call. Sequence i feeds `token_ids[i]` at positions `past_lens[i]...` using the KV blocks
    `block_tables[i]` (which must already cover past_lens[i] + len(token_ids[i]) positions)."""

    token_ids: list[list[int]]
    past_lens: list[int]
    block_tables: list[list[int]]

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


class Backend(ABC):
    """Runs the model. `forward` returns float32 logits [num_seqs, vocab] for each sequence's last fed token."""

    block_size: int      # KV positions per block
    num_blocks: int      # blocks in the pool the backend allocated once at load
    max_batch: int | None = None   # fixed number of sequences per call (static shapes), None if dynamic
    max_context: int     # longest sequence the KV layout can hold

    @abstractmethod
    def forward(self, batch: StepBatch) -> np.ndarray: ...

    def close(self) -> None:
        """Release device memory; the backend is unusable afterwards."""


class DeviceError(RuntimeError):
    """The requested device is missing or cannot run this model (clear message, no traceback for users)."""
