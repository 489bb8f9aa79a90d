"""A ~250M-parameter random-weight Llama for the benchmarks: large enough that the matmuls, not Python,
dominate a step (the default model has 135M parameters), built without downloading anything.

Hidden 1024, 16 layers, 16 heads / 4 KV heads, intermediate 2816, vocab 32000, fixed seed; a byte-level BPE
tokenizer trained with `tokenizers` on a synthetic corpus (as tests/tiny_models.py does, with a full 32000-token
vocabulary). Built once and exported to OpenVINO fp16 and int8 under `appliance.paths.data_dir()/bench/`.

    python -m bench.models [fp16] [int8]   # build + export (both formats by default; idempotent)
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from appliance.paths import data_dir

NAME = "random-llama-250m"
SEED = 1234
VOCAB_SIZE = 32000
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 0, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONFIG = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=VOCAB_SIZE,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    tie_word_embeddings=False,
)


def root() -> Path:
    return data_dir() / "bench" / NAME


def _corpus(n_lines: int = 20000):
    """Pseudo-words from syllables, Zipf-free but deterministic: enough distinct pairs for 32000 merges."""
    rng = random.Random(SEED)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiou"] + list("aeiou")
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(60000)]
    for _ in range(n_lines):
        yield " ".join(rng.choice(words) for _ in range(30)) + "."


def _write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB_SIZE
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[BOS_ID],
        "model_max_length": CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
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
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "bos_token": SPECIAL_TOKENS[BOS_ID],
                "eos_token": SPECIAL_TOKENS[EOS_ID],
                "pad_token": SPECIAL_TOKENS[BOS_ID],
            },
            indent=2,
        )
    )


def ensure_hf_folder() -> Path:
    folder = root() / "hf"
    if (folder / "tokenizer_config.json").is_file() and (folder / "config.json").is_file():
        return folder
    import torch
    import transformers

    staging = folder.with_name(".hf-staging")
    if staging.exists():
        import shutil

        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG), dtype=torch.float32)
    model.save_pretrained(staging)
    _write_tokenizer(staging)  # last: its presence marks a complete folder
    staging.rename(folder)
    return folder


def ensure_random_llama(weight_format: str = "fp16") -> Path:
    """The OpenVINO export of the random Llama in `weight_format` (built on first use, then cached)."""
    from appliance.manifest import MANIFEST_NAME

    out = root() / f"openvino-{weight_format}"
    if (out / MANIFEST_NAME).is_file():
        return out
    from export.exporter import export_model

    export_model(ensure_hf_folder(), out, "openvino", weight_format, name=NAME)
    return out


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("formats", nargs="*", default=["fp16", "int8"], help="weight formats to export (fp16 int8)")
    for fmt in ap.parse_args(argv).formats:
        print(ensure_random_llama(fmt))
    return 0


if __name__ == "__main__":
    sys.exit(main())
