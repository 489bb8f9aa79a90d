"""Batch-1 decode speed and TTFT, interleaved: our engine vs openvino_genai.LLMPipeline (and the
ContinuousBatchingPipeline at c=1) on the same IR and compile properties, rotating which goes first on every
run, each call on a fresh random prompt. All three are timed the same way, on the caller's wall clock:
TTFT = call -> first token in the caller's hands (engine: first chunk; LLMPipeline: a token streamer; CB: after
the step that produced it), decode tok/s = (tokens - 1) / (last token - first token). Ratios are medians of
the per-run ratios (runs back to back share the machine's load of the moment).

LLMPipeline's own perf counters (`perf_metrics.get_ttft()` / `get_tpot()`) of the same calls are recorded too
and compared with the engine's wall-clock numbers in a second table ("own timers", what the former bench/run.py
reported).

`--isa-cap AVX2` runs both sides on oneDNN's AVX2 kernels (ONEDNN_MAX_CPU_ISA, set while the options are parsed,
before openvino compiles anything): an AVX2 box approximated on an AVX-512 one. The ISA is recorded with the results
(machine()) and printed under the tables.

    python -m bench.batch1_paired [--models default-fp16 default-int8] [--runs 9] [--prompt-len 128]
                                  [--new-tokens 128] [--isa-cap AVX2] [--quick]
"""

from __future__ import annotations

import sys
import time

import numpy as np
from tqdm import tqdm

from bench.common import (
    arg_parser,
    isa_cap_option,
    machine,
    model_dir,
    paired_ratio,
    print_table,
    prompts,
    rotate,
    save_results,
    side_medians,
)


def engine_call(engine, prompt: list[int], new_tokens: int) -> dict:
    from appliance.params import SamplingParams

    stamps = []
    t0 = time.perf_counter()
    for chunk in engine.submit(prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True)):
        if chunk.token_ids:
            stamps += [time.perf_counter()] * len(chunk.token_ids)
    return _timing(t0, stamps, new_tokens)


def llm_call(pipe, prompt: list[int], new_tokens: int) -> dict:
    import openvino as ov
    import openvino_genai as ov_genai

    class Stamps(ov_genai.StreamerBase):
        def __init__(self):
            super().__init__()
            self.t: list[float] = []

        def write(self, token):
            now = time.perf_counter()
            self.t += [now] * (1 if isinstance(token, int) else len(token))
            return ov_genai.StreamingStatus.RUNNING

        def end(self):
            pass

    streamer = Stamps()
    t0 = time.perf_counter()
    res = pipe.generate(
        ov.Tensor(np.array([prompt], np.int64)),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        ignore_eos=True,
        apply_chat_template=False,
        streamer=streamer,
    )
    own = res.perf_metrics  # genai's own timers of the same call (ms)
    return {
        **_timing(t0, streamer.t, new_tokens),
        "own_ttft_s": own.get_ttft().mean / 1e3,
        "own_decode_tok_s": 1e3 / own.get_tpot().mean,
    }


def cb_call(pipe, prompt: list[int], new_tokens: int) -> dict:
    from bench.concurrency import genai_run

    r = genai_run(pipe, [prompt], new_tokens)
    return {"ttft_s": r["ttft_s"], "decode_tok_s": r["decode_tok_s_per_request"]}


def _timing(t0: float, stamps: list[float], new_tokens: int) -> dict:
    if len(stamps) != new_tokens:
        raise RuntimeError(f"expected {new_tokens} tokens, got {len(stamps)}")
    return {"ttft_s": stamps[0] - t0, "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])}


def bench_model(name: str, runs: int, prompt_len: int, new_tokens: int, bar, seed: int) -> dict:
    import openvino as ov
    import openvino_genai as ov_genai

    from appliance.manifest import Manifest
    from appliance.runtime.backends.openvino_common import compile_properties
    from bench.concurrency import engine_settings, load_engine, load_genai

    path = model_dir(name)
    vocab = Manifest.load(path).vocab_size
    engine = load_engine(path)
    try:
        cb, cb_settings = load_genai(path, engine)
        props = compile_properties(engine.config)  # the engine's, so only the generation loops differ
        llm = ov_genai.LLMPipeline(str(path), "CPU", **props)
        llm.generate(
            ov.Tensor(np.array([[100 + i for i in range(16)]], np.int64)), max_new_tokens=4, apply_chat_template=False
        )
        sides = [
            ("engine", lambda p: engine_call(engine, p, new_tokens)),
            ("llm", lambda p: llm_call(llm, p, new_tokens)),
            ("cb", lambda p: cb_call(cb, p, new_tokens)),
        ]
        results = []
        for rep in range(runs):
            for position, (impl, fn) in enumerate(rotate(sides, rep)):
                bar.set_postfix_str(f"{name} run {rep + 1} {impl}")
                results.append(
                    {"impl": impl, "rep": rep, "position": position, **fn(prompts(vocab, 1, prompt_len, seed)[0])}
                )
                seed += 1
                bar.update()
        settings = {
            "engine": engine_settings(engine),
            "cb": cb_settings,
            "llm": {"impl": "openvino_genai.LLMPipeline (stateful IR, SDPA)", "compile_properties": props},
        }
    finally:
        engine.shutdown()

    row: dict[str, object] = {"model": name}
    for impl in ("engine", "llm", "cb"):
        row.update(side_medians(results, impl, rates=("decode_tok_s",)))
    row["decode_ratio"] = paired_ratio(results, "decode_tok_s", "engine", "llm")
    row["ttft_ratio"] = paired_ratio(results, "ttft_s", "engine", "llm")
    row["decode_ratio_cb"] = paired_ratio(results, "decode_tok_s", "engine", "cb")
    row["ttft_ratio_cb"] = paired_ratio(results, "ttft_s", "engine", "cb")
    row.update(side_medians(results, "llm", rates=("own_decode_tok_s",), seconds=("own_ttft_s",)))
    row["decode_ratio_own"] = paired_ratio(results, "decode_tok_s", "engine", "llm", b_key="own_decode_tok_s")
    row["ttft_ratio_own"] = paired_ratio(results, "ttft_s", "engine", "llm", b_key="own_ttft_s")
    return {"model": name, "model_dir": str(path), "settings": settings, "runs": results, "summary": row}


COLUMNS = [
    ("model", "model", ""),
    ("engine_decode_tok_s", "engine tok/s", ".1f"),
    ("llm_decode_tok_s", "LLMPipe tok/s", ".1f"),
    ("decode_ratio", "ratio", ".2f"),
    ("engine_ttft_ms", "engine TTFT ms", ".0f"),
    ("llm_ttft_ms", "LLMPipe TTFT ms", ".0f"),
    ("ttft_ratio", "ratio", ".2f"),
    ("cb_decode_tok_s", "CB tok/s", ".1f"),
    ("decode_ratio_cb", "ratio", ".2f"),
    ("cb_ttft_ms", "CB TTFT ms", ".0f"),
    ("ttft_ratio_cb", "ratio", ".2f"),
]
OWN_COLUMNS = [
    ("model", "model", ""),
    ("engine_decode_tok_s", "engine tok/s", ".1f"),
    ("llm_own_decode_tok_s", "LLMPipe tok/s (own)", ".1f"),
    ("decode_ratio_own", "ratio", ".2f"),
    ("engine_ttft_ms", "engine TTFT ms", ".0f"),
    ("llm_own_ttft_ms", "LLMPipe TTFT ms (own)", ".0f"),
    ("ttft_ratio_own", "ratio", ".2f"),
]


def main(argv=None) -> int:
    ap = arg_parser(
        __doc__, "batch1_paired", models=["default-fp16", "default-int8"], quick={"models": ["default-fp16"], "runs": 3}
    )
    ap.add_argument("--runs", type=int, default=9)
    isa_cap_option(ap)
    args = ap.parse_args(argv)

    info = machine()
    results = []
    with tqdm(total=3 * args.runs * len(args.models), desc="batch-1 paired", file=sys.stderr, leave=False) as bar:
        for k, name in enumerate(args.models):
            results.append(bench_model(name, args.runs, args.prompt_len, args.new_tokens, bar, 40000 + 1000 * k))
    summary = [r["summary"] for r in results]
    print_table(
        summary,
        COLUMNS,
        title="batch 1, interleaved: engine vs LLMPipeline and ContinuousBatchingPipeline "
        "(ratio = median of per-run engine / other; TTFT ratio < 1 is better)",
    )
    print_table(
        summary,
        OWN_COLUMNS,
        title="the same runs, LLMPipeline timed by its own perf counters (perf_metrics TTFT / TPOT)",
    )
    print(f"ISA: {info['isa']} [{' '.join(info['isa_flags'])}]")
    save_results(args, "batch1_paired", info, models=results, summary=summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
