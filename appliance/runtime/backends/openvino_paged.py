"""OpenVINO with paged attention (CPU, GPU): the runtime's own block pool, many sequences per call.

The stateful IR is rewritten by OpenVINO's `paged_attention_transformation` (the route vLLM's OpenVINO backend
and openvino_genai's continuous batching take): attention reads and writes KV blocks in cache tensors that we
allocate once here and bind to the infer request once. Per step only small index arrays change, so no KV byte
is copied per token. We also gather the last token of each sequence before the LM head, so a prefill does
not compute vocabulary-sized logits for every prompt token.
"""

from __future__ import annotations

import logging
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino._offline_transformations import paged_attention_transformation

from appliance.manifest import Manifest
from appliance.runtime import kernels
from appliance.runtime.backends.base import Backend, StepBatch
from appliance.runtime.backends.image_inputs import load_text_embeddings, splice_text_embeddings, step_inputs
from appliance.runtime.backends.kv_budget import pool_blocks
from appliance.runtime.backends.openvino_common import (
    apply_kernels,
    check_device,
    compile_properties,
    compile_with_kernels,
    core,
    kernel_rows,
    logits_matmul,
    model_name,
    read_model,
)
from appliance.runtime.backends.projection_fusion import fuse_sibling_projections
from appliance.runtime.kernels import attention

if TYPE_CHECKING:
    from appliance.config import EngineConfig

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


def _one_token(model: ov.Model, table: int) -> ov.Model:
    """The rewritten graph for steps of one token (batch-1 decode, the commonest step on an edge box) with static
    shapes but the KV pool's, and a block table of `table` entries (forward pads a sequence's). The CPU plugin runs
    our ops as reference nodes, and where an input's shape is dynamic it infers the op's output shape at every call,
    from a clone of the op (~7 us, 113 calls a step at Qwen2.5-1.5B); static, that and the plugin's per-node shape
    checks go. Compiled as a third model beside the one for 1..kernel_rows tokens: it shares their constants and took
    3.5 s more to load at Qwen2.5-1.5B, whose decode step it took to 0.923-0.952 of the time on the graph of dynamic
    shapes (Zen 4 EPYC, engines side by side, interleaved, medians of 6-12 pairs). Our decode attention
    (kernels/attention.py) reads the pool by address, so the cache inputs leave this graph; where the plugin's
    attention stays, they keep the pool's dimension dynamic (its own attention took 2.03 / 2.05 ms a step either
    way at Qwen2.5-1.5B, Zen 5), since a static one made the plugin hold a copy of the pool (attention.py)."""
    one = model.clone()  # constants shared, not copied
    shapes = {"input_ids": [1], "position_ids": [1], "past_lens": [1], "logits_indices": [1], "block_indices": [table]}
    one.reshape({**shapes, "subsequence_begins": [2], "block_indices_begins": [2]})
    return one


def _has_input(request: ov.InferRequest, name: str) -> bool:
    return any(name in port.get_names() for port in request.get_compiled_model().inputs)


def _ranges(counts: np.ndarray) -> np.ndarray:
    """concatenate(arange(c) for c in counts), vectorised."""
    ends = np.cumsum(counts)
    return np.arange(int(ends[-1])) - np.repeat(ends - counts, counts)


def _cache_tensor(device: str, kind: ov.Type, shape: list[int]) -> tuple[ov.Tensor, np.ndarray]:
    """One zeroed KV cache tensor and its memory as uint8 [num_blocks, bytes per block] (for copy_blocks).

    Zeros, because a kernel reading a never-written position must not meet NaN bit patterns. On CPU the memory
    is calloc'ed and 64-byte aligned: the OS maps pages only as blocks are first written (2 MB huge pages:
    numpy asks for them), so an idle server's RSS is not the whole pool. On a GPU it is the plugin's USM host
    memory (an iGPU reads it in place, no copy per inference) from the device's default context."""
    nbytes = int(np.prod(shape)) * kind.size
    if device.upper().startswith("CPU"):
        raw = np.zeros(nbytes + 64, np.uint8)
        mem = raw[-raw.ctypes.data % 64 :][:nbytes]  # the views keep raw alive
        tensor = ov.Tensor(mem, ov.Shape(shape), kind)
    else:
        tensor = core().get_default_context(device).create_host_tensor(kind, ov.Shape(shape))
        mem = np.asarray(tensor.data).reshape(-1).view(np.uint8)
        mem[...] = 0
    return tensor, mem.reshape(shape[0], -1)


class OpenVINOPagedBackend(Backend):
    def __init__(self, model_dir: Path, manifest: Manifest, config: EngineConfig):
        check_device(config.device)
        if not manifest.stateful:
            raise ValueError("paged attention needs the stateful OpenVINO IR (export with the default options)")
        model = read_model(model_dir, manifest.model_file)
        paged_attention_transformation(model)
        # a vision-language model's language model: token ids in again, plus the step's image rows (image_inputs.py)
        self.vlm, self.mrope = manifest.is_vlm, False
        if self.vlm:
            splice_text_embeddings(model, load_text_embeddings(model_dir, manifest, core()))
            self.mrope = model.input("position_ids").get_partial_shape().rank.get_length() == 2  # [3, tokens]
        self.hidden_size = manifest.hidden_size
        log.debug("fused %d groups of sibling projections", fuse_sibling_projections(model))
        _gather_last_tokens(model)
        native = model.clone()  # constants shared, not copied
        self.kernels = apply_kernels(model, config, model_dir, one_token=not self.vlm)
        props = compile_properties(config)
        attend = attention.wanted(self.kernels) and not self.vlm
        if attend:  # one cache layout for the plugin's attention and ours
            props.update(attention.cache_mode(manifest.head_dim))
        # Steps of at most `kernel_rows` tokens (decode, speculative verification, small batches) run our kernels;
        # longer ones (prefill) OpenVINO's where they win there (kernels.KERNEL_ROWS), each compiled model holding
        # its own weights (kernels/rewrite.py states the cost). Where ours win at every row count
        # (kernels.EVERY_ROW), ours alone: one compiled model. Steps of one token: ours again, with static shapes
        # (_one_token), and our attention (kernels/attention.py); a model whose layers are all under the kernels'
        # floor runs ours there alone (kernels.ONE_TOKEN).
        rows = kernel_rows(self.kernels, model)
        one_only = self.kernels.endswith(kernels.ONE_TOKEN)
        ours = compile_with_kernels(model, config.device, props) if rows and not one_only else None
        if ours is not None and rows >= kernels.EVERY_ROW:
            self.compiled, small = ours, None
        else:
            self.compiled, small = core().compile_model(native, config.device, props), ours
        self.request = self.compiled.create_infer_request()
        self._small = small.create_infer_request() if small is not None else None
        cache_inputs = [i for i in self.compiled.inputs if i.get_any_name().startswith(("key_cache.", "value_cache."))]
        # value_cache's dim 2 is the block size; a u8 key_cache by channel adds rows for its per-channel scales.
        values = next(i for i in cache_inputs if i.get_any_name().startswith("value_cache."))
        self.block_size = values.get_partial_shape()[2].get_length()
        block_dims = [
            [ps[d].get_length() for d in range(1, ps.rank.get_length())]
            for ps in (port.get_partial_shape() for port in cache_inputs)
        ]
        self.bytes_per_block = sum(
            int(np.prod(dims)) * port.get_element_type().size for port, dims in zip(cache_inputs, block_dims)
        )
        self.num_blocks = pool_blocks(config, self.block_size, self.bytes_per_block, manifest.max_context)
        self.max_context = min(manifest.max_context, self.num_blocks * self.block_size)  # a longer one never fits
        # The pool before the single-token graph: our attention there reads it by address (attention.rewrite).
        tensors, self._blocks = [], []  # per cache tensor: the tensor, its memory as uint8 [num_blocks, bytes a block]
        for port, dims in zip(cache_inputs, block_dims):
            tensor, blocks = _cache_tensor(config.device, port.get_element_type(), [self.num_blocks] + dims)
            tensors.append(tensor)
            self._blocks.append(blocks)
        pools = {p.get_any_name(): (b.ctypes.data, self.num_blocks) for p, b in zip(cache_inputs, self._blocks)}
        one, self.attention = None, False
        self._table = -(-self.max_context // self.block_size)  # a one-token step's block table, padded
        if (ours is not None or one_only) and not self.vlm:  # single-token steps: ours in a graph of static shapes
            single = _one_token(model, self._table)
            if attend:
                name = model_name(model_dir)
                self.attention = attention.apply(single, core(), config.kernels, cache_inputs, pools, name)
            try:
                one = core().compile_model(
                    single, config.device, {**props, **kernels.one_token_properties(single, config.precision)}
                )
            except Exception as exc:  # an optimisation: the graph of dynamic shapes takes those steps instead
                log.warning("one-token graph not compiled (%s): single-token steps run the dynamic one", exc)
                self.attention = False
        self._one = one.create_infer_request() if one is not None else None
        if ours is None and one is None:
            self.kernels, rows = "openvino", 0
        self.kernel_rows = rows
        del native, model, ours, small, one
        # per request: input name -> numpy view of the tensor bound to it
        self._inputs: dict[int, dict[str, np.ndarray]] = {id(r): {} for r in (self.request, self._small, self._one)}
        for port, tensor in zip(cache_inputs, tensors):
            for request in (self.request, self._small, self._one):
                if request is not None and _has_input(request, port.get_any_name()):
                    request.set_tensor(port.get_any_name(), tensor)
        self.cache_bytes = self.num_blocks * self.bytes_per_block
        self.kv_precision = cache_inputs[0].get_element_type().get_type_name()  # "u8", not "<Type: 'uint8_t'>"
        self.kv_layout = ";".join(
            f"{port.get_any_name()}:{port.get_element_type().get_type_name()}:{dims}"
            for port, dims in zip(cache_inputs, block_dims)
        )
        log.info(
            "paged KV: %d blocks x %d tokens, %s, %.1f MB",
            self.num_blocks,
            self.block_size,
            self.kv_precision,
            self.cache_bytes / 2**20,
        )

    def request_for(self, tokens: int) -> ov.InferRequest:
        """The compiled model a step of `tokens` tokens runs: the graph of static shapes for one token, ours of
        dynamic shapes up to kernel_rows, else the one for every step (prefill)."""
        if tokens == 1 and self._one is not None:
            return self._one
        if self._small is not None and tokens <= self.kernel_rows:
            return self._small
        return self.request

    def forward(self, batch: StepBatch) -> np.ndarray:
        """The returned logits are a view of the output tensor: valid until the next forward call."""
        n, bs = len(batch.token_ids), self.block_size
        lens = np.fromiter(map(len, batch.token_ids), np.int32, n)
        past = np.asarray(batch.past_lens, np.int32)
        begins = np.zeros(n + 1, np.int32)
        np.cumsum(lens, out=begins[1:])
        total = int(begins[-1])
        ids = np.fromiter(chain.from_iterable(batch.token_ids), np.int64, total)
        if total == n:  # decode only: one token per sequence, at position past_len
            positions = past.astype(np.int64)
        else:
            positions = np.repeat((past - begins[:-1]).astype(np.int64), lens) + np.arange(total)
        used = (past + lens + (bs - 1)) // bs
        block_begins = np.zeros(n + 1, np.int32)
        np.cumsum(used, out=block_begins[1:])
        blocks = np.fromiter(
            chain.from_iterable(t[:u] for t, u in zip(batch.block_tables, used.tolist())),
            np.int32,
            int(block_begins[-1]),
        )
        flags = batch.all_logits
        if flags is not None and any(flags):  # every position of the flagged sequences, the last of the others
            counts = np.where(np.asarray(flags, bool), lens, 1)
            logits_indices = np.repeat(begins[1:] - counts, counts) + _ranges(counts)
        else:
            flags, logits_indices = None, (begins[1:] - 1).astype(np.int64)
        request = self.request_for(total)
        if request is self._one:  # its block table has a static length
            blocks = np.concatenate([blocks, np.zeros(self._table - len(blocks), np.int32)])
        views = self._inputs[id(request)]
        feed = [("input_ids", ids), ("position_ids", positions)]
        if self.vlm:  # the image rows (none: k = 0) and the positions, 3-D for M-RoPE
            feed = [("input_ids", ids), *step_inputs(batch, begins, positions, self.hidden_size, self.mrope).items()]
        for name, value in (
            *feed,
            ("past_lens", past),
            ("subsequence_begins", begins),
            ("block_indices", blocks),
            ("block_indices_begins", block_begins),
            ("max_context_len", np.array(int((past + lens).max()), np.int32)),
            ("logits_indices", logits_indices.astype(np.int64, copy=False)),
        ):
            view = views.get(name)
            if view is not None and view.shape == value.shape:
                view[...] = value  # decode steps keep their shapes: write into the bound tensor
            else:
                tensor = ov.Tensor(value)  # owns a copy, stays bound until the shape changes
                request.set_tensor(name, tensor)
                views[name] = tensor.data
        request.start_async()  # infer() would also copy every output into a fresh numpy array
        request.wait()
        logits = request.get_tensor("logits").data
        if flags is None:
            return logits.reshape(n, -1)
        rows = np.array(logits, dtype=np.float32).reshape(len(logits_indices), -1)  # kept past this call
        ends = np.cumsum(counts)
        batch.position_logits = [rows[e - c : e] if f else None for e, c, f in zip(ends, counts, flags)]
        return rows[ends - 1]

    def copy_blocks(self, pairs: list[tuple[int, int]], num_tokens: list[int] | None = None) -> None:
        """Whole blocks, every key_cache / value_cache tensor, in place through numpy views of their memory (a
        u8 key cache keeps its per-block scales in extra rows of the block, so rows are never copied partly)."""
        if not pairs:
            return
        src = np.fromiter((s for s, _ in pairs), np.int64, len(pairs))
        dst = np.fromiter((d for _, d in pairs), np.int64, len(pairs))
        for blocks in self._blocks:
            blocks[dst] = blocks[src]

    def read_block(self, block: int) -> bytes:
        """Every cache tensor's row of the block, concatenated (~10 us for the default model's 184 KB u8 block)."""
        return b"".join(blocks[block].tobytes() for blocks in self._blocks)

    def write_block(self, block: int, data: bytes) -> None:
        if len(data) != self.bytes_per_block:
            raise ValueError(f"a KV block is {self.bytes_per_block} bytes, got {len(data)}")
        src = np.frombuffer(data, np.uint8)
        at = 0
        for blocks in self._blocks:
            n = blocks.shape[1]
            blocks[block] = src[at : at + n]
            at += n

    def close(self) -> None:
        self.request = self._small = self._one = None  # before the pool: the single-token graph holds its address
        self.compiled = None
        self._blocks.clear()
