"""Tiny random-weight encoder folders: a sentence-transformers embedding model and a cross-encoder reranker.

No cross-encoder is on PyPI and nothing may be downloaded, so the rerank tests and the fidelity target use a random
`BertForSequenceClassification` (one label) built here from a small config with a fixed seed, with a real WordPiece
tokenizer trained on a few sentences. The embedding folder has sentence-transformers' layout (modules.json,
1_Pooling/config.json, sentence_bert_config.json), so the exporter reads pooling, normalize and max length from it.

`python tests/tiny_encoders.py OUT_DIR` writes each kind to OUT_DIR/<kind>.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SEED = 4321
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
CORPUS = [
    "The appliance serves language models and embeddings on small Intel machines.",
    "Retrieval finds the manual page that answers a question about the device.",
    "A reranker scores each document against the query; the best ones come first.",
    "Sentence embeddings are vectors; similar sentences have a high cosine similarity.",
    "Logs, tickets and manuals are searched on the box itself, without a second server.",
    "Numbers like 12345 and 3.14159 and words like héllo wörld get split into pieces.",
]
KINDS = ("embed-mean", "embed-cls", "embed-roberta", "rerank")
MAX_SEQ_LENGTH = 48


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=400, special_tokens=SPECIAL))
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    tokenizer.decoder = decoders.WordPiece()
    # As sentence-transformers folders ship it: the runtime must switch these off.
    tokenizer.enable_truncation(16)
    tokenizer.enable_padding(length=16, pad_id=0, pad_token="[PAD]")
    return tokenizer


def build(kind: str, out: Path) -> Path:
    """Writes the `kind` folder (KINDS) to `out` and returns it."""
    import torch
    import transformers

    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose from {', '.join(KINDS)}")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]"})
    )
    common = dict(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    torch.manual_seed(SEED)
    if kind == "rerank":
        # BERT's default init (std 0.02) gives every pair the same score to 3 decimals; std 0.5 spreads them over
        # a few units, so an equal order means something.
        config = transformers.BertConfig(**common, num_labels=1, initializer_range=0.5)
        model = transformers.BertForSequenceClassification(config)
    elif kind == "embed-roberta":
        config = transformers.RobertaConfig(**common, type_vocab_size=1)
        model = transformers.RobertaModel(config, add_pooling_layer=False)
    else:
        config = transformers.BertConfig(**common)
        model = transformers.BertModel(config, add_pooling_layer=False)
    model.eval().save_pretrained(out, safe_serialization=True)
    if kind.startswith("embed"):
        pooling = "cls" if kind == "embed-cls" else "mean"
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]
        if kind != "embed-cls":  # the CLS one is left unnormalized, so both settings get exercised
            modules.append(
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
            )
        (out / "modules.json").write_text(json.dumps(modules, indent=2))
        (out / "1_Pooling").mkdir(exist_ok=True)
        (out / "1_Pooling" / "config.json").write_text(
            json.dumps(
                {
                    "word_embedding_dimension": common["hidden_size"],
                    "pooling_mode_cls_token": pooling == "cls",
                    "pooling_mode_mean_tokens": pooling == "mean",
                    "pooling_mode_max_tokens": False,
                    "pooling_mode_mean_sqrt_len_tokens": False,
                }
            )
        )
        (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_SEQ_LENGTH}))
    return out


if __name__ == "__main__":
    root = Path(sys.argv[1])
    for name in KINDS:
        print(build(name, root / name))
