"""ONNX Runtime (CPU EP) on static KV slots.

The exported graph concatenates past and new KV and returns the whole `present`; we rewrite its outputs to the
new positions only (the second input of each Concat) and keep the past in our slot buffers, bound to the
session without copies through IOBinding. Chunks of any length run (ONNX Runtime takes dynamic shapes). The
rewritten graph lives in memory only: loading never writes to the model directory (it may be read-only).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnxruntime as ort

from appliance.manifest import Manifest
from appliance.runtime.backends.static_slots import StaticSlotBackend

if TYPE_CHECKING:
    from appliance.config import EngineConfig

log = logging.getLogger(__name__)
# Where ONNX Runtime reads a graph's external data when the graph comes from memory (ORT >= 1.19). The rewritten
# graph of a model with external data (past 2 GiB) is small, its weights stay in their files: it is built from
# bytes, so nothing is written. Writing it beside the model (as once) fails on a read-only model directory (the
# unit's ProtectSystem=strict, the image's 0555 layout) and races between processes loading the same model.
EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"
_NP = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16}


def new_kv_only(model: onnx.ModelProto) -> None:
    """Point every `present.*` graph output at the new positions (input 1 of the Concat that made it)."""
    producer = {out: node for node in model.graph.node for out in node.output}
    typed = {v.name: v.type.tensor_type.elem_type for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    outputs = []
    for out in model.graph.output:
        if not out.name.startswith("present"):
            outputs.append(out)
            continue
        node = producer[out.name]
        while node.op_type != "Concat":
            if node.op_type not in ("Cast", "Identity"):
                raise RuntimeError(f"{out.name}: KV output is not a Concat of past and new positions")
            node = producer[node.input[0]]
        new = node.input[1]
        elem = typed.get(new, out.type.tensor_type.elem_type)
        outputs.append(onnx.helper.make_tensor_value_info(new, elem, None))
    del model.graph.output[:]
    model.graph.output.extend(outputs)


class OnnxBackend(StaticSlotBackend):
    pad_prefill = False

    def __init__(self, model_dir: Path, manifest: Manifest, config: EngineConfig):
        if config.device.upper() != "CPU":
            raise ValueError(f"the ONNX Runtime backend runs on CPU only (asked for {config.device})")
        path = Path(model_dir) / manifest.model_file
        model = onnx.load(str(path), load_external_data=False)
        external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
        if not external:
            model = onnx.load(str(path))
        new_kv_only(model)
        self.kv_names = [i.name for i in model.graph.input if i.name.startswith("past_key_values")]
        self.new_names = [o.name for o in model.graph.output if o.name != "logits"]
        past_type = next(i for i in model.graph.input if i.name == self.kv_names[0]).type.tensor_type.elem_type
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.log_severity_level = 3
        if config.num_threads:
            opts.intra_op_num_threads = config.num_threads
        if external:  # the graph (weights left out) from memory; its weights from their files in the model dir
            opts.add_session_config_entry(EXTERNAL_FOLDER, str(path.parent.resolve()))
        self.session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        del model
        self._init_slots(
            manifest.num_layers,
            manifest.num_kv_heads,
            manifest.head_dim,
            _NP[past_type],
            config.static_batch,
            min(config.static_context, manifest.max_context),
            config.static_prefill_chunk,
        )
        self.max_prompt = config.max_prompt_len  # OVMS's NPU rule: longer prompts get a 400
        self.inputs = {i.name for i in self.session.get_inputs()}
        log.info(
            "onnx static KV: %d slots x %d positions, %.1f MB",
            self.max_batch,
            self.block_size,
            self.cache_bytes / 2**20,
        )

    def _run(self, kind, slot, input_ids, position_ids, attention_mask, last_index):
        binding = self.session.io_binding()
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        for name, value in feeds.items():
            if name in self.inputs:
                binding.bind_cpu_input(name, value)
        layers = [t for pair in zip(self.keys, self.values) for t in pair]
        for name, buf in zip(self.kv_names, layers):
            binding.bind_cpu_input(name, buf if slot is None else buf[slot : slot + 1])
        binding.bind_output("logits")
        for name in self.new_names:
            binding.bind_output(name)
        self.session.run_with_iobinding(binding)
        outs = binding.copy_outputs_to_cpu()
        logits = outs[0][:, last_index]
        news = outs[1:]
        return logits, news[0::2], news[1::2]

    def close(self) -> None:
        self.session = None
