"""Static-shape KV: one fixed buffer slot per sequence, written in place by the runtime.

The graph is rewritten so its KV inputs are the whole slot buffers [slots, kv_heads, L, head_dim] (attention
masks out unused positions) and its KV outputs are only the new positions; we copy those few positions into
the slot. That is how an Intel NPU has to run (fixed shapes, no paged attention), and it lets ONNX Runtime run
without copying the whole past per token. The pool's "block" is a slot: block_size = L, one block per sequence.
Shapes: decode calls are [slots, 1]; prefill calls are [1, chunk] (padded when `pad_prefill`).
The KV budget (kv_cache_tokens / kv_cache_bytes) does not apply: the memory is static_batch x static_context
positions, fixed at load (an NPU compiles those shapes); `appliance serve` refuses --kv-cache-size here.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, cast

import numpy as np

from appliance.runtime.backends.base import Backend, StepBatch


class StaticSlotBackend(Backend):
    pad_prefill: bool = True  # fixed prefill shapes (NPU); ONNX Runtime runs any chunk length
    max_batch: int  # the slot count, always fixed here

    def _init_slots(
        self, num_layers: int, kv_heads: int, head_dim: int, dtype, slots: int, length: int, chunk: int
    ) -> None:
        self.num_blocks = self.max_batch = slots
        self.block_size = self.max_context = length
        self.chunk = chunk
        shape = (slots, kv_heads, length, head_dim)
        # keys[i] / values[i]: layer i's buffers, allocated once, zeroed so masked positions are finite.
        self.keys = [np.zeros(shape, dtype) for _ in range(num_layers)]
        self.values = [np.zeros(shape, dtype) for _ in range(num_layers)]
        self.cache_bytes = 2 * num_layers * self.keys[0].nbytes

    @abstractmethod
    def _run(self, kind: str, slot: int | None, input_ids, position_ids, attention_mask, last_index):
        """Run the prefill (slot given, batch 1) or decode (all slots) graph; returns (logits [B, V] of the
        row at `last_index` of the token dimension, new_keys list [B, kv, T, d], new_values list). A prefill
        may pass an int64 array of rows as `last_index` (prompt logprobs): logits are then [B, len, V]."""

    def forward(self, batch: StepBatch) -> np.ndarray:
        out: list[np.ndarray | None] = [None] * len(batch.token_ids)
        decode = [i for i, t in enumerate(batch.token_ids) if len(t) == 1]
        if decode:
            logits = self._decode(
                [batch.block_tables[i][0] for i in decode],
                [batch.token_ids[i][0] for i in decode],
                [batch.past_lens[i] for i in decode],
            )
            for row, i in enumerate(decode):
                out[i] = logits[row]
        flags = batch.all_logits if batch.all_logits is not None and any(batch.all_logits) else None
        positions: list[np.ndarray | None] = [None] * len(out)
        if flags is not None:
            batch.position_logits = positions
        for i, toks in enumerate(batch.token_ids):
            if len(toks) > 1:
                if flags is not None and flags[i]:
                    rows = self._prefill(batch.block_tables[i][0], toks, batch.past_lens[i], every=True)
                    positions[i] = rows
                    out[i] = rows[-1]
                else:
                    out[i] = self._prefill(batch.block_tables[i][0], toks, batch.past_lens[i])
            elif flags is not None and flags[i]:
                positions[i] = np.asarray(out[i], np.float32)[None]
        return np.stack(cast(list[np.ndarray], out)).astype(np.float32, copy=False)  # every row is set

    def copy_blocks(self, pairs: list[tuple[int, int]], num_tokens: list[int] | None = None) -> None:
        """A block is a slot: copy slot `src`'s first num_tokens positions (all if not given) into slot `dst`."""
        for i, (src, dst) in enumerate(pairs):
            n = self.block_size if num_tokens is None else num_tokens[i]
            for buf in self.keys + self.values:
                buf[dst, :, :n] = buf[src, :, :n]

    def _decode(self, slots: list[int], tokens: list[int], past: list[int]) -> np.ndarray:
        n, length = self.max_batch, self.block_size
        ids = np.zeros((n, 1), np.int64)
        pos = np.zeros((n, 1), np.int64)
        mask = np.zeros((n, length + 1), np.int64)
        mask[:, length] = 1
        s = np.asarray(slots)
        ids[s, 0] = tokens
        pos[s, 0] = past
        mask[:, :length] = np.arange(length)[None, :] < pos
        logits, new_k, new_v = self._run("decode", None, ids, pos, mask, 0)
        p = np.asarray(past)
        for buf, new in zip(self.keys + self.values, new_k + new_v):
            buf[s, :, p] = new[s, :, 0]
        return logits[s]

    def _prefill(self, slot: int, tokens: list[int], past: int, every: bool = False) -> np.ndarray:
        """Logits [V] of the last token; with `every`, [len(tokens), V] of every token."""
        length, rows = self.block_size, []
        logits: Any = None
        step = self.chunk if self.pad_prefill else len(tokens)
        for start in range(0, len(tokens), step):
            piece = tokens[start : start + step]
            n, width = len(piece), step if self.pad_prefill else len(piece)
            p0 = past + start
            ids = np.zeros((1, width), np.int64)
            ids[0, :n] = piece
            pos = np.full((1, width), p0, np.int64)  # padding gets a harmless in-range position
            pos[0, :n] = np.arange(p0, p0 + n)
            mask = np.zeros((1, length + width), np.int64)
            mask[0, :p0] = 1
            mask[0, length : length + n] = 1
            logits, new_k, new_v = self._run("prefill", slot, ids, pos, mask, np.arange(n) if every else n - 1)
            for buf, new in zip(self.keys + self.values, new_k + new_v):
                buf[slot, :, p0 : p0 + n] = new[0, :, :n]
            if every:
                rows.append(np.asarray(logits[0], np.float32))
        return np.concatenate(rows) if every else logits[0]
