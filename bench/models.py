"""Random-weight models for the benchmarks, built without downloading anything: a ~250M Llama large enough that
the matmuls, not Python, dominate a step (the default model has 135M parameters), and models with the exact
shapes of the ones edge boxes really serve (Qwen2.5-0.5B / 1.5B, Llama-3.2-1B / 3B: the config.json geometry,
vocabulary width, tied embeddings, Qwen's QKV bias through the Qwen2 architecture, RoPE theta and Llama 3's
scaling, max positions), exported int8 / int4 for bench/sizes.py. Random weights time the same kernels as trained
ones; they only say nothing about quality or speculative acceptance.

Every model gets the same byte-level BPE tokenizer, trained once with `tokenizers` on a synthetic corpus (as
tests/tiny_models.py does) with 32000 tokens, 3 of them special (ids 0-2): a tokenizer smaller than the model's
vocabulary is fine (Qwen2.5's own is 151665 of 151936), the LM head width is what matters for speed. Everything
lives under `appliance.paths.data_dir()/bench/<name>/`: `hf/` (bf16 safetensors in 1 GB shards: half the disk and
build memory of fp32, and the exporter, which loads fp32 anyway, has one shard mapped at a time) and
`openvino-<format>/`. Built once, then cached; never in `make test`.
Measured on the 2-vCPU box: qwen2.5-1.5b 2.5-4.5 min per format at 9.1 GiB peak RSS (the exporter's fp32 load and
trace), qwen2.5-0.5b both formats in 2.5 min at 3.3 GiB. llama-3.2-3b: random weights 3.1 min at 7.1 GiB; int4
export 5.9 min of CPU (18.6 min wall, ~8 of them paused by another job's benchmark) at 14.3 GiB peak RSS: 12.9 GiB
while loading (the fp32 model; 0.7 GiB of it the mapped shard), 12.9 while tracing, 14.3 while NNCF compresses
(the fp32 IR read back mapped, 12.1 GiB of clean file pages the kernel can drop, + 2.1 GiB). Build one model at a
time.

    python -m bench.models [fp16] [int8]                      # random-llama-250m (both formats by default)
    python -m bench.models --model qwen2.5-1.5b int8 int4     # a family shape (--drop-hf: delete hf/ after)
    python -m bench.models --model llama-3.2-3b int4          # then its GGUF: bench/gguf.py --model llama-3.2-3b
"""

from __future__ import annotations

import gc
import json
import random
import shutil
import sys
from pathlib import Path
from typing import Any

from appliance.paths import data_dir

NAME = "random-llama-250m"
SEED = 1234
# The exporter loads a checkpoint shard by shard; a mapped shard's pages count in its RSS until the shard is done.
SHARD_SIZE = "1GB"
VOCAB_SIZE = 32000  # the tokenizer's (and random-llama-250m's LM head)
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
_QWEN2 = dict(rms_norm_eps=1e-6, rope_theta=1000000.0, use_sliding_window=False, hidden_act="silu")
_LLAMA32 = dict(  # what Llama-3.2-1B and -3B share: vocabulary width, llama3 RoPE scaling, tied embeddings
    vocab_size=128256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    tie_word_embeddings=True,
)
# name -> (transformers architecture, config): the geometry of each model's published config.json (the Instruct
# variants); token ids are our tokenizer's. Qwen2 adds the q/k/v projection bias by architecture.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    NAME: ("llama", CONFIG),
    "qwen2.5-0.5b": (
        "qwen2",
        dict(
            _QWEN2,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=32768,
            sliding_window=32768,
            max_window_layers=21,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2.5-1.5b": (
        "qwen2",
        dict(
            _QWEN2,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=32768,
            sliding_window=32768,
            max_window_layers=21,
            tie_word_embeddings=True,
        ),
    ),
    "llama-3.2-1b": (
        "llama",
        dict(
            _LLAMA32,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
        ),
    ),
    "llama-3.2-3b": (
        "llama",
        dict(
            _LLAMA32,
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=28,
            num_attention_heads=24,
            num_key_value_heads=8,
            head_dim=128,
        ),
    ),
}


def root(name: str = NAME) -> Path:
    return data_dir() / "bench" / name


def _corpus(n_lines: int = 20000):
    """Pseudo-words from syllables, Zipf-free but deterministic: enough distinct pairs for 32000 merges."""
    rng = random.Random(SEED)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiou"] + list("aeiou")
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(60000)]
    for _ in range(n_lines):
        yield " ".join(rng.choice(words) for _ in range(30)) + "."


def _tokenizer_json() -> Path:
    """The trained tokenizer.json, cached beside the models (training takes a while; every model shares it)."""
    path = data_dir() / "bench" / f"tokenizer-{VOCAB_SIZE}.json"
    if path.is_file():
        return path
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
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.staging")
    tok.save(str(staging))
    staging.rename(path)
    return path


def _write_tokenizer(folder: Path, max_positions: int) -> None:
    shutil.copyfile(_tokenizer_json(), folder / "tokenizer.json")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[BOS_ID],
        "model_max_length": max_positions,
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


def ensure_hf_folder(name: str = NAME) -> Path:
    """The HF folder of model `name` (a key of FAMILIES), built on first use. random-llama-250m keeps its fp32
    weights (what its exports were made from); the family shapes are created and saved in bf16 (a 1.5B model:
    3 GB instead of 6)."""
    folder = root(name) / "hf"
    if (folder / "tokenizer_config.json").is_file() and (folder / "config.json").is_file():
        return folder
    import torch
    import transformers

    arch, config = FAMILIES[name]
    staging = folder.with_name(".hf-staging")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    torch.manual_seed(SEED)
    config_class = transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config
    hf_config = config_class(**{"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, **config})
    dtype = torch.float32 if name == NAME else torch.bfloat16
    print(f"{name}: creating random {arch} weights ({dtype})", file=sys.stderr, flush=True)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters", file=sys.stderr, flush=True)
    model.save_pretrained(staging, max_shard_size=SHARD_SIZE)
    del model
    gc.collect()
    _write_tokenizer(staging, config["max_position_embeddings"])  # last: its presence marks a complete folder
    staging.rename(folder)
    return folder


def ensure_model(name: str, weight_format: str, *, drop_hf: bool = False) -> Path:
    """The OpenVINO export of model `name` in `weight_format` (built on first use, then cached); `drop_hf`
    deletes the HF folder afterwards (disk: 3 GB for the 1.5B shape)."""
    from appliance.manifest import MANIFEST_NAME

    out = root(name) / f"openvino-{weight_format}"
    if not (out / MANIFEST_NAME).is_file():
        from export.exporter import export_model

        export_model(ensure_hf_folder(name), out, "openvino", weight_format, name=name)
    if drop_hf:
        shutil.rmtree(root(name) / "hf", ignore_errors=True)
    return out


def ensure_random_llama(weight_format: str = "fp16") -> Path:
    """The OpenVINO export of the random Llama in `weight_format` (built on first use, then cached)."""
    return ensure_model(NAME, weight_format)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("formats", nargs="*", default=["fp16", "int8"], help="weight formats to export (fp16 int8 int4)")
    ap.add_argument("--model", default=NAME, choices=list(FAMILIES))
    ap.add_argument("--drop-hf", action="store_true", help="delete the HF folder once every format is exported")
    args = ap.parse_args(argv)
    for k, fmt in enumerate(args.formats):
        print(ensure_model(args.model, fmt, drop_hf=args.drop_hf and k == len(args.formats) - 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
