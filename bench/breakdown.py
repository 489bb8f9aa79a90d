"""Where a step's time goes: our engine's step split into OpenVINO infer / the rest of backend.forward (input
arrays, logits copy) / sampling / everything else (scheduler, detokenizer, stop rules, emitting chunks), and the
forwards split into prefill (their tokens per second) and decode steps (rows and ms per step), next to
openvino_genai.ContinuousBatchingPipeline's whole step() on the same workload (same IR, same settings as
bench.concurrency). Measurement only: the engine is instrumented from outside by wrapping its methods.

    python -m bench.breakdown [--model default-fp16] [--concurrency 1 4 8 16] [--reps 2] [--cprofile FILE]

--cprofile also writes a cProfile of the engine thread's steps at the highest concurrency (pstats file;
`python -m pstats FILE` then `sort cumtime`, `stats 30`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tqdm import tqdm

from bench.common import arg_parser, finish, machine, median, model_dir, prompts

COLUMNS = [
    ("concurrency", "conc", "d"),
    ("engine_tok_s", "engine tok/s", ".1f"),
    ("genai_tok_s", "genai tok/s", ".1f"),
    ("engine_steps", "steps", ".0f"),
    ("step_ms", "engine ms/step", ".2f"),
    ("forward_ms", "forward", ".2f"),
    ("infer_ms", "infer", ".2f"),
    ("prep_ms", "fwd prep+copy", ".2f"),
    ("sample_ms", "sample", ".2f"),
    ("other_ms", "other python", ".2f"),
    ("loop_gap_ms", "between steps", ".2f"),
    ("prefill_tok_s", "prefill tok/s", ".1f"),
    ("decode_rows", "decode rows", ".1f"),
    ("decode_ms", "decode ms/step", ".1f"),
    ("genai_steps", "genai steps", ".0f"),
    ("genai_step_ms", "genai ms/step", ".2f"),
]


class _Timed:
    """Accumulates wall time of calls to a wrapped callable."""

    def __init__(self, fn):
        self.fn, self.total, self.calls = fn, 0.0, 0

    def __call__(self, *a, **kw):
        t = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.total += time.perf_counter() - t
            self.calls += 1

    def reset(self) -> None:
        self.total, self.calls = 0.0, 0


class _Kinds:
    """Wraps backend.forward: wall time of the steps that prefill (any sequence fed more than one token) and of
    decode steps (one token each), with their tokens and rows, so that a run at many clients says how its time
    splits between the prompts and the batched decode steps."""

    def __init__(self, fn):
        self.fn = fn
        self.reset()

    def __call__(self, batch):
        t = time.perf_counter()
        try:
            return self.fn(batch)
        finally:
            dt, rows = time.perf_counter() - t, len(batch.token_ids)
            tokens = sum(map(len, batch.token_ids))
            kind = "decode" if tokens == rows else "prefill"
            self.s[kind] += dt
            self.tokens[kind] += tokens
            self.calls[kind] += 1

    def reset(self) -> None:
        self.s = {"prefill": 0.0, "decode": 0.0}
        self.tokens = {"prefill": 0, "decode": 0}
        self.calls = {"prefill": 0, "decode": 0}

    def row(self) -> dict:
        s, tokens, calls = self.s, self.tokens, self.calls
        return {
            "prefill_s": s["prefill"],
            "prefill_tokens": tokens["prefill"],
            "prefill_tok_s": tokens["prefill"] / s["prefill"] if s["prefill"] else None,
            "decode_s": s["decode"],
            "decode_steps": calls["decode"],
            "decode_rows": tokens["decode"] / calls["decode"] if calls["decode"] else None,
            "decode_ms": s["decode"] / calls["decode"] * 1e3 if calls["decode"] else None,
        }


class _RequestProxy:
    """Stands in for the backend's InferRequest to time inference, infer() or start_async() -> wait() (a C++
    object's method cannot be patched)."""

    def __init__(self, request, timer: _Timed):
        self._request, self._timer, self._started = request, timer, None

    def infer(self, *a, **kw):
        return self._timer(*a, **kw)

    def start_async(self, *a, **kw):
        self._started = time.perf_counter()
        return self._request.start_async(*a, **kw)

    def wait(self):
        try:
            return self._request.wait()
        finally:
            self._timer.total += time.perf_counter() - self._started
            self._timer.calls += 1

    def __getattr__(self, name):
        return getattr(self._request, name)


def instrument(engine) -> tuple[dict[str, _Timed], _Kinds]:
    import appliance.runtime.engine.core as engine_module  # where the step calls sample_batch

    kinds = _Kinds(engine.backend.forward)
    timers = {"step": _Timed(engine.step), "forward": _Timed(kinds)}
    engine.step = timers["step"]
    engine.backend.forward = timers["forward"]
    request = getattr(engine.backend, "request", None)
    # A backend that picks its request per step (request_for: the paged one, whose decode steps run other compiled
    # models and whose bound inputs are kept per request) cannot take the proxy: its infer time stays in "forward".
    if request is not None and not hasattr(engine.backend, "request_for"):
        timers["infer"] = _Timed(request.infer)
        engine.backend.request = _RequestProxy(request, timers["infer"])
    if hasattr(engine_module, "sample_batch"):
        timers["sample"] = _Timed(engine_module.sample_batch)
        engine_module.sample_batch = timers["sample"]
    return timers, kinds


def main(argv=None) -> int:
    ap = arg_parser(__doc__, "breakdown", model="default-fp16", levels=True, reps=2)
    ap.add_argument("--cprofile", type=Path, default=None)
    args = ap.parse_args(argv)

    from appliance.manifest import Manifest
    from bench.concurrency import engine_run, genai_run, load_engine, load_genai

    info = machine()
    path = model_dir(args.model)
    vocab = Manifest.load(path).vocab_size
    engine = load_engine(path)
    pipe, _ = load_genai(path, engine)
    timers, kinds = instrument(engine)
    genai_step = _Timed(pipe.step)

    class _Pipe:  # genai_run calls pipe.step(); time it
        def __getattr__(self, name):
            return genai_step if name == "step" else getattr(pipe, name)

    runs, seed = [], 31000
    try:
        with tqdm(total=2 * args.reps * len(args.concurrency), desc="breakdown", file=sys.stderr, leave=False) as bar:
            for rep in range(args.reps):
                for c in args.concurrency:
                    for t in timers.values():
                        t.reset()
                    kinds.reset()
                    r = engine_run(engine, prompts(vocab, c, args.prompt_len, seed), args.new_tokens)
                    seed += 1
                    steps = timers["step"].calls
                    row = {
                        "concurrency": c,
                        "rep": rep,
                        "engine_tok_s": r["tok_s"],
                        "engine_steps": steps,
                        "engine_wall_ms": r["wall_s"] * 1e3,
                    }
                    for name, t in timers.items():
                        row[f"{name}_ms"] = t.total * 1e3
                    row.update(kinds.row())
                    bar.update()
                    genai_step.reset()
                    g = genai_run(_Pipe(), prompts(vocab, c, args.prompt_len, seed), args.new_tokens)
                    seed += 1
                    row.update(
                        {
                            "genai_tok_s": g["tok_s"],
                            "genai_steps": genai_step.calls,
                            "genai_step_ms": genai_step.total * 1e3,
                            "genai_wall_ms": g["wall_s"] * 1e3,
                        }
                    )
                    runs.append(row)
                    bar.update()
        if args.cprofile:
            import cProfile
            import threading

            c = max(args.concurrency)
            prof = cProfile.Profile()
            step = engine.step

            def profiled_step():
                prof.enable()
                try:
                    step()
                finally:
                    prof.disable()

            engine.step = profiled_step
            engine_run(engine, prompts(vocab, c, args.prompt_len, seed), args.new_tokens)
            engine.step = step
            prof.dump_stats(str(args.cprofile))
            print(
                f"wrote {args.cprofile} (cProfile of the engine steps at c={c}; thread "
                f"{threading.current_thread().name} drove the requests)"
            )
    finally:
        engine.shutdown()

    rows = []
    for c in args.concurrency:
        mine = [r for r in runs if r["concurrency"] == c]

        def med(key: str, mine: list[dict] = mine) -> float:
            return median(r[key] for r in mine)

        def per_step(key: str, steps: str = "engine_steps", mine: list[dict] = mine) -> float:
            return median(r[key] / r[steps] for r in mine)

        row = {
            "concurrency": c,
            "engine_tok_s": med("engine_tok_s"),
            "genai_tok_s": med("genai_tok_s"),
            "engine_steps": med("engine_steps"),
            "genai_steps": med("genai_steps"),
            "step_ms": per_step("step_ms"),
            "forward_ms": per_step("forward_ms"),
            "infer_ms": per_step("infer_ms") if "infer_ms" in mine[0] else None,
            "sample_ms": per_step("sample_ms") if "sample_ms" in mine[0] else None,
            "genai_step_ms": per_step("genai_step_ms", "genai_steps"),
            "loop_gap_ms": median((r["engine_wall_ms"] - r["step_ms"]) / r["engine_steps"] for r in mine),
        }
        for key in ("prefill_tok_s", "decode_rows", "decode_ms"):
            values = [r[key] for r in mine if r[key] is not None]
            row[key] = median(values) if values else None
        row["prep_ms"] = row["forward_ms"] - row["infer_ms"] if row["infer_ms"] is not None else None
        row["other_ms"] = row["step_ms"] - row["forward_ms"] - (row["sample_ms"] or 0)
        rows.append(row)
    return finish(
        args,
        "breakdown",
        info,
        rows,
        COLUMNS,
        f"per-step time, {args.model} (engine step = infer + forward prep/copy + sample + other)",
        model_dir=str(path),
        runs=runs,
    )


if __name__ == "__main__":
    sys.exit(main())
