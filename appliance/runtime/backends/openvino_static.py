"""OpenVINO with static shapes: the NPU path (also runs on CPU/GPU, which is how CPU tests exercise it).

From the stateful IR: state -> explicit KV inputs/outputs (`stateful_to_stateless_transformation`), KV outputs
cut down to the new positions, a Gather before the LM head so only one row of logits is computed, then two
fixed-shape compilations: prefill [1, chunk] and decode [slots, 1], both reading the full slot buffers.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino._offline_transformations import stateful_to_stateless_transformation

from appliance.manifest import Manifest
from appliance.runtime.backends.openvino_common import (
    apply_kernels,
    check_device,
    compile_properties,
    compile_with_kernels,
    core,
    kernel_rows,
    logits_matmul,
    read_model,
)
from appliance.runtime.backends.static_slots import StaticSlotBackend

if TYPE_CHECKING:
    from appliance.config import EngineConfig

log = logging.getLogger(__name__)


def new_kv_only(model: ov.Model) -> None:
    """Make each `present.*` output the new positions only: the second input of the Concat(past, new) that
    produced it. The runtime appends those positions to its own buffers."""
    for result in list(model.get_results()):
        out = result.input_value(0)
        name = result.get_output_tensor(0).get_any_name() if result.get_output_tensor(0).get_names() else ""
        if not name.startswith("present"):
            continue
        node = out.get_node()
        while node.get_type_name() != "Concat":
            if node.get_input_size() != 1:
                raise RuntimeError(f"{name}: KV output is not a Concat of past and new positions")
            node = node.input_value(0).get_node()
        result.input(0).replace_source_output(node.input_value(1))
        result.get_output_tensor(0).set_names({name})
    model.validate_nodes_and_infer_types()


def gather_row(model: ov.Model) -> None:
    """Logits for one position per call (`logits_index`, the last real token of the chunk)."""
    matmul = logits_matmul(model)
    index = ops.parameter([1], ov.Type.i64, name="logits_index")
    index.output(0).get_tensor().set_names({"logits_index"})
    matmul.input(0).replace_source_output(ops.gather(matmul.input_value(0), index, ops.constant(np.int64(1))).output(0))
    model.add_parameters([index])
    model.validate_nodes_and_infer_types()


class OpenVINOStaticBackend(StaticSlotBackend):
    pad_prefill = True

    def __init__(self, model_dir: Path, manifest: Manifest, config: EngineConfig):
        check_device(config.device)
        model = read_model(model_dir, manifest.model_file)
        if manifest.stateful:
            stateful_to_stateless_transformation(model)
        new_kv_only(model)
        gather_row(model)
        self._native = model.clone()  # constants shared, not copied
        self.kernels = apply_kernels(model, config, model_dir)
        self.kernel_rows = kernel_rows(self.kernels, model)  # shapes of more tokens per call compile OpenVINO's kernels
        length = min(config.static_context, manifest.max_context)
        self.kv_names = [p.get_any_name() for p in model.inputs if p.get_any_name().startswith("past_key_values")]
        past = next(p for p in model.inputs if p.get_any_name() == self.kv_names[0])
        dtype = np.float16 if past.get_element_type() == ov.Type.f16 else np.float32
        self._init_slots(
            manifest.num_layers,
            manifest.num_kv_heads,
            manifest.head_dim,
            dtype,
            config.static_batch,
            length,
            config.static_prefill_chunk,
        )
        self.max_prompt = config.max_prompt_len  # OVMS's NPU rule: longer prompts get a 400
        self._model, self._props, self._device = model, compile_properties(config, kv_precision=False), config.device
        self._kv_shape = (manifest.num_kv_heads, length, manifest.head_dim)
        self.requests = {}
        for kind, (b, t) in {"prefill": (1, self.chunk), "decode": (self.max_batch, 1)}.items():
            self.requests[kind] = self._compile(b, t, 1)
        self.inputs = {p.get_any_name() for p in model.inputs}
        # Bind the slot buffers once: the whole buffer for decode, one slot view per prefill slot.
        layers = [t for pair in zip(self.keys, self.values) for t in pair]
        self._slot_tensors = [
            [ov.Tensor(buf[s : s + 1], shared_memory=True) for buf in layers] for s in range(self.max_batch)
        ]
        for name, buf in zip(self.kv_names, layers):
            self.requests["decode"].set_tensor(name, ov.Tensor(buf, shared_memory=True))
        self._out_names = [n.replace("past_key_values", "present") for n in self.kv_names]
        log.info(
            "static KV: %d slots x %d positions, prefill chunk %d, %.1f MB",
            self.max_batch,
            length,
            self.chunk,
            self.cache_bytes / 2**20,
        )

    def _compile(self, b: int, t: int, rows: int) -> ov.InferRequest:
        """[b, t] tokens per call, logits for `rows` positions of each."""
        heads, length, head_dim = self._kv_shape
        ours = b * t <= self.kernel_rows
        shaped = (self._model if ours else self._native).clone()
        shapes = {}
        for port in shaped.inputs:
            name = port.get_any_name()
            if name in ("input_ids", "position_ids"):
                shapes[port] = [b, t]
            elif name == "attention_mask":
                shapes[port] = [b, length + t]
            elif name == "beam_idx":
                shapes[port] = [b]
            elif name == "logits_index":
                shapes[port] = [rows]
            elif name.startswith("past_key_values"):
                shapes[port] = [b, heads, length, head_dim]
        shaped.reshape(shapes)
        compiled = compile_with_kernels(shaped, self._device, self._props) if ours else None
        if ours and compiled is None:
            self.kernels, self.kernel_rows = "openvino", 0
            return self._compile(b, t, rows)
        if compiled is None:
            compiled = core().compile_model(shaped, self._device, self._props)
        return compiled.create_infer_request()

    def _run(self, kind, slot, input_ids, position_ids, attention_mask, last_index):
        every = not np.isscalar(last_index)
        if every:  # logits of every position of the chunk (prompt logprobs): a third shape, compiled on demand
            if "prefill_every" not in self.requests:
                self.requests["prefill_every"] = self._compile(1, self.chunk, self.chunk)
            kind = "prefill_every"
            rows = np.zeros(self.chunk, np.int64)
            rows[: len(last_index)] = last_index
        else:
            rows = np.array([last_index], np.int64)
        req = self.requests[kind]
        if kind != "decode":
            for name, tensor in zip(self.kv_names, self._slot_tensors[slot]):
                req.set_tensor(name, tensor)
        feeds = {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "attention_mask": attention_mask,
            "logits_index": rows,
        }
        if "beam_idx" in self.inputs:
            feeds["beam_idx"] = np.arange(input_ids.shape[0], dtype=np.int32)
        for name, value in feeds.items():
            req.set_tensor(name, ov.Tensor(value))
        req.infer()
        news = [req.get_tensor(n).data for n in self._out_names]
        data = req.get_tensor("logits").data
        logits = data[:, : len(last_index)].copy() if every else data[:, 0].copy()  # the next call reuses it
        return logits, news[0::2], news[1::2]

    def close(self) -> None:
        self.requests.clear()
        self._model = None
