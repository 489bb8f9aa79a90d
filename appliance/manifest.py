"""The export manifest: everything the runtime needs to load a model without transformers or torch.

Written by `export/`, read by the runtime. One exported directory holds one backend and one weight format.
An encoder export (embeddings, rerank) fills the same record: `task` says which, and the encoder fields below are
the one declaration of how its output is made (the LLM fields hold the encoder's geometry; `kv_dtype` is empty).
A vision-language model (VLM) export is a causal LM (`task` "generate", the LLM fields describe its language model)
plus `vision`: the parts' files and the image-token scheme, the one declaration of how an image becomes prompt
embeddings. A text-only manifest has no `vision` key at all, so its bytes are what they were before VLMs.
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
# Why a vision-language export does not load with static shapes (NPU, --static): its prompts' image rows and 3-D
# positions are fed per step by the paged OpenVINO backend only (docs/vision.md)
VLM_PAGED_ONLY = (
    "a vision-language model is served by the paged OpenVINO backend only (CPU, GPU): "
    "not with static shapes (NPU, --static) or ONNX Runtime (docs/vision.md)"
)
IMAGE_SCHEMES = ("qwen2_vl", "idefics3")  # dynamic resolution + M-RoPE; fixed tiles + pixel shuffle


@dataclass
class Vision:
    """How a VLM export turns an image into embeddings spliced into the prompt (written by export/vlm.py).

    Parts (OpenVINO IR files, relative): `text_embeddings` maps token ids to embeddings; `vision_embeddings` maps
    preprocessed pixels to image features; `vision_merger` (qwen2_vl only) runs the vision transformer and merges
    2x2 patches into one token's features; the manifest's `model_file` is the language model, which takes
    `inputs_embeds` instead of `input_ids`. Each image's features replace, in order, the prompt's `image_token_id`
    tokens. Preprocessing (all in the manifest, mirroring the source's preprocessor_config.json): RGB, resize with
    PIL filter `resample`, multiply by `rescale_factor`, subtract `image_mean` and divide by `image_std` per channel.

    qwen2_vl: resize each side to a multiple of patch_size * merge_size keeping the aspect ratio, with the pixel count
    in [min_pixels, max_pixels] (transformers' smart_resize); cut into patch_size patches, each repeated
    temporal_patch_size times; an image of grid h x w patches gives h * w / merge_size**2 tokens, written as
    image_start_token_id, that many image_token_id, image_end_token_id; the language model's position_ids are 3-D
    (M-RoPE: temporal, height, width; `mrope_section` splits the rotary dims between them): text tokens advance all
    three by one, an image's tokens take start + (0, row, col) over its merged grid, and the text after it resumes at
    the largest position + 1. The merger takes the patch embeddings, an additive attention_mask [1, n, n] (0 within
    an image, -inf across images) and rotary_pos_emb [n, rotary_dim]: per patch, in 2x2-merge order, the (row, col)
    angles pos / 10000 ** (2i / rotary_dim), i < rotary_dim / 2, for row then col.
    idefics3: resize to longest edge `resize_longest_edge` (multiple of tile_size), split into tile_size x tile_size
    tiles (when `image_splitting`) plus the whole image resized to one tile; every tile gives `tokens_per_tile`
    tokens (patches shuffled merge_size x merge_size), and the prompt's one `<image>` becomes, with W the wrap token,
    G the global token and T = tokens_per_tile image tokens: for each tile row r and column c (from 1)
    `W<row_{r}_col_{c}>T`, a newline after each row, then `\nWGTW` (unsplit: `WGTW`); positions are 1-D. The vision
    part takes pixel_values [tiles, 3, tile, tile], patch_attention_mask [tiles, rows, cols] (patches with any
    unpadded pixel) and patch_position_ids: bucket(i / rows * (1 - 1e-6)) * side + bucket(j / cols * (1 - 1e-6)),
    side = tile_size / patch_size, bucket(x) = floor(x * side)."""

    scheme: str  # one of IMAGE_SCHEMES
    parts: dict[str, str]  # role (text_embeddings, vision_embeddings, vision_merger) -> IR file
    part_inputs: dict[str, list[str]]  # role -> the IR's input names, in order
    image_token_id: int
    patch_size: int  # pixels per patch edge
    merge_size: int  # patches per token edge: qwen2_vl's spatial merge, idefics3's pixel-shuffle scale factor
    image_mean: list[float]
    image_std: list[float]
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL filter (3: bicubic)
    image_start_token_id: int | None = None  # qwen2_vl: <|vision_start|>
    image_end_token_id: int | None = None  # qwen2_vl: <|vision_end|>
    temporal_patch_size: int | None = None  # qwen2_vl
    min_pixels: int | None = None  # qwen2_vl
    max_pixels: int | None = None  # qwen2_vl
    mrope_section: list[int] | None = None  # qwen2_vl: M-RoPE's split of head_dim / 2 over (t, h, w)
    rotary_dim: int | None = None  # qwen2_vl: the merger's rotary_pos_emb width (vision head_dim / 2)
    tile_size: int | None = None  # idefics3: pixels per tile edge (the vision encoder's image size)
    resize_longest_edge: int | None = None  # idefics3
    image_splitting: bool = False  # idefics3
    tokens_per_tile: int | None = None  # idefics3: (tile_size / patch_size / merge_size) ** 2
    image_wrap_token: str | None = None  # idefics3: <fake_token_around_image>
    global_image_token: str | None = None  # idefics3: <global-img>
    image_processor_file: str = "preprocessor_config.json"  # the source's, copied for reference


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
    vision: Vision | None = None  # vision-language models only (omitted from the file otherwise)

    @property
    def is_encoder(self) -> bool:
        return self.task in ("embed", "rerank")

    @property
    def is_vlm(self) -> bool:
        return self.vision is not None

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / MANIFEST_NAME
        data = asdict(self)
        if data["vision"] is None:
            del data["vision"]
        path.write_text(json.dumps(data, indent=2) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> Manifest:
        path = Path(directory) / MANIFEST_NAME
        if not path.is_file():
            raise FileNotFoundError(f"{directory}: no {MANIFEST_NAME}; export the model first (python -m export)")
        data = json.loads(path.read_text())
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        if isinstance(fields.get("vision"), dict):
            fields["vision"] = Vision(**{k: v for k, v in fields["vision"].items() if k in Vision.__dataclass_fields__})
        return cls(**fields)
