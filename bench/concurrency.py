"""Aggregate throughput and time-to-first-token under concurrency: our engine vs
openvino_genai.ContinuousBatchingPipeline on the same IR, with the same scheduler limits and compile properties.

At each concurrency c, c requests (random-token prompts, fixed length, `ignore_eos`, fixed new tokens) arrive
together; aggregate tok/s = all generated tokens / (last token - arrival), TTFT = arrival -> first token of
each request (median over the c requests). Both sides are loaded once per model and alternate which goes
first at every (c, repetition); each run gets fresh prompts. Medians over repetitions.

    python -m bench.concurrency [--models default-fp16 default-int8 random250m-fp16 random250m-int8]
                                [--concurrency 1 4 8 16] [--reps 3] [--prompt-len 128] [--new-tokens 128] [--quick]

`--engines-only`: no genai; our engine on each of --models' exports (names or export directories), side by side
in this process: all loaded at once (every one with the first's KV pool in tokens, so that the later ones are not
sized from the memory the earlier ones left), and at each (repetition, c) the same fresh prompts go to each engine
in turn, the one that goes first rotating. Per export and c: medians of aggregate tok/s, TTFT and ITL (p50, p99),
and its ratios to the first export's, paired per repetition (e.g. an NNCF int8 export against default-int8):

    python -m bench.concurrency --engines-only --models default-int8 /path/to/other-int8 --concurrency 8 16
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
    finish,
    machine,
    median,
    model_dir,
    paired_ratio,
    percentile,
    prompts,
    ratio,
    rotate,
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
    t0 = time.perf_counter()
    handles = [pipe.add_request(next(_request_ids), ov.Tensor(np.array([p], np.int64)), cfg) for p in batch]
    return genai_steps(pipe, handles, t0, new_tokens)


def genai_steps(pipe, handles: list, t0: float, new_tokens: int) -> dict:
    """The pipeline's step loop until every request is done, each handle read after every step (token times on
    the caller's clock), summarized from `t0`, when the requests were added."""
    times: list[list[float]] = [[] for _ in handles]

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


def engine_label(name: str, taken: set[str]) -> str:
    """A model's name in the engines-only table: a bench name as given, a directory as parent/name (#2, #3 when
    two are alike)."""
    path = Path(name).expanduser()
    label = "/".join(path.resolve().parts[-2:]) if path.is_dir() else name
    out, k = label, 1
    while out in taken:
        k += 1
        out = f"{label}#{k}"
    return out


def bench_engines(names: list[str], levels, reps: int, prompt_len: int, new_tokens: int, bar, seed: int) -> dict:
    """--engines-only (module docstring): every export's engine loaded once, the same prompts to each in turn."""
    from appliance.config import EngineConfig
    from appliance.manifest import Manifest

    paths: dict[str, Path] = {}
    for name in names:
        paths[engine_label(name, set(paths))] = model_dir(name)
    vocab = min(Manifest.load(p).vocab_size for p in paths.values())  # prompts every export's vocabulary has
    engines: dict = {}
    runs = []
    try:
        for label, path in paths.items():
            bar.set_postfix_str(f"{label}: loading")
            first = next(iter(engines.values()), None)
            pool = EngineConfig(kv_cache_tokens=first.pool.num_blocks * first.pool.block_size) if first else None
            engines[label] = load_engine(path, pool)
        for rep in range(reps):
            for k, c in enumerate(levels):
                batch = prompts(vocab, c, prompt_len, seed)
                seed += 1
                order = rotate(list(engines), rep + k)
                for label in order:
                    bar.set_postfix_str(f"c={c} rep {rep + 1} {label}")
                    run = engine_run(engines[label], batch, new_tokens)
                    runs.append({"impl": label, "concurrency": c, "rep": rep, "first": label == order[0], **run})
                    bar.update()
        settings = {label: engine_settings(e) for label, e in engines.items()}
    finally:
        for e in engines.values():
            e.shutdown()
    base = next(iter(paths))
    rows = []
    for c in levels:
        for label in paths:
            mine = [r for r in runs if r["impl"] == label and r["concurrency"] == c]
            row: dict = {"concurrency": c, "model": label}
            for key, name, _, _, scale in ENGINE_METRICS:
                row[name] = median(r[key] for r in mine) * scale
            for key, *_ in ENGINE_METRICS[:RATIOS]:
                row[f"{key}_vs_first"] = paired_ratio(runs, key, label, base, concurrency=c)
            rows.append(row)
    return {
        "models": {label: str(p) for label, p in paths.items()},
        "settings": settings,
        "runs": runs,
        "summary": rows,
    }


# --engines-only: (run key, row key, column, format, scale) of each median; the first RATIOS also as the median of
# per-repetition ratios to the first export's
ENGINE_METRICS = (
    ("tok_s", "tok_s", "tok/s", ".1f", 1.0),
    ("ttft_s", "ttft_ms", "TTFT ms", ".0f", 1e3),
    ("itl_p50_s", "itl_p50_ms", "ITL p50 ms", ".1f", 1e3),
    ("itl_p99_s", "itl_p99_ms", "ITL p99 ms", ".1f", 1e3),
)
RATIOS = 3
ENGINE_COLUMNS = [
    ("concurrency", "conc", "d"),
    ("model", "export", ""),
    *[(name, column, fmt) for _, name, column, fmt, _ in ENGINE_METRICS],
    *[
        (f"{key}_vs_first", f"{column.removesuffix(' ms')} vs 1st", ".3f")
        for key, _, column, _, _ in ENGINE_METRICS[:RATIOS]
    ],
]

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
    ap = arg_parser(
        __doc__, "concurrency", models=MODEL_CHOICES, levels=True, reps=5, quick={"models": ["default-fp16"], "reps": 1}
    )
    ap.add_argument(
        "--engines-only",
        action="store_true",
        help="no genai: our engine on each of --models side by side (the same prompts, interleaved), ratios to the "
        "first (bench/results/concurrency_engines.json unless --out)",
    )
    args = ap.parse_args(argv)

    info = machine()
    if args.engines_only:
        if args.out == ap.get_default("out"):
            args.out = args.out.with_name("concurrency_engines.json")
        total = args.reps * len(args.concurrency) * len(args.models)
        with tqdm(total=total, desc="concurrency", file=sys.stderr, leave=False) as bar:
            result = bench_engines(
                list(args.models), list(args.concurrency), args.reps, args.prompt_len, args.new_tokens, bar, seed=1000
            )
        title = (
            f"our engine on each export, {args.prompt_len}-token prompts, {args.new_tokens} new tokens, "
            f"{args.reps} interleaved repetitions (medians; vs 1st = median of per-repetition ratios to "
            f"{result['summary'][0]['model']}; tok/s > 1 and TTFT / ITL < 1 are better)"
        )
        return finish(args, "concurrency_engines", info, result.pop("summary"), ENGINE_COLUMNS, title, **result)
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
    title = (
        "engine vs openvino_genai.ContinuousBatchingPipeline (medians over repetitions; ratio = median of "
        "per-repetition engine / genai; TTFT ratio < 1 is better)"
    )
    return finish(args, "concurrency", info, summary, COLUMNS, title, models=results)


if __name__ == "__main__":
    sys.exit(main())
