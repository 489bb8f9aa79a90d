"""Does the built-in web page cost generation anything? Tokens/s of streaming completions with the page open in a
headless Chromium (on its Plots view: /metrics every 2 s and /v1/status every 10 s, five canvases redrawn)
against the same browser on about:blank, on one server, the two arms interleaved (the arm that goes first
alternates every repetition); medians, and the median of the per-repetition ratios open / closed.

The closed arm keeps the browser running (on an empty page) so that the only difference is the page and its
polling, server side and client side: on this 2-core box the browser shares the cores with the server, which an
operator's browser on another machine would not, so the measured cost is an upper bound.

    python -m bench.web_page [--model default-fp16] [--reps 6] [--requests 3] [--new-tokens 128] [--quick]
"""

from __future__ import annotations

import sys
import time

import requests
from tqdm import tqdm

from appliance.testing import browser
from appliance.testing.loopback import parse_metrics
from bench.client import stream_one
from bench.common import (
    ServerProcess,
    arg_parser,
    machine,
    median,
    model_dir,
    paired_ratio,
    print_table,
    prompts,
    rotate,
    save_results,
)

ARMS = ("closed", "open")


def page_polls(base: str) -> float:
    """GET /metrics answered so far (the page's polls, and this one)."""
    metrics = parse_metrics(requests.get(base + "/metrics", timeout=30).text)
    return sum(v for k, v in metrics.items() if k.startswith("appliance_http_requests_total") and '"/metrics"' in k)


def main(argv=None) -> int:
    ap = arg_parser(
        __doc__, "web_page", model="default-fp16", reps=6, prompt_len=128, new_tokens=128, quick={"reps": 2}
    )
    ap.add_argument("--requests", type=int, default=3, help="sequential streams per arm and repetition")
    args = ap.parse_args(argv)
    why = browser.missing()
    if why:
        raise SystemExit(f"bench.web_page needs a browser: {why}")
    info, path = machine(), model_dir(args.model)
    runs = []
    with ServerProcess(path, "--workers", "2") as srv, browser.Browser() as driver:
        model = srv.model_id()
        vocab = 32000  # prompt ids below it: valid for any vocabulary this large (the default model: 49152)
        stream_one(srv.base, model, prompts(vocab, 1, args.prompt_len, 0)[0], 8)  # warm-up
        with tqdm(total=args.reps * len(ARMS), desc="web_page", file=sys.stderr) as bar:
            for rep in range(args.reps):
                for position, arm in enumerate(rotate(ARMS, rep)):
                    driver.get(srv.base + "/#plots" if arm == "open" else "about:blank")
                    time.sleep(3)  # the page's first polls (status, metrics) are made before measuring
                    polls0, began = page_polls(srv.base), time.monotonic()
                    rates = []
                    batch = prompts(vocab, args.requests, args.prompt_len, 1000 * rep + 10 * position + 1)
                    for prompt in batch:
                        one = stream_one(srv.base, model, prompt, args.new_tokens)
                        if one["error"] or len(one["times"]) < 2:
                            raise SystemExit(f"a stream failed: {one['error']}")
                        times = one["times"]
                        rates.append((one["tokens"] - 1) / (times[-1] - times[0]))
                    elapsed = time.monotonic() - began
                    polls = page_polls(srv.base) - polls0 - 1  # less this reading's own GET
                    runs.append(
                        {
                            "impl": arm,
                            "rep": rep,
                            "position": position,
                            "tok_s": median(rates),
                            "polls_per_s": polls / elapsed,
                            "seconds": elapsed,
                        }
                    )
                    bar.update()
    summary = [
        {
            "closed_tok_s": median(r["tok_s"] for r in runs if r["impl"] == "closed"),
            "open_tok_s": median(r["tok_s"] for r in runs if r["impl"] == "open"),
            "open_vs_closed": paired_ratio(runs, "tok_s", "open", "closed"),
            "open_polls_per_s": median(r["polls_per_s"] for r in runs if r["impl"] == "open"),
            "closed_polls_per_s": median(r["polls_per_s"] for r in runs if r["impl"] == "closed"),
        }
    ]
    spread = sorted(
        r_open["tok_s"] / r_closed["tok_s"]
        for rep in range(args.reps)
        for r_open in runs
        for r_closed in runs
        if r_open["rep"] == r_closed["rep"] == rep and r_open["impl"] == "open" and r_closed["impl"] == "closed"
    )
    summary[0]["ratio_min"], summary[0]["ratio_max"] = spread[0], spread[-1]
    print_table(
        summary,
        [
            ("closed_tok_s", "closed tok/s", ".1f"),
            ("open_tok_s", "page open tok/s", ".1f"),
            ("open_vs_closed", "open / closed", ".3f"),
            ("ratio_min", "min", ".3f"),
            ("ratio_max", "max", ".3f"),
            ("open_polls_per_s", "page GET /metrics per s", ".2f"),
        ],
        title=(
            f"decode tok/s of {args.requests} sequential streams ({args.prompt_len} prompt + {args.new_tokens} tokens) "
            f"per arm, {args.reps} interleaved repetitions (medians; ratio: median per repetition)"
        ),
    )
    save_results(args, "web_page", info, model_dir=str(path), runs=runs, summary=summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
