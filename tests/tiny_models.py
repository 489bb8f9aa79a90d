"""Tiny random-weight Hugging Face causal-LM folders for export and runtime tests.

Nothing may be downloaded here, so each family is built from its config class with a fixed seed, plus a real
byte-level BPE tokenizer trained on a few sentences. The folders vary on purpose in how they ship their chat
template, generation config and dtype, so the exporter's handling of each variant gets exercised.

`python tests/tiny_models.py OUT_DIR` writes every family to OUT_DIR/<family> for manual experiments.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SEED = 1234
VOCAB_SIZE = 1000
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 0, 2  # <|endoftext|>, <|im_end|>
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The appliance serves language models on small Intel machines.",
    "OpenVINO and ONNX Runtime run the exported graphs without PyTorch.",
    "A tiny model with random weights still needs a real tokenizer and a chat template.",
    "Paged attention keeps the key and value cache in fixed size blocks.",
    "Hello world! How are you today? I am fine, thank you.",
    "Numbers like 12345 and 3.14159 are split into bytes when they are rare.",
    "def main():\n    print('hello, world')\n    return 0\n",
]

COMMON = dict(  # the decoder geometry every tiny family shares (tests/tiny_vlms.py too)
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB_SIZE,
    max_position_embeddings=512,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=None,
)

# family -> (config class name, config kwargs, how the folder is laid out)
FAMILIES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(COMMON, tie_word_embeddings=True), dict(template="tokenizer_config", eos_list=True)),
    "qwen2": ("Qwen2Config", dict(COMMON), dict(template="jinja_file")),
    "qwen3": ("Qwen3Config", dict(COMMON, head_dim=32), dict(template="jinja_file", eos_list=True)),
    "mistral": (
        "MistralConfig",
        dict(COMMON, sliding_window=None),
        dict(template="tokenizer_config", dtype="bfloat16"),
    ),
    "phi3": ("Phi3Config", dict(COMMON, pad_token_id=EOS_ID), dict(template="tokenizer_config")),
    "gpt2": (
        "GPT2Config",
        dict(
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_inner=128,
            vocab_size=VOCAB_SIZE,
            n_positions=256,
            bos_token_id=BOS_ID,
            eos_token_id=BOS_ID,
        ),
        dict(template=None, generation_config=False),
    ),
}
# Families beyond the required six that the exporter also supports; phi and gpt_neox have no GQA
# (optimum cannot export phi with it).
EXTRA_FAMILIES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "gemma": ("GemmaConfig", dict(COMMON, head_dim=32), dict(template="tokenizer_config")),
    "granite": ("GraniteConfig", dict(COMMON), dict(template="tokenizer_config")),
    "olmo2": ("Olmo2Config", dict(COMMON), dict(template="tokenizer_config")),
    "smollm3": ("SmolLM3Config", dict(COMMON), dict(template="jinja_file")),
    "stablelm": ("StableLmConfig", dict(COMMON), dict(template="tokenizer_config")),
    "phi": ("PhiConfig", dict(COMMON, num_key_value_heads=None), dict(template="tokenizer_config")),
    "gpt_neox": ("GPTNeoXConfig", dict(COMMON, num_key_value_heads=None), dict(template="tokenizer_config")),
}


def train_tokenizer(special_tokens: list[str] | None = None):
    """A byte-level BPE trained on CORPUS; `special_tokens` (default SPECIAL_TOKENS) take the first ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=special_tokens or SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def _write_tokenizer(folder: Path, template: str | None) -> None:
    tok = train_tokenizer()
    assert tok.get_vocab_size() <= VOCAB_SIZE
    tok.save(str(folder / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[BOS_ID],
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for i, t in enumerate(SPECIAL_TOKENS)
        },
    }
    if template == "tokenizer_config":
        config["chat_template"] = CHAT_TEMPLATE
    elif template == "jinja_file":
        (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special = {
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[BOS_ID],
    }
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def build_tiny_model(family: str, folder: Path) -> Path:
    """Writes the tiny `family` model to `folder` (created) and returns it."""
    import torch
    import transformers

    config_cls, config_kwargs, layout = {**FAMILIES, **EXTRA_FAMILIES}[family]
    config = getattr(transformers, config_cls)(**config_kwargs)
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if layout.get("dtype") == "bfloat16":
        model = model.to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    gen = folder / "generation_config.json"
    if layout.get("generation_config", True):
        data = json.loads(gen.read_text())
        data["eos_token_id"] = [EOS_ID, BOS_ID] if layout.get("eos_list") else EOS_ID
        gen.write_text(json.dumps(data, indent=2))
    else:
        gen.unlink(missing_ok=True)
    _write_tokenizer(folder, layout["template"])
    return folder


if __name__ == "__main__":
    root = Path(sys.argv[1])
    for name in {**FAMILIES, **EXTRA_FAMILIES}:
        print(build_tiny_model(name, root / name))
