"""OpenVINO with paged attention (CPU, GPU): the runtime's own block pool, many sequences per call.

The stateful IR is rewritten by OpenVINO's `paged_attention_transformation` (the route vLLM's OpenVINO backend
and openvino_genai's continuous batching take): attention reads and writes KV blocks in cache tensors that we
allocate once here and bind to the infer request once. Per step only small index arrays change, so no KV byte
is copied per token. We also gather the last token of each sequence before the LM head, so a prefill does
not compute vocabulary-sized logits for every prompt token.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino._offline_transformations import paged_attention_transformation

from appliance.backends.base import Backend, StepBatch
from appliance.backends.openvino_common import check_device, compile_properties, core, logits_matmul, read_model
from appliance.manifest import Manifest

log = logging.getLogger(__name__)


def _gather_last_tokens(model: ov.Model) -> None:
    """Insert Gather(hidden, logits_indices) before the LM head MatMul; `logits_indices` picks rows of the
    flattened token dimension."""
    matmul = logits_matmul(model)
    hidden = matmul.input_value(0)
    indices = ops.parameter([-1], ov.Type.i64, name="logits_indices")
    indices.output(0).get_tensor().set_names({"logits_indices"})
    gathered = ops.gather(hidden, indices, ops.constant(np.int64(0)))
    matmul.input(0).replace_source_output(gathered.output(0))
    model.add_parameters([indices])
    model.validate_nodes_and_infer_types()


class OpenVINOPagedBackend(Backend):
    def __init__(self, model_dir: Path, manifest: Manifest, config):
        check_device(config.device)
        if not manifest.stateful:
            raise ValueError("paged attention needs the stateful OpenVINO IR (export with the default options)")
        model = read_model(model_dir, manifest.model_file)
        paged_attention_transformation(model)
        _gather_last_tokens(model)
        self.compiled = core().compile_model(model, config.device, compile_properties(config))
        self.request = self.compiled.create_infer_request()
        cache_inputs = [i for i in self.compiled.inputs if i.get_any_name().startswith(("key_cache.", "value_cache."))]
        # value_cache's dim 2 is the block size; a u8 key_cache adds rows for its per-channel scales.
        values = next(i for i in cache_inputs if i.get_any_name().startswith("value_cache."))
        self.block_size = values.get_partial_shape()[2].get_length()
        self.max_context = manifest.max_context
        self.num_blocks = max(1, -(-config.kv_cache_tokens // self.block_size))
        self.cache_bytes = 0
        self._caches = []
        for port in cache_inputs:
            ps = port.get_partial_shape()
            shape = [self.num_blocks] + [ps[d].get_length() for d in range(1, ps.rank.get_length())]
            tensor = ov.Tensor(port.get_element_type(), shape)
            np.asarray(tensor.data).view(np.uint8)[...] = 0
            self.request.set_tensor(port, tensor)
            self._caches.append(tensor)
            self.cache_bytes += tensor.byte_size
        self.kv_precision = str(cache_inputs[0].get_element_type())
        log.info("paged KV: %d blocks x %d tokens, %s, %.1f MB", self.num_blocks, self.block_size,
                 self.kv_precision, self.cache_bytes / 2**20)

    def forward(self, batch: StepBatch) -> np.ndarray:
        lens = np.fromiter((len(t) for t in batch.token_ids), np.int32, len(batch.token_ids))
        past = np.asarray(batch.past_lens, np.int32)
        begins = np.zeros(len(lens) + 1, np.int32)
        np.cumsum(lens, out=begins[1:])
        ids = np.fromiter((t for toks in batch.token_ids for t in toks), np.int64, int(begins[-1]))
        positions = np.concatenate([np.arange(p, p + n, dtype=np.int64) for p, n in zip(past, lens)])
        bs = self.block_size
        used = [table[: -(-(p + n) // bs)] for table, p, n in zip(batch.block_tables, past, lens)]
        block_begins = np.zeros(len(used) + 1, np.int32)
        np.cumsum([len(u) for u in used], out=block_begins[1:])
        blocks = np.fromiter((b for u in used for b in u), np.int32, int(block_begins[-1]))
        feeds = {
            "input_ids": ids,
            "position_ids": positions,
            "past_lens": past,
            "subsequence_begins": begins,
            "block_indices": blocks,
            "block_indices_begins": block_begins,
            "max_context_len": np.array(int((past + lens).max()), np.int32),
            "logits_indices": (begins[1:] - 1).astype(np.int64),
        }
        flags = batch.all_logits
        if flags is not None and any(flags):   # every position of the flagged sequences, the last of the others
            feeds["logits_indices"] = np.concatenate(
                [np.arange(b, e) if f else np.array([e - 1]) for b, e, f in zip(begins[:-1], begins[1:], flags)]
            ).astype(np.int64)
        for name, value in feeds.items():
            self.request.set_tensor(name, ov.Tensor(value))
        self.request.infer()
        logits = self.request.get_tensor("logits").data
        if flags is None or not any(flags):
            return np.array(logits, dtype=np.float32).reshape(len(lens), -1)  # a copy: the next call reuses it
        rows = np.array(logits, dtype=np.float32).reshape(len(feeds["logits_indices"]), -1)
        counts = np.where(np.asarray(flags, bool), lens, 1)
        ends = np.cumsum(counts)
        batch.position_logits = [rows[e - c:e] if f else None for e, c, f in zip(ends, counts, flags)]
        return rows[ends - 1]

    def copy_blocks(self, pairs: list[tuple[int, int]], num_tokens: list[int] | None = None) -> None:
        """Whole blocks, every key_cache / value_cache tensor, in place through numpy views of their memory (a
        u8 key cache keeps its per-block scales in extra rows of the block, so rows are never copied partly)."""
        if not pairs:
            return
        src = np.fromiter((s for s, _ in pairs), np.int64, len(pairs))
        dst = np.fromiter((d for _, d in pairs), np.int64, len(pairs))
        for tensor in self._caches:
            data = np.asarray(tensor.data).view(np.uint8)
            data[dst] = data[src]

    def close(self) -> None:
        self._caches.clear()
        self.request = None
        self.compiled = None
