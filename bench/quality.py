"""How far each export's next-token distribution is from transformers' fp32 on the same source weights: total-variation
distance (TVD, 0 = identical, 1 = disjoint) of the softmax and top-1 agreement, over held-out prompts, at the f32
parity setting and at the precision that serves (the device default: bf16 weights-and-activations on an AVX-512-bf16
CPU, u8 KV). The exporter's tests bound the same quantity (tests/runtime/test_parity.py); this tool measures it on
prompts
those tests do not use, so a default export can be chosen on speed within a stated tolerance.

With --llamacpp-python, llama.cpp's own distribution from the default model's Q4_1 GGUF on the same token ids is a
row too: the loss its users already accept. The default model's transformers folder is dequantized from that GGUF,
so that row measures llama.cpp's compute (q8 activations, its kernels) on exactly the reference weights, while our
int8/int4 exports quantize those weights a second time.

    python -m bench.quality MODEL [MODEL ...] [--prompts 24] [--precision f32 default] [--llamacpp-python PATH] \
        [--kernels auto openvino]

--kernels (EngineConfig.kernels, default auto): each choice is a row per precision, its `kernels` column the path
that ran (appliance/runtime/kernels); with `openvino` among them, every other row also gets its TVD from the
`openvino` row at the same precision (`vs openvino`): what our kernels alone move (target: median <= 0.01).

MODEL: default-<fmt> or an export directory. Prompts: chat-templated user messages and slices of plain text (16-300
tokens), alternating, deterministic.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench.common import arg_parser, isa_cap_option, machine, model_dir, percentile, print_table, save_results

PASSAGES = [
    "The lighthouse keeper had not spoken to anyone in eleven days when the supply boat finally rounded the point. "
    "He watched it from the gallery, one hand on the cold rail, counting the seconds between the swells the way his "
    "father had taught him. The sea was still grey and heavy from the storm, and the boat climbed each wave slowly, "
    "as if it were thinking about whether to go on. When it reached the landing he saw that the pilot was not Tomas "
    "but a young woman in a yellow coat, who threw him the rope without a word and began to unload the crates.",
    "A hash table stores key-value pairs in an array of buckets. To insert a key, the table computes a hash of the "
    "key, reduces it modulo the number of buckets, and places the pair in that bucket. Two keys may land in the "
    "same bucket; this is called a collision, and it is usually resolved either by chaining, where each bucket holds "
    "a small list, or by open addressing, where the table probes other buckets in a fixed sequence. When the load "
    "factor grows past a threshold, the table allocates a larger array and rehashes every entry, which keeps the "
    "average cost of a lookup constant.",
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    out = []\n    i = j = 0\n"
    "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n"
    "        else:\n            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n"
    "    return out\n\n\nif __name__ == \"__main__\":\n    print(merge_sorted([1, 4, 9], [2, 3, 10, 11]))\n",
    "La Loire est le plus long fleuve de France. Elle prend sa source au mont Gerbier-de-Jonc, dans le Massif "
    "central, et se jette dans l'océan Atlantique près de Saint-Nazaire. Ses rives sont bordées de nombreux "
    "châteaux construits à la Renaissance, comme Chambord ou Chenonceau, qui attirent chaque année des millions "
    "de visiteurs.",
    "To make a simple sourdough loaf, mix 500 g of flour with 350 g of water and let it rest for an hour. Add 100 g "
    "of active starter and 10 g of salt, then fold the dough every thirty minutes for two hours. Shape it into a "
    "round, place it in a floured basket and leave it in the refrigerator overnight. Bake it in a preheated covered "
    "pot at 250 degrees for twenty minutes, then uncover it and bake for another twenty-five minutes.",
    "Q: When did the first person walk on the Moon?\nA: Neil Armstrong stepped onto the lunar surface on 20 July "
    "1969, during the Apollo 11 mission.\nQ: Who was with him?\nA: Buzz Aldrin joined him about twenty minutes "
    "later, while Michael Collins stayed in orbit aboard the command module.\nQ: How long did they stay?\nA:",
]
CHAT = [
    "How do I reverse a list in Python without modifying the original?",
    "Give me three ideas for a rainy Sunday afternoon with kids.",
    "What is the difference between weather and climate?",
    "Read this and tell me what the author thinks about load factors, then suggest a better title:\n\n" + PASSAGES[1],
    "Écris une courte lettre pour remercier un voisin qui a arrosé mes plantes.",
    "Summarize in one sentence: The town council voted on Tuesday to extend the library's opening hours to 9 pm on "
    "weekdays, citing a rise in students using the reading rooms after school. The change starts next month and "
    "is paid for by savings on the heating contract.",
    "Why do cats purr?",
    "Translate to German: The train to the airport leaves every twenty minutes.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "I have eggs, spinach, a bit of feta and stale bread. What can I cook for two people in under thirty minutes? "
    "Please give the steps, the order to do them in so nothing gets cold, and one thing I could prepare ahead.",
    "Explain recursion to a ten-year-old using an example with Russian dolls.",
    "List the planets of the solar system from the smallest to the largest.",
]
TEXT_LENGTHS = (24, 300, 64, 160, 16, 220, 40, 120, 260, 90, 32, 190)  # tokens of the plain-text prompts, in turn


def held_out_prompts(tokenizer, n: int) -> list[list[int]]:
    """n prompts, chat and plain text alternating; the text ones are windows of the passages' tokens at fixed
    offsets (a window may end mid-word: a next token is predicted anywhere)."""
    chats = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": c}])) for c in CHAT]
    corpus = tokenizer.encode("\n\n".join(PASSAGES))
    out: list[list[int]] = []
    texts = 0
    for i in range(n):
        if i % 2 == 0 and i // 2 < len(chats):
            out.append(chats[i // 2])
            continue
        length = min(TEXT_LENGTHS[texts % len(TEXT_LENGTHS)], len(corpus))
        start = (texts * 211) % (len(corpus) - length + 1)
        out.append(corpus[start : start + length])
        texts += 1
    return out


def reference_logits(hf_dir: str, prompts: list[list[int]]) -> list[np.ndarray]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [
            model(torch.tensor([p])).logits[0, -1].numpy().copy() for p in tqdm(prompts, "transformers", leave=False)
        ]


def engine_logits(
    path: Path, precision: str, prompts: list[list[int]], kernels: str = "auto"
) -> tuple[list[np.ndarray], str]:
    """Last-position logits of each prompt and which kernels ran the low-bit MatMuls: all but the last token
    prefilled in one forward, the last one fed as a decode step, since steps of a few tokens are where our kernels
    run on every path (appliance/runtime/kernels KERNEL_ROWS; on AVX2 the prefill too, PREFILL_ISAS) and that last
    step is the one whose logits are compared."""
    from appliance.config import EngineConfig
    from appliance.runtime.backends import StepBatch
    from appliance.runtime.engine import Engine

    config = EngineConfig(
        precision=None if precision == "default" else precision, kernels=kernels, kv_cache_tokens=4096
    )
    engine = Engine(path, config)
    try:
        out = []
        for p in tqdm(prompts, f"{path.name} {precision}", leave=False):
            table = engine.pool.allocate(engine.pool.blocks_for(len(p)))
            engine.backend.forward(StepBatch([p[:-1]], [0], [table]))
            out.append(np.array(engine.backend.forward(StepBatch([p[-1:]], [len(p) - 1], [table]))[0], np.float32))
            engine.pool.free(table)
        return out, engine.backend.kernels
    finally:
        engine.shutdown()


# Runs in --llamacpp-python's interpreter: token ids in (JSON on stdin), last-position logits out (JSON on stdout).
# eval() feeds the ids as given (no BOS added: only tokenize() adds one); logits_all off keeps the last row only.
_LLAMACPP_CHILD = """
import json, sys
import numpy as np
from llama_cpp import Llama
job = json.load(sys.stdin)
llm = Llama(job["gguf"], n_ctx=2048, n_batch=512, n_threads=job["threads"], logits_all=False, verbose=False)
out = []
for ids in job["prompts"]:
    llm.reset()
    llm.eval(ids)
    out.append(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),)).tolist())
json.dump({"add_bos_token": llm.metadata.get("tokenizer.ggml.add_bos_token"), "logits": out}, sys.stdout)
"""


def llamacpp_logits(python: str, gguf: Path, prompts: list[list[int]]) -> tuple[list[np.ndarray], dict]:
    job = json.dumps({"gguf": str(gguf), "prompts": prompts, "threads": os.cpu_count()})
    done = subprocess.run([python, "-c", _LLAMACPP_CHILD], input=job, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"llama.cpp child failed ({done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(done.stdout)
    return [np.asarray(x, np.float32) for x in result.pop("logits")], result


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


def compare(ref: list[np.ndarray], ours: list[np.ndarray]) -> dict:
    tvd = [float(0.5 * np.abs(_softmax(r) - _softmax(o)).sum()) for r, o in zip(ref, ours)]
    top1 = [int(r.argmax() == o.argmax()) for r, o in zip(ref, ours)]
    return {
        "tvd_median": percentile(tvd, 50),
        "tvd_p90": percentile(tvd, 90),
        "tvd_max": max(tvd),
        "top1_pct": 100 * sum(top1) / len(top1),
        "tvd": tvd,
    }


def compression(weight_compression: dict) -> str:
    """The manifest's weight_compression in a few words: mode, group size, ratio, what stayed at a backup mode."""
    if not weight_compression:
        return "-"
    if "mode" not in weight_compression:
        return str(weight_compression.get("method", "?"))
    parts = [str(weight_compression["mode"])]
    group = weight_compression.get("group_size")
    if group not in (None, -1):
        parts.append(f"g{group}" if isinstance(group, int) else str(group))
    if weight_compression.get("ratio") not in (None, 1.0):
        parts.append(f"ratio {weight_compression['ratio']}")
    if weight_compression.get("backup_mode"):
        parts.append(f"backup {weight_compression['backup_mode'].split()[0]}")
    return " ".join(parts)


COLUMNS = [
    ("model", "model", "s"),
    ("weight_format", "format", "s"),
    ("compression", "compression", "s"),
    ("bin_mb", "bin MB", ".1f"),
    ("precision", "precision", "s"),
    ("kernels", "kernels", "s"),
    ("tvd_median", "TVD median", ".4f"),
    ("tvd_p90", "TVD p90", ".4f"),
    ("tvd_max", "TVD max", ".4f"),
    ("top1_pct", "top-1 agree %", ".1f"),
    ("vs_openvino_tvd_median", "vs openvino TVD median", ".4f"),
    ("vs_openvino_tvd_max", "vs openvino TVD max", ".4f"),
]


def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(__doc__, "quality", prompt_len=None, new_tokens=None)
    ap.add_argument("models", nargs="+", help="default-<fmt> or export directories")
    ap.add_argument("--prompts", type=int, default=24, help="held-out prompts (chat and plain text alternate)")
    ap.add_argument("--precision", nargs="+", default=["f32", "default"], choices=["f32", "default"])
    ap.add_argument("--llamacpp-python", default=None, help="a python with llama_cpp: adds the GGUF's row")
    ap.add_argument("--kernels", nargs="+", default=["auto"], choices=["auto", "ours", "openvino"])
    isa_cap_option(ap)
    args = ap.parse_args(argv)

    from appliance.manifest import Manifest
    from appliance.runtime.tokenizer import Tokenizer

    info = machine()
    isa = info["isa"]
    paths = {m: model_dir(m) for m in args.models}
    manifests = {m: Manifest.load(p) for m, p in paths.items()}
    rows: list[dict] = []
    by_source: dict[str, list[str]] = {}
    for m in args.models:
        by_source.setdefault(manifests[m].source or str(paths[m]), []).append(m)
    refs: dict[str, tuple[list[list[int]], list[np.ndarray]]] = {}

    def reference(source: str) -> tuple[list[list[int]], list[np.ndarray]]:
        """The held-out prompts in the source's tokens and transformers' logits on them, once per source."""
        if source not in refs:
            prompts = held_out_prompts(Tokenizer.from_dir(source), args.prompts)
            refs[source] = prompts, reference_logits(source, prompts)
        return refs[source]

    for source, models in by_source.items():
        prompts, ref = reference(source)
        for m in models:
            man, path = manifests[m], paths[m]
            bin_file = path / Path(man.model_file).with_suffix(".bin")
            base = {
                "model": m,
                "source": source,
                "weight_format": man.weight_format,
                "compression": compression(man.weight_compression),
                "weight_compression": man.weight_compression,
                "bin_mb": bin_file.stat().st_size / 2**20 if bin_file.is_file() else None,
            }
            for precision in args.precision:
                logits = {k: engine_logits(path, precision, prompts, k) for k in args.kernels}
                for choice, (ours, label) in logits.items():
                    row = {**base, "precision": precision, "kernels": label, **compare(ref, ours)}
                    if "openvino" in logits and choice != "openvino":
                        native = compare(logits["openvino"][0], ours)
                        row |= {
                            "vs_openvino_tvd_median": native["tvd_median"],
                            "vs_openvino_tvd_max": native["tvd_max"],
                        }
                    rows.append(row)
    if args.llamacpp_python:
        from export.default_model import ensure_hf_folder, gguf_path

        source = str(ensure_hf_folder())
        prompts, ref = reference(source)
        gguf = gguf_path()
        theirs, meta = llamacpp_logits(args.llamacpp_python, gguf, prompts)
        row: dict = {"model": "llama.cpp Q4_1 GGUF", "source": source, "weight_format": "Q4_1", "gguf": str(gguf)}
        row |= {"compression": "gguf", "bin_mb": gguf.stat().st_size / 2**20, "precision": "llama.cpp", **meta}
        rows.append(row | compare(ref, theirs))
    print_table(rows, COLUMNS, title=f"next-token distance from transformers fp32, {args.prompts} prompts, ISA {isa}")
    save_results(args, "quality", info, isa=isa, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
