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
from appliance.runtime.backends import row_graphs
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
from appliance.runtime.cores import map_on_cores
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


def _has_input(request: ov.InferRequest, name: str) -> bool:
    return any(name in port.get_names() for port in request.get_compiled_model().inputs)


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
        # (kernels.EVERY_ROW), ours alone: one compiled model. Steps of one token, and of up to 8 where our
        # attention (kernels/attention.py) runs: ours again, in graphs of static shapes (row_graphs); a model whose
        # layers are all under the kernels' floor runs ours there alone (kernels.ONE_TOKEN).
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
        # The pool before the graphs of rows: our attention there reads it by address (attention.rewrite).
        tensors, self._blocks = [], []  # per cache tensor: the tensor, its memory as uint8 [num_blocks, bytes a block]
        for port, dims in zip(cache_inputs, block_dims):
            tensor, blocks = _cache_tensor(config.device, port.get_element_type(), [self.num_blocks] + dims)
            tensors.append(tensor)
            self._blocks.append(blocks)
        pools = {p.get_any_name(): (b.ctypes.data, self.num_blocks) for p, b in zip(cache_inputs, self._blocks)}
        self._table = -(-self.max_context // self.block_size)  # a row's block table, padded (row_graphs)
        self.attention = False
        self._rows: dict[int, ov.InferRequest] = {}  # rows -> the request of row_graphs' graph of that many
        if (ours is not None or one_only) and not self.vlm:  # steps of a few tokens: ours in graphs of static shapes
            self._rows = self._row_graphs(model, config, props, attend, cache_inputs, pools, model_name(model_dir))
        self.fixed_shapes = max(self._rows, default=0)
        if ours is None and not self._rows:
            self.kernels, rows = "openvino", 0
        self.kernel_rows = rows
        del native, model, ours, small
        requests = [r for r in (self.request, self._small, *self._rows.values()) if r is not None]
        self._inputs: dict[int, dict[str, np.ndarray]] = {id(r): {} for r in requests}  # name -> bound array
        for port, tensor in zip(cache_inputs, tensors):
            for request in requests:
                if _has_input(request, port.get_any_name()):
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

    def _row_graphs(
        self,
        model: ov.Model,
        config: EngineConfig,
        props: dict,
        attend: bool,
        ports: list[ov.Output],
        pools: dict[str, tuple[int, int]],
        name: str,
    ) -> dict[int, ov.InferRequest]:
        """row_graphs.ROWS's graphs, compiled, where our attention runs in them; else the graph of one row (the
        plugin's attention there: row_graphs); {} where even that one does not compile (the graph of dynamic shapes
        then takes those steps: an optimisation), and none past the first that does not. Sets self.attention.
        The graphs compile side by side, a thread per core (cores.map_on_cores): the plugin's passes run on the
        calling thread, and the default model's six took 2.2-2.4 s on 2 threads against 5.0-5.2 one after another
        (2-vCPU Xeon)."""
        graphs: list[tuple[int, ov.Model]] = []
        for rows in row_graphs.rows_wanted():
            graph = row_graphs.graph(model, rows, self._table)
            ours = attend and attention.apply(graph, core(), config.kernels, ports, pools, name, quiet=rows > 1)
            if rows > 1 and not ours:
                break
            self.attention = ours
            graphs.append((rows, graph))
            if not ours:
                break

        # f32 inference (row_graph_properties) only over a pool it lays out alike: asked for an f16 cache, the
        # plugin makes it bf16 under its bf16 default (the graph of dynamic shapes: `ports`) and f16 under f32, and
        # its paged attention under f32 takes no bf16 cache.
        plugin_default = any(port.get_element_type() == ov.Type.bf16 for port in ports)

        def compiled(graph: ov.Model) -> ov.CompiledModel | Exception:
            try:
                extra = {} if plugin_default else kernels.row_graph_properties(graph, config.precision)
                return core().compile_model(graph, config.device, {**props, **extra})
            except Exception as exc:
                return exc

        results = map_on_cores(compiled, [graph for _, graph in graphs])
        requests: dict[int, ov.InferRequest] = {}
        for (rows, _), result in zip(graphs, results):
            if isinstance(result, Exception):
                log.warning("the graph of %d rows not compiled (%s): such steps run the dynamic one", rows, result)
                self.attention = self.attention and rows > 1
                break
            requests[rows] = result.create_infer_request()
        return requests

    def _rows_for(self, tokens: int) -> int:
        """The rows of the graph a step of `tokens` tokens runs (row_graphs), or 0."""
        return next((rows for rows in self._rows if rows >= tokens), 0)

    def request_for(self, tokens: int) -> ov.InferRequest:
        """The compiled model a step of `tokens` tokens runs: a graph of static shapes with as many rows or a few
        more, ours of dynamic shapes up to kernel_rows, else the one for every step (prefill)."""
        rows = self._rows_for(tokens)
        if rows:
            return self._rows[rows]
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
            logits_indices = np.repeat(begins[1:] - counts, counts) + row_graphs.ranges(counts)
        else:
            flags, logits_indices = None, (begins[1:] - 1).astype(np.int64)
        rows, request = self._rows_for(total), self.request_for(total)
        if rows:
            arrays = row_graphs.row_inputs(rows, self._table, ids, positions, lens, used, blocks, block_begins)
        else:
            arrays = {"input_ids": ids, "position_ids": positions, "past_lens": past, "subsequence_begins": begins}
            arrays |= {"block_indices": blocks, "block_indices_begins": block_begins}
        if self.vlm:  # the image rows (none: k = 0) and the positions, 3-D for M-RoPE
            arrays |= step_inputs(batch, begins, positions, self.hidden_size, self.mrope)
        arrays["max_context_len"] = np.array(int((past + lens).max()), np.int32)
        arrays["logits_indices"] = logits_indices.astype(np.int64, copy=False)
        views = self._inputs[id(request)]
        for name, value in arrays.items():
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
        kept = np.array(logits, dtype=np.float32).reshape(len(logits_indices), -1)  # kept past this call
        ends = np.cumsum(counts)
        batch.position_logits = [kept[e - c : e] if f else None for e, c, f in zip(ends, counts, flags)]
        return kept[ends - 1]

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
        self.request = self._small = None  # the graphs before the pool: those of rows hold its address
        self._rows.clear()
        self.compiled = None
        self._blocks.clear()
