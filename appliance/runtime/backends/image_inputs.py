"""A vision-language model's language model behind the same `input_ids` as a text model, plus the image rows.

A VLM export's language model takes `inputs_embeds` (and, for M-RoPE models, position_ids [3, tokens] once the
paged-attention rewrite flattened the batch). At load we put the export's text-embeddings graph in front of it, so
the backend still feeds token ids, and scatter the step's image feature rows over the gathered embeddings:

    input_ids i64 [tokens] -> text embeddings [tokens, hidden]
    ScatterUpdate(embeddings, image_index i64 [k], image_embeds f32 [k, hidden]) -> the language model

A step with no image token feeds k = 0 (ScatterUpdate with empty indices is the identity). Why in the graph and
not a numpy gather of the embedding table on the host: the table stays the plugin's (at Qwen2-VL-2B's shape,
151936 x 1536, a host copy is 445 MB in f16, 890 MB in f32), the host gather would hold the engine thread (1.3 ms
for a 256-token prefill chunk, 20 us for a decode step of 8, numpy on the 2-core dev box, f16 table to f32 rows),
and both compiled requests (OpenVINO's and our kernels') get the same graph from the one rewrite. A text step of a
VLM costs 2.6 us more in Python (the empty image inputs and the 3-D positions of a decode step of 8).

`step_inputs` turns a StepBatch's per-sequence image rows and 3-D positions into those inputs; a text sequence of
an M-RoPE model takes its 1-D position on all three axes (what the model's own rope index gives text).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from appliance.manifest import Manifest
from appliance.runtime.backends.base import StepBatch


def splice_text_embeddings(model: ov.Model, embeddings: ov.Model) -> None:
    """Replace `model`'s `inputs_embeds` parameter [tokens, hidden] with `input_ids` [tokens] through `embeddings`
    (the export's text-embeddings part: `input` [batch, length] -> [batch, length, hidden]) and the image rows'
    scatter. `embeddings`' nodes move into `model` (the caller drops its handle)."""
    target = model.input("inputs_embeds")
    param = target.get_node()
    hidden = param.get_output_partial_shape(0)[1]
    ids = ops.parameter([-1], ov.Type.i64, name="input_ids")
    rows = ops.parameter([-1, hidden], ov.Type.f32, name="image_embeds")
    index = ops.parameter([-1], ov.Type.i64, name="image_index")
    for p, name in ((ids, "input_ids"), (rows, "image_embeds"), (index, "image_index")):
        p.output(0).get_tensor().set_names({name})
    source = embeddings.get_parameters()[0]
    batched = ops.unsqueeze(ids, ops.constant(np.int64(0)))  # [1, tokens]: the part's batch axis
    for consumer in list(source.output(0).get_target_inputs()):
        consumer.replace_source_output(batched.output(0))
    gathered = embeddings.output(0).get_node().input_value(0)  # the Result's input: [1, tokens, hidden]
    flat = ops.squeeze(gathered, ops.constant(np.int64(0)))
    if flat.get_output_element_type(0) != ov.Type.f32:
        flat = ops.convert(flat, ov.Type.f32)
    merged = ops.scatter_update(flat, index, rows, ops.constant(np.int64(0)))
    if param.get_element_type() != ov.Type.f32:
        merged = ops.convert(merged, param.get_element_type())
    for consumer in list(param.output(0).get_target_inputs()):
        consumer.replace_source_output(merged.output(0))
    model.remove_parameter(param)
    model.add_parameters([ids, rows, index])
    model.validate_nodes_and_infer_types()


def load_text_embeddings(model_dir: Path, manifest: Manifest, core: ov.Core) -> ov.Model:
    assert manifest.vision is not None
    return core.read_model(str(Path(model_dir) / manifest.vision.parts["text_embeddings"]))


def step_inputs(
    batch: StepBatch, begins: np.ndarray, positions: np.ndarray, hidden: int, mrope: bool
) -> dict[str, np.ndarray]:
    """The image inputs of one step: `image_embeds` [k, hidden] and `image_index` [k] (rows of the flattened token
    dimension; `begins[i]` is sequence i's first row), and with `mrope` position_ids [3, tokens] (each sequence's
    own 3-D positions where it has them, its 1-D `positions` on every axis elsewhere; else the 1-D positions)."""
    index, rows = [], []
    for i, image in enumerate(batch.image_rows or ()):
        if image is not None:
            index.append(image[0] + int(begins[i]))
            rows.append(image[1])
    out = {
        "image_embeds": np.concatenate(rows) if rows else np.zeros((0, hidden), np.float32),
        "image_index": np.concatenate(index) if index else np.zeros(0, np.int64),
    }
    if not mrope:
        out["position_ids"] = positions
        return out
    three = np.repeat(positions[None], 3, axis=0)
    for i, pos in enumerate(batch.mrope_positions or ()):
        if pos is not None:
            three[:, begins[i] : begins[i] + pos.shape[1]] = pos
    out["position_ids"] = three
    return out
