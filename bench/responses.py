"""A continued conversation over the Responses API: turn 2's time to first token with `previous_response_id`
against a cold prefill of the same conversation (the real server, streaming).

Each repetition first runs turn 1 (unary, stored): instructions that start with a fresh salt, a user message of
filler words (about `--conversation-tokens` together with the answer and turn 2's question), `--turn1-tokens`
of answer. Then, in alternating order:

* **warm**: turn 2 streamed with `previous_response_id` (and the same instructions, which OpenAI does not carry
  over): the server rebuilds the conversation from its store, so the prompt starts with turn 1's prompt and
  answer, whose KV blocks the prefix cache still holds;
* **cold**: the same conversation sent whole as input items (turn 1's user message and answer, turn 2's question),
  `store: false`, with a different fresh salt at the start of the instructions: the first KV block differs, so
  nothing of it can come from the prefix cache (`cached_tokens` is reported for both sides to show it).

TTFT = request sent -> first `response.output_text.delta` (or any `*.delta`: a reasoning model's thought first).
The turn-2 rows are medians over repetitions; the ratio is the median of per-repetition warm / cold (the two ran
back to back). `cached_tokens` and `input_tokens` come from the `response.completed` event's usage.

The server gets a data directory of its own (a temporary one): the Responses store is a file there.

    python -m bench.responses [--model default-int4] [--conversation-tokens 1000] [--turn1-tokens 64]
                              [--reps 5] [--quick]
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time

from bench.client import sse_events
from bench.common import (
    LOGS,
    ServerProcess,
    arg_parser,
    machine,
    median,
    model_dir,
    paired_ratio,
    print_table,
    rotate,
    save_results,
)

WORDS = (
    "river stone garden window paper candle orange market silver forest winter engine bridge harbor letter "
    "planet violin meadow ladder pillow rocket thunder castle jacket mirror basket desert island kettle lantern "
    "marble needle pepper rabbit saddle tunnel velvet wallet yellow zipper anchor button copper dragon feather"
).split()


def salt(rng: random.Random) -> str:
    return "-".join(rng.choice(WORDS) for _ in range(4)) + f"-{rng.randrange(10**6):06d}"


def filler(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def instructions(s: str) -> str:
    return f"Session {s}. You are a helpful assistant: answer in plain sentences."


def stream(base: str, body: dict) -> dict:
    """One streamed response: TTFT (first delta), the final usage, the output text."""
    t0 = time.perf_counter()
    ttft, final, error = None, None, None
    for now, event in sse_events(base + "/v3/responses", {**body, "stream": True}):
        if "error" in event and "type" not in event:
            error = event["error"]
            continue
        kind = event.get("type", "")
        if ttft is None and kind.endswith(".delta"):
            ttft = now - t0
        if kind in ("response.completed", "response.incomplete"):
            final = event["response"]
        elif kind == "error":
            error = event.get("message")
    if final is None:
        raise RuntimeError(f"no response.completed: {error}")
    u = final["usage"]
    return {
        "ttft_s": ttft if ttft is not None else float("nan"),
        "total_s": time.perf_counter() - t0,
        "input_tokens": u["input_tokens"],
        "cached_tokens": u["input_tokens_details"]["cached_tokens"],
        "output_tokens": u["output_tokens"],
    }


def turn1(base: str, model: str, inst: str, user: str, new_tokens: int) -> dict:
    import requests

    body = {"model": model, "instructions": inst, "input": user, "max_output_tokens": new_tokens, "temperature": 0}
    r = requests.post(base + "/v3/responses", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def output_text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"])


COLUMNS = [
    ("model", "model", ""),
    ("input_tokens", "turn-2 input tokens", ".0f"),
    ("warm_cached", "warm cached_tokens", ".0f"),
    ("cold_cached", "cold cached_tokens", ".0f"),
    ("warm_ttft_ms", "warm TTFT ms", ".0f"),
    ("cold_ttft_ms", "cold TTFT ms", ".0f"),
    ("ttft_ratio", "warm / cold", ".2f"),
]


def main(argv=None) -> int:
    ap = arg_parser(
        __doc__, "responses", model="default-int4", reps=5, prompt_len=None, new_tokens=None, quick={"reps": 1}
    )
    ap.add_argument("--conversation-tokens", type=int, default=1000, help="turn 2's prompt, about")
    ap.add_argument("--turn1-tokens", type=int, default=64, help="turn 1's max_output_tokens")
    ap.add_argument("--turn2-tokens", type=int, default=8, help="turn 2's max_output_tokens")
    args = ap.parse_args(argv)

    info = machine()
    path = model_dir(args.model)
    rng = random.Random(2024)
    question = "Now name three of the words above, in one short sentence."
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-responses-") as data:
        env_before = os.environ.get("APPLIANCE_DATA_DIR")
        os.environ["APPLIANCE_DATA_DIR"] = data  # the store's file: not the shared data dir
        try:
            with ServerProcess(
                path, "--workers", "1", "--log-level", "warning", log_path=LOGS / "responses.log"
            ) as srv:
                model = srv.model_id()
                # calibrate: tokens per filler word, from a request whose prompt is all filler but the template
                probe = turn1(srv.base, model, instructions(salt(rng)), filler(rng, 200), 1)
                empty = turn1(srv.base, model, instructions(salt(rng)), "", 1)
                per_word = (probe["usage"]["input_tokens"] - empty["usage"]["input_tokens"]) / 200
                overhead = empty["usage"]["input_tokens"] + 30  # the template, the question, the answer's framing
                words = max(10, round((args.conversation_tokens - overhead - args.turn1_tokens) / per_word))
                for rep in range(-1, args.reps):  # rep -1: a warm-up of both paths, not counted
                    inst_a, user = instructions(salt(rng)), filler(rng, words)
                    first = turn1(srv.base, model, inst_a, user, args.turn1_tokens)
                    answer = output_text(first)
                    sides = {
                        "warm": {
                            "model": model,
                            "instructions": inst_a,
                            "previous_response_id": first["id"],
                            "input": question,
                            "max_output_tokens": args.turn2_tokens,
                            "temperature": 0,
                        },
                        "cold": {
                            "model": model,
                            "instructions": instructions(salt(rng)),
                            "input": [
                                {"role": "user", "content": user},
                                {"role": "assistant", "content": answer},
                                {"role": "user", "content": question},
                            ],
                            "max_output_tokens": args.turn2_tokens,
                            "temperature": 0,
                            "store": False,
                        },
                    }
                    order = rotate(["warm", "cold"], rep)
                    for side in order:
                        result = stream(srv.base, sides[side])
                        if rep >= 0:
                            runs.append(
                                {
                                    "impl": side,
                                    "rep": rep,
                                    "first": side == order[0],
                                    "turn1_input_tokens": first["usage"]["input_tokens"],
                                    "turn1_output_tokens": first["usage"]["output_tokens"],
                                    **result,
                                }
                            )
                    print(
                        f"rep {rep}: "
                        + ", ".join(
                            f"{r['impl']} {r['ttft_s'] * 1e3:.0f} ms ({r['cached_tokens']}/{r['input_tokens']} cached)"
                            for r in runs[-2:]
                        )
                        if rep >= 0
                        else "warm-up done",
                        file=sys.stderr,
                    )
        finally:
            if env_before is None:
                os.environ.pop("APPLIANCE_DATA_DIR", None)
            else:
                os.environ["APPLIANCE_DATA_DIR"] = env_before

    def med(side: str, key: str) -> float:
        return median(r[key] for r in runs if r["impl"] == side)

    row = {
        "model": args.model,
        "input_tokens": med("warm", "input_tokens"),
        "warm_cached": med("warm", "cached_tokens"),
        "cold_cached": med("cold", "cached_tokens"),
        "warm_ttft_ms": med("warm", "ttft_s") * 1e3,
        "cold_ttft_ms": med("cold", "ttft_s") * 1e3,
        "ttft_ratio": paired_ratio(runs, "ttft_s", "warm", "cold"),
    }
    print_table(
        [row],
        COLUMNS,
        title=f"turn 2 of a ~{args.conversation_tokens}-token conversation: previous_response_id (warm) vs the same "
        f"conversation cold, {args.reps} reps (ratio = median of per-repetition warm / cold, lower is better)",
    )
    save_results(args, "responses", info, model_dir=str(path), runs=runs, summary=[row])
    return 0


if __name__ == "__main__":
    sys.exit(main())
