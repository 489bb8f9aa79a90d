"""Embeddings in-process: fidelity to the source model and sentences/s against openvino_genai and torch.

Fidelity: cosine similarity of each export's vectors to sentence-transformers' own (computed by hand in torch on the
transformers model: export.encoder.torch_reference, the same arithmetic as its Pooling and Normalize modules) on
held-out sentences (HELD_OUT: none of them is in tests/runtime/test_encoder.py; the int8 export is data-free, so
nothing saw
them), at f32 compute and at the device's default precision.

Throughput: the corpus embedded in batches of 1, 8 and 32 by
- `appliance`: appliance.runtime.encoder.Encoder (tokenize + truncate + one padded forward per batch + pooling);
- `genai`: openvino_genai.TextEmbeddingPipeline on the same IR (its own tokenizer IR converted from the same
  tokenizer.json, mean pooling, normalize, max_length as the manifest says), the same plugin properties;
- `torch`: transformers' AutoModel + the fast tokenizer + the same pooling in torch (what sentence-transformers
  runs on CPU, minus its Python wrapper).
Each repetition runs every side back to back, rotating which goes first; medians over repetitions. The box is
shared (other agents' work shows in machine_before/after's busy_processes): read the ratios, not the absolutes.
torch's OpenMP threads spin between kernels by default; on a loaded box a spinning thread waits for a preempted
one, which cost torch 4-10x at batch 1 (2-core box at load average 5: 2.0-6.0 sentences/s spinning against
19.5-23.1 with OMP_WAIT_POLICY=PASSIVE, 25-26 ms CPU a sentence against 123-249): `--torch-omp-wait passive`
gives torch the policy that suits a busy box (the default keeps torch's own, the better one on a quiet box).

    python -m bench.embeddings [--models fp32 int8] [--sentences 240] [--throughput-sentences 96] [--batches 1 8 32]
                               [--reps 5] [--quick] [--torch-omp-wait passive|active]
"""

from __future__ import annotations

import itertools
import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import arg_parser, machine, median, print_table, rotate, save_results
from bench.quality import PASSAGES

SIDES = ("appliance", "genai", "torch")
SETTLE_S = 1.0  # idle before each timed side: the previous side's worker threads stop spinning
SUBJECTS = (
    "The service technician",
    "Our night-shift operator",
    "A customer in Lisbon",
    "The monitoring script",
    "Every new employee",
    "The backup job",
    "A curious student",
    "The hospital's IT team",
)
ACTIONS = (
    "reported that the printer on the third floor jams whenever it prints double-sided pages",
    "asked how to export last month's invoices as a spreadsheet",
    "noticed the disk filling up after the nightly log rotation was disabled",
    "wants to know why the thermostat shows 19 degrees when the room feels much warmer",
    "could not connect to the VPN from a hotel network in Madrid",
    "measured a latency of 250 ms between the two data centres",
    "replaced the fan and the error code E17 disappeared",
    "is looking for the chapter of the manual about calibrating the scale",
    "found that restarting the router fixes the dropped video calls",
    "needs the warranty terms for a device bought in 2021",
)
ENDINGS = (
    ".",
    " yesterday afternoon.",
    ", but nobody has answered the ticket yet.",
    " and attached two screenshots and a short video of the problem as it happens.",
    "; the same thing happened last week on a different machine, so it may be a firmware issue.",
)


def held_out(n: int) -> list[str]:
    """`n` deterministic sentences (4-157 tokens): the quality bench's passages, their sentences, then templated
    support-desk sentences, in a fixed shuffled order."""
    texts = list(PASSAGES) + [s for p in PASSAGES for s in re.split(r"(?<=[.!?])\s+", p)]
    generated = [f"{s} {a}{e}" for s, a, e in itertools.product(SUBJECTS, ACTIONS, ENDINGS)]
    np.random.default_rng(7).shuffle(generated)
    texts += generated
    if n > len(texts):
        raise SystemExit(f"at most {len(texts)} held-out sentences")
    return texts[:n]


def fidelity(model_dirs: dict[str, Path], hf_dir: Path, texts: list[str]) -> list[dict]:
    import torch
    from transformers import AutoModel

    from appliance.runtime.encoder import Encoder
    from export.encoder import torch_reference

    reference_model = AutoModel.from_pretrained(hf_dir, dtype=torch.float32).eval()
    rows = []
    want = None
    for name, path in model_dirs.items():
        for precision in ("f32", None):
            encoder = Encoder(path, precision=precision)
            batch = [encoder.truncate(ids) for ids in encoder.tokenize(texts)]
            if want is None:
                with torch.no_grad():
                    want = np.concatenate(
                        [
                            torch_reference(reference_model, batch[i : i + 16], encoder.manifest)
                            for i in range(0, len(batch), 16)
                        ]
                    )
            got = np.concatenate([encoder.embed(batch[i : i + 16]) for i in range(0, len(batch), 16)])
            cos = np.sum(got * want, 1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
            rows.append(
                {
                    "export": name,
                    "precision": precision or "default",
                    "sentences": len(texts),
                    "min_cosine": float(cos.min()),
                    "median_cosine": float(np.median(cos)),
                    "max_abs_diff": float(np.abs(got - want).max()),
                }
            )
    return rows


class _Appliance:
    def __init__(self, path: Path) -> None:
        from appliance.runtime.encoder import Encoder

        self.encoder = Encoder(path)

    def __call__(self, texts: list[str]) -> Any:
        return self.encoder.embed([self.encoder.truncate(ids) for ids in self.encoder.tokenize(texts)])


class _Genai:
    """The same IR beside an OpenVINO tokenizer converted from the same tokenizer files, in a scratch folder."""

    def __init__(self, path: Path, scratch: Path) -> None:
        import openvino as ov
        import openvino_genai
        from openvino_tokenizers import convert_tokenizer
        from transformers import AutoTokenizer

        from appliance import cpu_isa
        from appliance.manifest import Manifest

        manifest = Manifest.load(path)
        scratch.mkdir(parents=True, exist_ok=True)
        for name in ("openvino_model.xml", "openvino_model.bin", "config.json", "tokenizer.json"):
            target = scratch / name
            if not target.exists():
                target.symlink_to(path / name)
        tokenizer_ir = convert_tokenizer(AutoTokenizer.from_pretrained(path), with_detokenizer=False)
        ov.save_model(tokenizer_ir, scratch / "openvino_tokenizer.xml")
        config = openvino_genai.TextEmbeddingPipeline.Config()
        config.pooling_type = {
            "mean": openvino_genai.TextEmbeddingPipeline.PoolingType.MEAN,
            "cls": openvino_genai.TextEmbeddingPipeline.PoolingType.CLS,
            "last": openvino_genai.TextEmbeddingPipeline.PoolingType.LAST_TOKEN,
        }[manifest.pooling or "mean"]
        config.normalize = manifest.normalize
        config.max_length = manifest.max_length
        from appliance.runtime.encoder import CPU_PROPERTIES

        props = {"PERFORMANCE_HINT": "LATENCY", **cpu_isa.plugin_properties(cpu_isa.detect(), None), **CPU_PROPERTIES}
        self.pipeline = openvino_genai.TextEmbeddingPipeline(str(scratch), "CPU", config, **props)

    def __call__(self, texts: list[str]) -> Any:
        return np.asarray(self.pipeline.embed_documents(texts))


class _Torch:
    def __init__(self, path: Path, hf_dir: Path) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        from appliance.manifest import Manifest

        self.manifest = Manifest.load(path)
        self.tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        self.model = AutoModel.from_pretrained(hf_dir, dtype=torch.float32).eval()

    def __call__(self, texts: list[str]) -> Any:
        import torch

        batch = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.manifest.max_length, return_tensors="pt"
        )
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
            weights = batch["attention_mask"].unsqueeze(-1).float()
            vectors = (hidden * weights).sum(1) / torch.clamp(weights.sum(1), min=1e-9)
            return torch.nn.functional.normalize(vectors, p=2, dim=1).numpy()


def order(sides: list[str], k: int) -> list[str]:
    """Run k's order: rotated by k, and reversed every other round of rotations, so each side goes first in turn
    AND follows each other side equally often (plain rotation keeps the cycle: one side would always run right
    after torch, whose OpenMP threads may still spin into the next side's time)."""
    rotated = rotate(sides, k)
    return rotated[::-1] if (k // len(sides)) % 2 else rotated


def agreement(sides: dict[str, Any], texts: list[str], when: str) -> dict[str, float]:
    """Each side's vectors against the torch side's on the same texts (min cosine): the sides compute the same
    thing, or their speeds mean nothing."""
    reference = sides["torch"](texts)
    found = {f"{name}_{when}": float(np.sum(side(texts) * reference, 1).min()) for name, side in sides.items()}
    print(f"min cosine to torch, {when}: " + ", ".join(f"{k}={v:.6f}" for k, v in found.items()), flush=True)
    return found


def throughput(
    path: Path, hf_dir: Path, texts: list[str], batches: list[int], reps: int, scratch: Path
) -> tuple[list[dict], dict[str, float]]:
    sides = {"appliance": _Appliance(path), "genai": _Genai(path, scratch), "torch": _Torch(path, hf_dir)}
    for side in sides.values():  # warm-up: compile caches, first-call allocations
        side(texts[:8])
    checks = agreement(sides, texts[:32], "before")
    runs = []
    for rep in range(reps):
        for b, size in enumerate(batches):
            for name in order(list(sides), rep * len(batches) + b):
                time.sleep(SETTLE_S)
                start, cpu = time.perf_counter(), time.process_time()
                for i in range(0, len(texts), size):
                    sides[name](texts[i : i + size])
                elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
                runs.append(
                    {
                        "rep": rep,
                        "batch": size,
                        "impl": name,
                        "sentences_s": len(texts) / elapsed,
                        "cpu_ms_per_sentence": cpu / len(texts) * 1e3,
                    }
                )
        print(f"rep {rep + 1}/{reps} done", flush=True)
    checks.update(agreement(sides, texts[:32], "after"))
    return runs, checks


def summary(runs: list[dict], batches: list[int]) -> list[dict]:
    rows = []
    for size in batches:
        row: dict[str, Any] = {"batch": size}
        for side in SIDES:
            row[side] = median(r["sentences_s"] for r in runs if r["batch"] == size and r["impl"] == side)
        by_rep: dict[int, dict[str, float]] = {}
        for r in runs:
            if r["batch"] == size:
                by_rep.setdefault(r["rep"], {})[r["impl"]] = r["sentences_s"]
        row["vs_genai"] = median(p["appliance"] / p["genai"] for p in by_rep.values())
        row["vs_torch"] = median(p["appliance"] / p["torch"] for p in by_rep.values())
        cpu: dict[int, dict[str, float]] = {}
        for r in runs:
            if r["batch"] == size:
                cpu.setdefault(r["rep"], {})[r["impl"]] = r["cpu_ms_per_sentence"]
        for side in SIDES:
            row[f"{side}_cpu_ms"] = median(c[side] for c in cpu.values())
        row["vs_genai_cpu"] = median(c["genai"] / c["appliance"] for c in cpu.values())  # > 1: we use less CPU
        row["vs_torch_cpu"] = median(c["torch"] / c["appliance"] for c in cpu.values())
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(
        __doc__,
        "embeddings",
        reps=5,
        prompt_len=None,
        new_tokens=None,
        quick={"reps": 1, "sentences": 64, "throughput_sentences": 64, "batches": [1, 32]},
    )
    ap.add_argument("--models", nargs="+", default=["fp32", "int8"], help="the default embedding model's formats")
    ap.add_argument("--throughput-model", default="int8", help="the format the throughput sweep runs")
    ap.add_argument("--sentences", type=int, default=240)
    ap.add_argument("--throughput-sentences", type=int, default=96, help="the first N of them timed per side and rep")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument(
        "--torch-omp-wait",
        choices=("passive", "active"),
        help="OMP_WAIT_POLICY for torch's OpenMP threads (default: torch's own, which spins between kernels)",
    )
    args = ap.parse_args(argv)
    if args.torch_omp_wait:  # read once, when torch loads its OpenMP runtime: set before the first import
        os.environ["OMP_WAIT_POLICY"] = args.torch_omp_wait.upper()

    from export.default_model import ensure_embedding_export, ensure_embedding_hf_folder

    before = machine()
    hf_dir = ensure_embedding_hf_folder()
    dirs = {
        fmt: ensure_embedding_export("openvino", fmt) for fmt in dict.fromkeys([*args.models, args.throughput_model])
    }
    texts = held_out(args.sentences)
    fid = fidelity({k: dirs[k] for k in args.models}, hf_dir, texts)
    print_table(
        fid,
        [
            ("export", "export", "s"),
            ("precision", "compute", "s"),
            ("sentences", "n", "d"),
            ("min_cosine", "min cos", ".6f"),
            ("median_cosine", "median cos", ".6f"),
            ("max_abs_diff", "max |diff|", ".2e"),
        ],
        title="fidelity to the source model (sentence-transformers' arithmetic in torch f32)",
    )
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-genai-") as scratch:
        timed = texts[: args.throughput_sentences]
        runs, checks = throughput(dirs[args.throughput_model], hf_dir, timed, args.batches, args.reps, Path(scratch))
    rows = summary(runs, args.batches)
    print_table(
        rows,
        [
            ("batch", "batch", "d"),
            ("appliance", "appliance s/s", ".1f"),
            ("genai", "genai s/s", ".1f"),
            ("torch", "torch s/s", ".1f"),
            ("vs_genai", "x genai", ".2f"),
            ("vs_torch", "x torch", ".2f"),
            ("appliance_cpu_ms", "appliance CPU ms/sent", ".1f"),
            ("genai_cpu_ms", "genai CPU ms/sent", ".1f"),
            ("vs_genai_cpu", "x genai (CPU)", ".2f"),
            ("torch_cpu_ms", "torch CPU ms/sent", ".1f"),
            ("vs_torch_cpu", "x torch (CPU)", ".2f"),
        ],
        title=f"sentences/s, {args.throughput_model} IR, {len(timed)} sentences, median of {args.reps} (paired ratios)",
    )
    save_results(args, "embeddings", before, fidelity=fid, agreement=checks, runs=runs, summary=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
