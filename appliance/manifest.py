"""The export manifest: everything the runtime needs to load a model without transformers or torch.

Written by `export/`, read by the runtime. One exported directory holds one backend and one weight format.
An encoder export (embeddings, rerank) fills the same record: `task` says which, and the encoder fields below are
the one declaration of how its output is made (the LLM fields hold the encoder's geometry; `kv_dtype` is empty).
Manifests written before a field existed load with its default.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

MANIFEST_NAME = "appliance_manifest.json"
TASKS = ("generate", "embed", "rerank")  # generate: a causal LM (chat, completions); embed/rerank: an encoder
POOLINGS = ("mean", "cls", "last")
FORMAT_VERSION = 1


@dataclass
class Manifest:
    name: str  # served model name (overridable at serve time)
    backend: str  # "openvino" | "onnx"
    weight_format: str  # fp32 | fp16 | int8 | int4
    model_file: str  # relative: openvino_model.xml or model.onnx
    architecture: str  # e.g. LlamaForCausalLM
    model_type: str  # e.g. llama
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_context: int  # max_position_embeddings
    kv_dtype: str  # dtype of the KV tensors the graph produces: f32 | f16
    stateful: bool  # OpenVINO: KV cache held as graph state (needed for paged attention)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    tokenizer_file: str = "tokenizer.json"
    chat_template_file: str | None = "chat_template.jinja"
    generation_config_file: str = "generation_config.json"
    source: str = ""  # where the weights came from
    weight_compression: dict = field(default_factory=dict)  # what the exporter did to the weights, for humans
    format_version: int = FORMAT_VERSION
    task: str = "generate"  # one of TASKS
    # Encoders only (None/False for a causal LM):
    pooling: str | None = None  # embed: how token vectors become one (POOLINGS), from 1_Pooling/config.json
    normalize: bool = False  # embed: L2-normalize the pooled vector (the folder's modules.json has Normalize)
    max_length: int | None = None  # tokens per input, special tokens included (max_seq_length, else positions)
    dimensions: int | None = None  # embed: the vector's length (hidden size); rerank: 1 (one relevance logit)

    @property
    def is_encoder(self) -> bool:
        return self.task in ("embed", "rerank")

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / MANIFEST_NAME
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> Manifest:
        path = Path(directory) / MANIFEST_NAME
        if not path.is_file():
            raise FileNotFoundError(f"{directory}: no {MANIFEST_NAME}; export the model first (python -m export)")
        data = json.loads(path.read_text())
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})
