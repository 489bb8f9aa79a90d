"""Tiny random-weight vision-language model folders for export tests, built from configs (nothing downloaded).

Two families with different image-token schemes:
- `qwen2_vl`: dynamic resolution (the image is resized to a multiple of 28 pixels and cut into 14x14 patches;
  every 2x2 patches become one token) and M-RoPE (3-axis positions) in the language model.
- `idefics3`: fixed tiles (the image is resized, split into 32x32 tiles plus a downscaled global tile; each tile
  gives `image_seq_len` tokens after the pixel shuffle) and plain 1-D positions in a Llama language model.

Each folder is what the hub ships: config.json and weights, tokenizer.json + tokenizer_config.json, the chat
template, preprocessor_config.json and processor_config.json, saved by the family's own processor class. The
tokenizer is tests/tiny_models.py's BPE trained with the family's special tokens.

`python tests/tiny_vlms.py OUT_DIR` writes each family to OUT_DIR/<family>.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tests import tiny_models

SEED = 2024
FAMILIES = ("qwen2_vl", "idefics3")
IMAGE_SIZE = (40, 56)  # (height, width) of the test image: not square, not a multiple of any patch

QWEN_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IDEFICS_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>"]
IDEFICS_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
_TEXT = tiny_models.COMMON


def _tokenizer(special: list[str], cls: str = "PreTrainedTokenizerFast") -> Any:
    import transformers

    tokenizer = getattr(transformers, cls)(
        tokenizer_object=tiny_models.train_tokenizer(special),
        bos_token=special[0],
        eos_token=special[2],
        pad_token=special[0],
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": special[3:]})
    return tokenizer


def _qwen2_vl(folder: Path) -> None:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor

    tokenizer = _tokenizer(QWEN_SPECIAL, "Qwen2TokenizerFast")  # the processor checks the class
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    config = Qwen2VLConfig(
        text_config=dict(_TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),  # head_dim 16: 8 pairs
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=0,
        eos_token_id=2,
    )
    model = Qwen2VLForConditionalGeneration(config)
    model.save_pretrained(folder)
    # Qwen2-VL's own 14x14-pixel patches merged 2x2 (optimum's trace inputs assume 14): one token per 28x28 pixels,
    # at most 16 tokens (112 x 112 pixels) per image.
    images = Qwen2VLImageProcessor(patch_size=14, merge_size=2, min_pixels=56 * 56, max_pixels=112 * 112)
    # Qwen2VLProcessor insists on a video processor, which needs torchvision (not installed; videos are not
    # exported): the image processor and the tokenizer with its template are saved on their own, as on the hub.
    images.save_pretrained(folder)
    tokenizer.chat_template = QWEN_TEMPLATE
    tokenizer.save_pretrained(folder)


def _idefics3(folder: Path) -> None:
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor, Idefics3Processor

    tokenizer = _tokenizer(IDEFICS_SPECIAL)
    config = Idefics3Config(
        text_config=dict(_TEXT, model_type="llama", pad_token_id=0),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=2,
        pad_token_id=0,
    )
    model = Idefics3ForConditionalGeneration(config)
    model.save_pretrained(folder)
    # Images are resized to a longest edge of 64, split into 32x32 tiles, plus the whole image at 32x32; each tile
    # is 4x4 patches of 8 pixels, shuffled 2x2 into 4 tokens.
    images = Idefics3ImageProcessor(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    processor = Idefics3Processor(images, tokenizer, image_seq_len=4, chat_template=IDEFICS_TEMPLATE)
    processor.save_pretrained(folder)


def build(family: str, folder: Path) -> Path:
    """Writes the tiny `family` VLM (FAMILIES) to `folder` (created) and returns it."""
    import torch

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    {"qwen2_vl": _qwen2_vl, "idefics3": _idefics3}[family](folder)
    return folder


def image(seed: int = 0) -> Any:
    """A random RGB test image (PIL) of IMAGE_SIZE."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*IMAGE_SIZE, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def prepared(encoder: Any, prompt_ids: list[int], files: list[bytes], max_pixels: int, scope: str = "") -> Any:
    """VisionEncoder.prepare as the engine's admission runs it: the files' plans (each header read once), then the
    prompt expanded and the images encoded from those plans."""
    return encoder.prepare(prompt_ids, encoder.plans(files, max_pixels), max_pixels, scope)


if __name__ == "__main__":
    root = Path(sys.argv[1])
    for name in FAMILIES:
        print(build(name, root / name))
