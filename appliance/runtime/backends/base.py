"""The one small interface every inference backend implements.

The runtime owns the KV memory layout decisions (block pool, block tables); a backend owns the device tensors
that hold the cache and runs the graph over a batch of sequences in one call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np


@dataclass
class StepBatch:
    """One forward call. Sequence i feeds `token_ids[i]` at positions `past_lens[i]...` using the KV blocks
    `block_tables[i]` (which must already cover past_lens[i] + len(token_ids[i]) positions)."""

    token_ids: list[list[int]]
    past_lens: list[int]
    block_tables: list[list[int]]
    # Optional, per sequence: also compute the logits at every fed position (prompt logprobs). `forward` then
    # fills `position_logits[i]` with float32 [len(token_ids[i]), vocab] for the flagged sequences (None for
    # the others); its return value is unchanged.
    all_logits: list[bool] | None = None
    position_logits: list[np.ndarray | None] | None = field(default=None, repr=False)
    # Optional, per sequence (None for a text sequence; the lists None when no sequence has any), a vision-language
    # model only: the image feature rows that replace the embeddings of some fed tokens, (offsets into
    # token_ids[i], int64 [k]; rows, float32 [k, hidden]) (runtime/media.py Media.rows), and the M-RoPE positions
    # of the fed tokens, int64 [3, len(token_ids[i])] (Media.position_ids). A text-only model never sees them.
    image_rows: list[tuple[np.ndarray, np.ndarray] | None] | None = field(default=None, repr=False)
    mrope_positions: list[np.ndarray | None] | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


class Backend(ABC):
    """Runs the model. `forward` returns float32 logits [num_seqs, vocab] for each sequence's last fed token; they
    may be a view of the device's output buffer, valid only until the next `forward` (the engine samples first)."""

    block_size: int  # KV positions per block
    num_blocks: int  # blocks in the pool the backend allocated once at load
    max_batch: int | None = None  # fixed number of sequences per call (static shapes), None if dynamic
    max_context: int  # longest sequence the KV layout can hold
    max_prompt: int | None = None  # longest prompt (static shapes: OVMS's max_prompt_len), None: max_context's
    kernels: str = "openvino"  # which kernels run the low-bit MatMuls: "openvino" or "appliance-<isa>[/one-token]"
    # Steps of at most this many tokens run compiled graphs of static shapes, one per count (row_graphs.py): the
    # number of tokens fed may change between such steps at no cost. 0: a change may make the graph re-plan.
    fixed_shapes: int = 0

    @abstractmethod
    def forward(self, batch: StepBatch) -> np.ndarray: ...

    def copy_blocks(self, pairs: list[tuple[int, int]], num_tokens: list[int] | None = None) -> None:
        """Copy the KV of block `src` into block `dst` for every (src, dst) pair (a beam fork's partly filled
        last block). `num_tokens[i]`: positions of pair i that hold KV (the rest need not be copied)."""
        raise NotImplementedError(f"{type(self).__name__} cannot copy KV blocks")

    # The KV layout a stored block's bytes depend on (element types, per-block shapes), or None: this backend's
    # blocks cannot be saved and restored (static shapes: NPU, ONNX Runtime), and the disk tier is off for it.
    kv_layout: str | None = None

    def read_block(self, block: int) -> bytes:
        """A copy of block `block`'s KV bytes, every layer (the disk tier, runtime/kv_disk.py)."""
        raise NotImplementedError(f"{type(self).__name__} cannot save KV blocks: not supported")

    def write_block(self, block: int, data: bytes) -> None:
        """Fill block `block` with bytes read_block returned (same kv_layout); ValueError on a wrong length."""
        raise NotImplementedError(f"{type(self).__name__} cannot restore KV blocks: not supported")

    def close(self) -> None:  # noqa: B027 (optional: a backend with nothing to release keeps this no-op)
        """Release device memory; the backend is unusable afterwards."""


class DeviceError(RuntimeError):
    """The requested device is missing or cannot run this model (clear message, no traceback for users)."""
