"""Random-weight vision-language models for bench/vlm.py, built from configs without downloading anything (as
bench/models.py builds the text shapes and tests/tiny_vlms.py the tiny VLMs): the exact geometry of Qwen2-VL-2B-
Instruct (a 1.5B Qwen2 language model with M-RoPE, a 32-layer 675M vision transformer, 14-pixel patches merged 2x2)
and of SmolVLM-256M-Instruct (Idefics3: a 135M-class Llama, a 12-layer SigLIP on 512-pixel tiles, 64 tokens a tile).
Random weights time the same kernels as trained ones; the answers mean nothing.

The tokenizer is bench/models.py's 32000-token BPE plus each family's image tokens (ids 32000 and up); the chat
template and preprocessor_config.json are the published ones (pixel limits, mean and std). Everything lives under
`appliance.paths.data_dir()/bench/<name>/`: `hf/` (bf16 safetensors) and `openvino-<format>/`, the latter written by
`python -m export` in a child process (the build prints its wall time and peak RSS; one model at a time).
Measured, Qwen2-VL-2B int4 on the 2-vCPU box under other agents' load: random weights 3 min; export peak RSS 12.8
GiB (the fp32 model, 8.8 GB, loaded from its one 4.4 GB shard, then traced), conversion 3.4 min, 15.6 min wall
in all with ~8 min of it paused by another job's benchmark. It was 19.5 GiB and 17.4 min (15 in conversion) while
the exporter let torch.jit.trace check its trace, which re-ran the 32-layer vision transformer
(export/vlm.py _no_trace_check). SmolVLM-256M int4: export 5 min, peak RSS 3.0 GiB.

    nice python -m bench.vlm_models                            # qwen2-vl-2b, int4
    nice python -m bench.vlm_models --model smolvlm-256m int4 int8
"""

from __future__ import annotations

import argparse
import gc
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.models import BOS_ID, EOS_ID, SEED, SPECIAL_TOKENS, _tokenizer_json, root
from bench.models import FAMILIES as FAMILIES_TEXT

QWEN2_VL_TEMPLATE = (  # Qwen2-VL-Instruct's chat_template (videos and vision ids included, as published)
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: "
    "{% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)
SMOLVLM_TEMPLATE = (  # SmolVLM-Instruct's chat_template
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
QWEN2_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
SMOLVLM_TOKENS = [
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
]
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]

# name -> (image-token scheme, added tokens, chat template): the published configs' values below.
FAMILIES: dict[str, tuple[str, list[str], str]] = {
    "qwen2-vl-2b": ("qwen2_vl", QWEN2_VL_TOKENS, QWEN2_VL_TEMPLATE),
    "smolvlm-256m": ("idefics3", SMOLVLM_TOKENS, SMOLVLM_TEMPLATE),
}


def _qwen2_vl(ids: dict[str, int]) -> tuple[Any, Any]:
    """Qwen2-VL-2B-Instruct's config.json and preprocessor_config.json (token ids: ours)."""
    from transformers import Qwen2VLConfig, Qwen2VLImageProcessor

    text = dict(  # the language model is Qwen2-1.5B's shape, the same as Qwen2.5-1.5B's
        FAMILIES_TEXT["qwen2.5-1.5b"][1],
        max_window_layers=28,
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=dict(
            depth=32,
            embed_dim=1280,
            hidden_size=1536,
            mlp_ratio=4,
            num_heads=16,
            in_channels=3,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    images = Qwen2VLImageProcessor(
        min_pixels=3136,
        max_pixels=12845056,
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
    )
    return config, images


def _smolvlm(ids: dict[str, int]) -> tuple[Any, Any]:
    """SmolVLM-256M-Instruct's config.json and preprocessor_config.json (token ids: ours)."""
    from transformers import Idefics3Config, Idefics3ImageProcessor

    config = Idefics3Config(
        text_config=dict(
            model_type="llama",
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49280,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            rope_theta=100000.0,
            tie_word_embeddings=False,
            bos_token_id=BOS_ID,
            eos_token_id=ids["<end_of_utterance>"],
            pad_token_id=BOS_ID,
        ),
        vision_config=dict(
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            image_size=512,
            patch_size=16,
        ),  # fmt: skip
        image_token_id=ids["<image>"],
        scale_factor=4,
        pad_token_id=BOS_ID,
        tie_word_embeddings=False,
    )
    images = Idefics3ImageProcessor(
        size={"longest_edge": 2048}, max_image_size={"longest_edge": 512}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    return config, images


def _tokenizer(added: list[str], template: str, eos: str) -> Any:
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_file(str(_tokenizer_json()))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=SPECIAL_TOKENS[BOS_ID],
        eos_token=eos,
        pad_token=SPECIAL_TOKENS[BOS_ID],
        additional_special_tokens=added,
        chat_template=template,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )


def ensure_hf_folder(name: str) -> Path:
    """The HF folder of `name` (a key of FAMILIES): config, bf16 random weights, tokenizer with the chat template,
    preprocessor_config.json (Idefics3: processor_config.json too), built on first use."""
    folder = root(name) / "hf"
    if (folder / "preprocessor_config.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    scheme, added, template = FAMILIES[name]
    eos = "<end_of_utterance>" if scheme == "idefics3" else SPECIAL_TOKENS[EOS_ID]
    tokenizer = _tokenizer(added, template, eos)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in added}
    config, images = (_qwen2_vl if scheme == "qwen2_vl" else _smolvlm)(ids)
    staging = folder.with_name(".hf-staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    torch.manual_seed(SEED)
    print(f"{name}: creating random {scheme} weights (bf16)", file=sys.stderr, flush=True)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters", file=sys.stderr, flush=True)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(staging)
    del model
    gc.collect()
    tokenizer.save_pretrained(staging)
    if scheme == "idefics3":
        from transformers import Idefics3Processor

        Idefics3Processor(images, tokenizer, image_seq_len=64, chat_template=template).save_pretrained(staging)
    images.save_pretrained(staging)  # last: its presence marks a complete folder
    staging.rename(folder)
    return folder


def ensure_model(name: str, weight_format: str = "int4") -> Path:
    """The OpenVINO export of `name` in `weight_format`, by `python -m export` in a child process (built on first
    use, then cached). Prints the export's wall time and peak RSS."""
    from appliance.manifest import MANIFEST_NAME

    out = root(name) / f"openvino-{weight_format}"
    if (out / MANIFEST_NAME).is_file():
        return out
    src = ensure_hf_folder(name)
    cmd = [sys.executable, "-m", "export", str(src), str(out), "--weight-format", weight_format, "--name", name]
    start = time.monotonic()
    subprocess.run(cmd, check=True)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    print(f"{name} {weight_format}: {time.monotonic() - start:.0f} s, peak RSS {peak:.1f} GiB", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=" ".join((__doc__ or "").split("\n\n")[0].split()))
    ap.add_argument("formats", nargs="*", default=["int4"], help="weight formats to export (fp16 int8 int4)")
    ap.add_argument("--model", default="qwen2-vl-2b", choices=list(FAMILIES))
    args = ap.parse_args(argv)
    for fmt in args.formats:
        print(ensure_model(args.model, fmt))
    return 0


if __name__ == "__main__":
    sys.exit(main())
