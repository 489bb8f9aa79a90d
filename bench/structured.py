"""Structured output's cost: decode tok/s with a JSON-schema mask (runtime/grammar.py) vs free text, at 1 and 16
concurrent requests on the same engine, interleaved (the arm that goes first alternates every run), medians of
per-run ratios.

Both arms generate exactly --new-tokens tokens per request: the free arm with ignore_eos, the schema arm under
an array schema whose minItems cannot be reached in that many tokens (so neither EOS nor a closed grammar ends it
early), each item an object with a bounded string, an integer and a boolean: structural tokens, keys and free
strings in turn, as real structured output. Decode tok/s per request = (tokens - 1) / (last token - first token),
on the consumer's clock (as bench.concurrency); the mask cost is 1 - schema / free. The median inter-token gap
(ITL p50) of each arm is reported too: on a shared, noisy machine it is the steadier per-step reading.

    python -m bench.structured [--model default-fp16] [--concurrency 1 16] [--runs 5] [--new-tokens 128] [--quick]
"""

from __future__ import annotations

import json
import sys

from tqdm import tqdm

from bench.common import (
    arg_parser,
    finish,
    machine,
    median,
    model_dir,
    paired_ratio,
    prompts,
    rotate,
)
from bench.concurrency import engine_run, engine_settings, load_engine

SCHEMA = {
    "type": "array",
    "minItems": 10_000,  # unreachable within --new-tokens: the grammar never lets the output close
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer"},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "ok"],
        "additionalProperties": False,
    },
}


COLUMNS = [
    ("concurrency", "concurrent", ""),
    ("free_decode", "free tok/s/req", ".1f"),
    ("schema_decode", "schema tok/s/req", ".1f"),
    ("decode_ratio", "ratio", ".3f"),
    ("mask_cost_pct", "cost %", ".1f"),
    ("free_tok_s", "free tok/s", ".1f"),
    ("schema_tok_s", "schema tok/s", ".1f"),
    ("tok_s_ratio", "ratio", ".3f"),
    ("free_itl_ms", "free ITL ms", ".1f"),
    ("schema_itl_ms", "schema ITL ms", ".1f"),
    ("itl_ratio", "ratio", ".3f"),
]


def run(engine, batch: list[list[int]], params) -> dict:
    return engine_run(engine, batch, params.max_tokens, params)


def main(argv=None) -> int:
    from appliance.params import Grammar, SamplingParams

    ap = arg_parser(__doc__, "structured", model="default-fp16", quick={"runs": 2, "new_tokens": 48})
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)

    info = machine()
    path = model_dir(args.model)
    engine = load_engine(path)
    grammar = Grammar("json_schema", json.dumps(SCHEMA, separators=(",", ":"), sort_keys=True))
    arms = [
        ("free", SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)),
        ("schema", SamplingParams(max_tokens=args.new_tokens, grammar=grammar)),
    ]
    vocab, seed, results = engine.manifest.vocab_size, 52000, []
    try:
        run(engine, prompts(vocab, 1, args.prompt_len, seed - 1), SamplingParams(max_tokens=4, grammar=grammar))
        total = len(args.concurrency) * args.runs * len(arms)
        with tqdm(total=total, desc="structured", file=sys.stderr, leave=False) as bar:
            for c in args.concurrency:
                for rep in range(args.runs):
                    for position, (impl, params) in enumerate(rotate(arms, rep)):
                        bar.set_postfix_str(f"c={c} run {rep + 1} {impl}")
                        batch = prompts(vocab, c, args.prompt_len, seed)
                        seed += 1
                        results.append(
                            {
                                "impl": impl,
                                "rep": rep,
                                "position": position,
                                "concurrency": c,
                                **run(engine, batch, params),
                            }
                        )
                        bar.update()
        settings = engine_settings(engine)
    finally:
        engine.shutdown()

    summary = []
    for c in args.concurrency:
        mine = [r for r in results if r["concurrency"] == c]
        row: dict = {"concurrency": c}
        for impl, _ in arms:
            row[f"{impl}_decode"] = median(r["decode_tok_s_per_request"] for r in mine if r["impl"] == impl)
            row[f"{impl}_tok_s"] = median(r["tok_s"] for r in mine if r["impl"] == impl)
            row[f"{impl}_itl_ms"] = 1e3 * median(r["itl_p50_s"] for r in mine if r["impl"] == impl)
        row["decode_ratio"] = paired_ratio(results, "decode_tok_s_per_request", "schema", "free", concurrency=c)
        row["tok_s_ratio"] = paired_ratio(results, "tok_s", "schema", "free", concurrency=c)
        row["itl_ratio"] = paired_ratio(results, "itl_p50_s", "schema", "free", concurrency=c)
        row["mask_cost_pct"] = 100 * (1 - row["decode_ratio"])
        summary.append(row)
    return finish(
        args,
        "structured",
        info,
        summary,
        COLUMNS,
        f"JSON-schema mask vs free text, {args.new_tokens} tokens per request, {args.runs} interleaved runs "
        "(ratio = median of per-run schema / free)",
        model_dir=str(path),
        settings=settings,
        schema=SCHEMA,
        runs=results,
    )


if __name__ == "__main__":
    sys.exit(main())
