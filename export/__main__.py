"""`python -m export SRC OUT` (also `appliance-export`): export a local HF causal-LM folder for the appliance.

A vision-language model folder (Qwen2-VL, Idefics3/SmolVLM-style) goes to export/vlm.py, by its config's model_type.
An encoder folder (a sentence-transformers folder or a BERT/RoBERTa/XLM-R model; a cross-encoder for rerank) goes
to export/encoder.py instead, by its config's model_type or by `--task embed|rerank`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from export.exporter import BACKENDS, WEIGHT_FORMATS, ExportError, export_model
from export.graph import WeightOptions


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export", description=__doc__.split("\n")[0].split(": ", 1)[-1])
    parser.add_argument("src", type=Path, help="local Hugging Face model folder (config.json, weights, tokenizer)")
    parser.add_argument("out", type=Path, help="folder to create with the exported model")
    parser.add_argument("--backend", choices=list(BACKENDS), default="openvino")
    parser.add_argument("--weight-format", choices=WEIGHT_FORMATS, default="fp16")
    parser.add_argument("--name", help="served model name (default: the source folder's name)")
    parser.add_argument(
        "--group-size",
        type=int,
        help="quantization group: OpenVINO int4 (default 128; -1 per output channel; int8 is per-channel), "
        "ONNX int4/int8 block size (default 32)",
    )
    parser.add_argument("--sym", action="store_true", help="OpenVINO int8/int4: symmetric weights (no zero point)")
    parser.add_argument("--ratio", type=float, default=1.0, help="OpenVINO int4: layers in int4 (share), the rest int8")
    parser.add_argument(
        "--lm-head",
        choices=("int8", "int4"),
        default="int8",
        help="OpenVINO int4: the embeddings and LM head in int8 (default) or int4",
    )
    parser.add_argument(
        "--requantize",
        action="store_true",
        help="OpenVINO int4/int8: quantize with NNCF even when the source weights are already on a 4-bit grid (a "
        "model dequantized from a Q4_1 GGUF, like the default model), which is otherwise kept on that grid",
    )
    parser.add_argument(
        "--num-layers",
        type=int,
        metavar="N",
        help="keep only the first N decoder layers (embeddings, final norm and LM head kept): a truncated copy, "
        "e.g. a draft model for --draft-model",
    )
    parser.add_argument(
        "--task",
        choices=("embed", "rerank"),
        help="export an encoder: embeddings, or a cross-encoder for rerank (default: from the folder)",
    )
    parser.add_argument(
        "--pooling", choices=("mean", "cls", "last"), help="encoders: override the folder's pooling (default mean)"
    )
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--verbose", action="store_true", help="show library warnings and logs")
    args = parser.parse_args(argv)
    start = time.monotonic()
    weights = WeightOptions(args.group_size, args.sym, args.ratio, args.lm_head, args.requantize)
    common = {"name": args.name, "force": args.force, "verbose": args.verbose}
    try:
        if args.task or args.pooling or _is_encoder(args.src):
            from export.encoder import export_encoder

            encoder = {"task": args.task, "pooling": args.pooling}
            manifest = export_encoder(args.src, args.out, args.backend, args.weight_format, **common, **encoder)
        elif _is_vlm(args.src):
            from export.vlm import export_vlm

            if args.num_layers is not None:
                raise ExportError("--num-layers does not apply to vision-language models")

            manifest = export_vlm(args.src, args.out, args.backend, args.weight_format, **common, weights=weights)
        else:
            llm = {"weights": weights, "num_layers": args.num_layers}
            manifest = export_model(args.src, args.out, args.backend, args.weight_format, **common, **llm)
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    task = "" if manifest.task == "generate" else f"{manifest.task}, "
    print(
        f"exported {manifest.name} ({manifest.architecture}, {task}{manifest.backend} {manifest.weight_format}) "
        f"to {args.out} in {time.monotonic() - start:.1f}s",
        file=sys.stderr,
    )
    return 0


def _is_encoder(src: Path) -> bool:
    from export.encoder import ENCODER_TYPES

    try:
        return json.loads((src / "config.json").read_text()).get("model_type") in ENCODER_TYPES
    except (OSError, ValueError):
        return False  # export_model says what is wrong with the folder


def _is_vlm(src: Path) -> bool:
    from export.vlm import is_vlm

    return is_vlm(src)


if __name__ == "__main__":
    sys.exit(main())
