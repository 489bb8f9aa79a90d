"""Aggregate throughput and time-to-first-token under concurrency: our engine vs
openvino_genai.ContinuousBatchingPipeline on the same IR, with the same scheduler limits and compile properties.

At each concurrency c, c requests (random-token prompts, fixed length, `ignore_eos`, fixed new tokens) arrive
together; aggregate tok/s = all generated tokens / (last token - arrival), TTFT = arrival -> first token of
each request (median over the c requests). Both sides are loaded once per model and alternate which goes
first at every (c, repetition); each run gets fresh prompts. Medians over repetitions.

    python -m bench.concurrency [--models default-fp16 default-int8 random250m-fp16 random250m-int8]
                                [--concurrency 1 4 8 16] [--reps 3] [--prompt-len 128] [--new-tokens 128] [--quick]
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench.common import (
    MODEL_CHOICES,
    arg_parser,
    machine,
    median,
    model_dir,
    paired_ratio,
    percentile,
    print_table,
    prompts,
    ratio,
    rotate,
    save_results,
    side_medians,
)

_request_ids = itertools.count()


# ---------------------------------------------------------------- our engine


def load_engine(path: Path, config=None):
    from appliance.params import SamplingParams
    from appliance.runtime.engine import Engine

    engine = Engine(path, config)
    engine.generate([100 + i for i in range(16)], SamplingParams(max_tokens=4))  # compile kernels
    return engine


def engine_settings(engine) -> dict:
    """What the engine ran with (engine internals read defensively: they may move, the benchmark should not
    break over a settings report)."""
    from appliance.runtime.backends.openvino_common import compile_properties

    c, pool, backend = engine.config, engine.pool, engine.backend
    compiled = getattr(backend, "compiled", None)
    return {
        "impl": "appliance.runtime.engine.Engine",
        "max_num_seqs": engine.scheduler.max_num_seqs,
        "max_num_batched_tokens": c.max_num_batched_tokens,
        "chunked_prefill": True,
        "kv_cache_tokens": pool.num_blocks * pool.block_size,
        "kv_blocks": pool.num_blocks,
        "kv_block_size": pool.block_size,
        "kv_cache_bytes": getattr(backend, "cache_bytes", None),
        "prefix_caching": pool.prefix_caching,
        "compile_properties": compile_properties(c),
        "inference_precision": compiled.get_property("INFERENCE_PRECISION_HINT").to_string() if compiled else None,
        "kv_precision": getattr(backend, "kv_precision", None),
    }  # the paged backend's: "u8", "f16", ...


def stream_all(engine, batch: list[list[int]], params) -> tuple[float, list[list[float]], list[list[int]], list]:
    """All of `batch` submitted at once, one consumer thread per request (as the server's pump threads). Returns the
    submission time, each request's token arrival times (consumer side) and token ids, and its finish reason."""
    times: list[list[float]] = [[] for _ in batch]
    ids: list[list[int]] = [[] for _ in batch]
    reasons: list[str | None] = [None] * len(batch)

    def consume(i: int, handle) -> None:
        for chunk in handle:
            if chunk.token_ids:
                times[i] += [time.perf_counter()] * len(chunk.token_ids)
                ids[i] += chunk.token_ids
            reasons[i] = chunk.finish_reason or reasons[i]

    t0 = time.perf_counter()
    # One submission, as genai_run's add_request loop before its first step: one by one, the engine thread can
    # wake on the first and prefill it alone (a real burst of HTTP clients is measured by bench.http).
    handles = [hs[0] for hs in engine.submit_prompts([(p, [params], None) for p in batch])]
    threads = [threading.Thread(target=consume, args=(i, h), daemon=True) for i, h in enumerate(handles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return t0, times, ids, reasons


def engine_run(engine, batch: list[list[int]], new_tokens: int, params=None) -> dict:
    """All of `batch` at once (stream_all). `params` (default: new_tokens with ignore_eos) must make every request
    run to max_tokens: the rates compare equal work (bench.structured passes a grammar whose output cannot end
    early)."""
    from appliance.params import SamplingParams

    params = params or SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    t0, times, _, reasons = stream_all(engine, batch, params)
    if any(r != "length" for r in reasons):
        raise RuntimeError(f"every request must run to max_tokens: finish reasons {reasons}")
    return _summary(t0, times, new_tokens)


# ---------------------------------------------------------------- openvino_genai


def load_genai(path: Path, engine) -> tuple[object, dict]:
    """A ContinuousBatchingPipeline with the engine's scheduler limits, KV budget and compile properties."""
    import openvino_genai as ov_genai

    from appliance.runtime.backends.openvino_common import compile_properties

    c = engine.config
    sc = ov_genai.SchedulerConfig()
    sc.max_num_seqs = engine.scheduler.max_num_seqs
    sc.max_num_batched_tokens = c.max_num_batched_tokens
    sc.num_kv_blocks = engine.pool.num_blocks  # block size 32 on CPU, as ours (checked below)
    sc.dynamic_split_fuse = True
    sc.enable_prefix_caching = engine.pool.prefix_caching
    props = compile_properties(c)
    pipe = ov_genai.ContinuousBatchingPipeline(str(path), sc, "CPU", props)
    genai_run(pipe, [[100 + i for i in range(16)]], 4)  # compile kernels, allocate the cache
    settings = {
        "impl": "openvino_genai.ContinuousBatchingPipeline (add_request + step loop)",
        "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "dynamic_split_fuse": sc.dynamic_split_fuse,
        "num_kv_blocks": sc.num_kv_blocks,
        "kv_cache_bytes": pipe.get_metrics().kv_cache_size_in_bytes,
        "prefix_caching": sc.enable_prefix_caching,
        "compile_properties": props,
        "inference_precision": "device default, as the engine's (same compile properties)",
    }
    return pipe, settings


def genai_run(pipe, batch: list[list[int]], new_tokens: int) -> dict:
    """All of `batch` added at once, then the pipeline's step loop, reading each handle after every step
    (what a server streaming from it does)."""
    import openvino as ov
    import openvino_genai as ov_genai

    cfg = ov_genai.GenerationConfig()
    cfg.max_new_tokens = cfg.min_new_tokens = new_tokens
    cfg.ignore_eos = True
    cfg.apply_chat_template = False
    times: list[list[float]] = [[] for _ in batch]
    t0 = time.perf_counter()
    handles = [pipe.add_request(next(_request_ids), ov.Tensor(np.array([p], np.int64)), cfg) for p in batch]

    def drain(now: float) -> None:
        for i, h in enumerate(handles):
            if h.can_read():
                times[i] += [now] * sum(len(out.generated_ids) for out in h.read().values())

    while pipe.has_non_finished_requests():
        pipe.step()
        drain(time.perf_counter())
    drain(time.perf_counter())
    return _summary(t0, times, new_tokens)


def _summary(t0: float, times: list[list[float]], new_tokens: int) -> dict:
    counts = [len(t) for t in times]
    if any(c != new_tokens for c in counts):
        raise RuntimeError(f"expected {new_tokens} tokens per request, got {counts}")
    end = max(t[-1] for t in times)
    ttft = [t[0] - t0 for t in times]
    gaps = [b - a for t in times for a, b in zip(t, t[1:])]
    per_req = [(len(t) - 1) / (t[-1] - t[0]) for t in times if t[-1] > t[0]]
    return {
        "tok_s": sum(counts) / (end - t0),
        "ttft_s": median(ttft),
        "ttft_max_s": max(ttft),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
        "decode_tok_s_per_request": median(per_req),
        "wall_s": end - t0,
    }


# ---------------------------------------------------------------- the benchmark


def bench_model(name: str, levels, reps: int, prompt_len: int, new_tokens: int, bar, seed: int) -> dict:
    from appliance.manifest import Manifest

    path = model_dir(name)
    vocab = Manifest.load(path).vocab_size
    bar.set_postfix_str(f"{name}: loading")
    engine = load_engine(path)
    try:
        pipe, genai_settings = load_genai(path, engine)
        runs = []
        for rep in range(reps):
            for k, c in enumerate(levels):
                sides = rotate(
                    [
                        ("engine", lambda b: engine_run(engine, b, new_tokens)),
                        ("genai", lambda b: genai_run(pipe, b, new_tokens)),
                    ],
                    rep + k,
                )
                for side, fn in sides:
                    bar.set_postfix_str(f"{name} c={c} rep {rep + 1} {side}")
                    batch = prompts(vocab, c, prompt_len, seed)
                    seed += 1
                    runs.append({"impl": side, "concurrency": c, "rep": rep, "first": side == sides[0][0], **fn(batch)})
                    bar.update()
        settings = {"engine": engine_settings(engine), "genai": genai_settings}
    finally:
        engine.shutdown()
    rows = []
    for c in levels:
        row = {
            "model": name,
            "concurrency": c,
            **side_medians(runs, "engine", concurrency=c),
            **side_medians(runs, "genai", concurrency=c),
        }
        row["tok_s_ratio"] = paired_ratio(runs, "tok_s", "engine", "genai", concurrency=c)
        row["ttft_ratio"] = paired_ratio(runs, "ttft_s", "engine", "genai", concurrency=c)
        row["tok_s_ratio_of_medians"] = ratio(row["engine_tok_s"], row["genai_tok_s"])
        rows.append(row)
    return {"model": name, "model_dir": str(path), "settings": settings, "runs": runs, "summary": rows}


COLUMNS = [
    ("model", "model", ""),
    ("concurrency", "conc", "d"),
    ("engine_tok_s", "engine tok/s", ".1f"),
    ("genai_tok_s", "genai tok/s", ".1f"),
    ("tok_s_ratio", "ratio", ".2f"),
    ("engine_ttft_ms", "engine TTFT ms", ".0f"),
    ("genai_ttft_ms", "genai TTFT ms", ".0f"),
    ("ttft_ratio", "TTFT ratio", ".2f"),
]


def main(argv=None) -> int:
    args = arg_parser(
        __doc__, "concurrency", models=MODEL_CHOICES, levels=True, reps=5, quick={"models": ["default-fp16"], "reps": 1}
    ).parse_args(argv)

    info = machine()
    results = []
    total = len(args.models) * args.reps * len(args.concurrency) * 2
    with tqdm(total=total, desc="concurrency", file=sys.stderr, leave=False) as bar:
        for k, name in enumerate(args.models):
            results.append(
                bench_model(
                    name, list(args.concurrency), args.reps, args.prompt_len, args.new_tokens, bar, seed=1000 * (k + 1)
                )
            )
    summary = [row for r in results for row in r["summary"]]
    print_table(
        summary,
        COLUMNS,
        title="engine vs openvino_genai.ContinuousBatchingPipeline (medians over "
        "repetitions; ratio = median of per-repetition engine / genai; TTFT ratio < 1 "
        "is better)",
    )
    save_results(args, "concurrency", info, models=results, summary=summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
