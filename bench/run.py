"""Batch-1 decode speed and time-to-first-token: our engine vs openvino_genai.LLMPipeline on the same IR.

Same machine, same run, fresh random prompts every run (so no prefix cache helps either side), medians over
runs. Prints a table and writes JSON. The machine is shared and noisy: read the ratios, not the absolutes.

    python -m bench.run [--formats fp16 int8] [--runs 5] [--prompt-len 128] [--new-tokens 128] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench.common import prompts as _prompts  # shared with the other benchmarks


def bench_engine(model_dir: Path, prompts, new_tokens: int, bar) -> dict:
    from appliance.engine import Engine
    from appliance.params import SamplingParams

    engine = Engine(model_dir)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts[0][:16], SamplingParams(max_tokens=4))  # warm-up: compile kernels
    ttft, tps = [], []
    for p in prompts:
        t0 = time.perf_counter()
        handle = engine.submit(p, params)
        first = None
        count = 0
        for chunk in handle:
            count += len(chunk.token_ids)
            if first is None and chunk.token_ids:
                first = time.perf_counter()
        end = time.perf_counter()
        assert count == new_tokens, count
        ttft.append(first - t0)
        tps.append((count - 1) / (end - first))
        bar.update()
    engine.shutdown()
    return {"ttft_s": statistics.median(ttft), "decode_tok_s": statistics.median(tps), "runs": len(prompts)}


def bench_genai(model_dir: Path, prompts, new_tokens: int, bar) -> dict:
    import openvino as ov
    import openvino_genai as ov_genai

    # The same compile properties our engine uses by default, so only the generation loops differ.
    pipe = ov_genai.LLMPipeline(str(model_dir), "CPU", KV_CACHE_PRECISION="u8", PERFORMANCE_HINT="LATENCY")
    cfg = ov_genai.GenerationConfig()
    cfg.max_new_tokens = cfg.min_new_tokens = new_tokens
    cfg.ignore_eos = True
    cfg.apply_chat_template = False
    pipe.generate(ov.Tensor(np.array([prompts[0][:16]], np.int64)), max_new_tokens=4, apply_chat_template=False)
    ttft, tps = [], []
    for p in prompts:
        res = pipe.generate(ov.Tensor(np.array([p], np.int64)), cfg)
        m = res.perf_metrics
        ttft.append(m.get_ttft().mean / 1000)
        tps.append(1000 / m.get_tpot().mean)
        bar.update()
    del pipe
    return {"ttft_s": statistics.median(ttft), "decode_tok_s": statistics.median(tps), "runs": len(prompts)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=["fp16", "int8"])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("bench/results/batch1.json"))
    args = ap.parse_args(argv)

    from appliance.manifest import Manifest
    from export.default_model import ensure_export

    rows = []
    for fmt in args.formats:
        model_dir = ensure_export("openvino", fmt)
        vocab = Manifest.load(model_dir).vocab_size
        # Alternate who goes first per format; each side gets its own fresh prompts.
        for name, fn, seed in (("engine", bench_engine, 1), ("genai", bench_genai, 2)):
            prompts = _prompts(vocab, args.runs, args.prompt_len, seed + 100 * len(rows))
            with tqdm(total=args.runs, desc=f"{fmt} {name}", file=sys.stderr, leave=False) as bar:
                rows.append({"format": fmt, "impl": name, **fn(model_dir, prompts, args.new_tokens, bar)})
    table = []
    for fmt in args.formats:
        ours = next(r for r in rows if r["format"] == fmt and r["impl"] == "engine")
        ref = next(r for r in rows if r["format"] == fmt and r["impl"] == "genai")
        table.append({"format": fmt, "engine_decode_tok_s": ours["decode_tok_s"], "genai_decode_tok_s": ref["decode_tok_s"],
                      "decode_ratio": ours["decode_tok_s"] / ref["decode_tok_s"], "engine_ttft_ms": ours["ttft_s"] * 1e3,
                      "genai_ttft_ms": ref["ttft_s"] * 1e3, "ttft_ratio": ours["ttft_s"] / ref["ttft_s"]})
    print(f"{'format':8} {'engine tok/s':>13} {'genai tok/s':>12} {'ratio':>6} {'engine TTFT ms':>15} "
          f"{'genai TTFT ms':>14} {'ratio':>6}")
    for t in table:
        print(f"{t['format']:8} {t['engine_decode_tok_s']:13.1f} {t['genai_decode_tok_s']:12.1f} {t['decode_ratio']:6.2f} "
              f"{t['engine_ttft_ms']:15.1f} {t['genai_ttft_ms']:14.1f} {t['ttft_ratio']:6.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": rows,
                                    "summary": table}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
