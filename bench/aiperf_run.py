"""A standard load client against `appliance serve`: aiperf (NVIDIA's OpenAI-compatible benchmark client, PyPI
`aiperf`, pinned) streams synthetic prompts to /v3/completions and /v3/chat/completions at a fixed concurrency and
counts the requests it could not parse as errors. The check is that a client we did not write reads every stream:
aiperf 0.13 reads completions chunks only when their `object` is "text_completion" (what OpenAI and vLLM send) and
recorded each of our `text_completion.chunk` streams as an error (8 of 8 streamed completions failed,
"No responses with actual content were received"; with "text_completion" 32 of 32 on each endpoint succeed). Exit
status 1 if any request errored or did not complete.

aiperf pulls transformers, pandas, textual and more, none of which may enter the project's venv: it lives in its
own venv (default `$APPLIANCE_DATA_DIR/aiperf-venv`, created on first use, a few minutes). The hub is unreachable,
so its tokenizer (prompt synthesis) is the served model's directory, which aiperf loads as a local path, and the
token counts are the server's own (`--use-server-token-count`, usage in the last chunk). Requests `ignore_eos` so
each produces --new-tokens tokens. Reported per endpoint: requests, errors, TTFT and inter-token latency medians
(aiperf's own, from chunk arrival times) and output tok/s.

    python -m bench.aiperf_run [--model default-fp16] [--concurrency 8] [--requests 32] [--prompt-len 128]
                               [--new-tokens 64] [--workers 2] [--venv DIR]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from appliance.paths import data_dir
from bench.common import LOGS, ServerProcess, arg_parser, machine, model_dir, print_table, save_results

AIPERF = "aiperf==0.13.0"
ENDPOINTS = {"completions": "/v3/completions", "chat": "/v3/chat/completions"}  # aiperf --endpoint-type -> path
COLUMNS = [
    ("endpoint", "endpoint", ""),
    ("requests", "requests", "d"),
    ("errors", "errors", "d"),
    ("ttft_p50_ms", "TTFT p50 ms", ".1f"),
    ("itl_p50_ms", "ITL p50 ms", ".2f"),
    ("output_tok_s", "output tok/s", ".1f"),
]


def ensure_venv(venv: Path) -> Path:
    """The aiperf executable in `venv`, installing the pinned version there first if it is missing or different."""
    exe = venv / "bin" / "aiperf"
    pip = venv / "bin" / "pip"
    if exe.exists():
        shown = subprocess.run([str(pip), "show", "aiperf"], capture_output=True, text=True).stdout
        if f"Version: {AIPERF.split('==')[1]}" in shown:
            return exe
    print(f"installing {AIPERF} into {venv} (a few minutes)", file=sys.stderr, flush=True)
    if not pip.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(pip), "install", "--quiet", AIPERF], check=True)
    return exe


def run_aiperf(exe: Path, base: str, model: str, tokenizer: Path, endpoint: str, args, out_dir: Path) -> dict:
    """One `aiperf profile` run; its summary JSON (profile_export_aiperf.json)."""
    command = [
        str(exe),
        "profile",
        "--model",
        model,
        "--url",
        base,
        "--endpoint-type",
        endpoint,
        "--endpoint",
        ENDPOINTS[endpoint],
        "--streaming",
        "--concurrency",
        str(args.concurrency),
        "--request-count",
        str(args.requests),
        "--tokenizer",
        str(tokenizer),
        "--synthetic-input-tokens-mean",
        str(args.prompt_len),
        "--synthetic-input-tokens-stddev",
        "0",
        "--output-tokens-mean",
        str(args.new_tokens),
        "--extra-inputs",
        "ignore_eos:true",
        "--use-server-token-count",
        "--random-seed",
        "1",
        "--ui-type",
        "none",
        "--no-gpu-telemetry",
        "--artifact-dir",
        str(out_dir),
    ]
    # aiperf's offline mode (HF_HUB_OFFLINE) only looks in the hub cache and refuses a directory; without it a
    # local path is loaded as such, with no hub call
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    log = out_dir / "aiperf.log"
    shutil.rmtree(out_dir, ignore_errors=True)  # no summary of an earlier run may stand in for this one's
    out_dir.mkdir(parents=True)
    print("$ " + " ".join(command), file=sys.stderr, flush=True)
    with log.open("w") as f:
        done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, env=env)
    summary = out_dir / "profile_export_aiperf.json"
    if summary.exists():
        return {"command": command, "exit": done.returncode, "summary": json.loads(summary.read_text())}
    records = out_dir / "profile_export.jsonl"  # every request failed: aiperf exits 1 and writes no summary
    if not records.exists():
        raise SystemExit(f"aiperf exited with {done.returncode}; see {log}:\n{log.read_text()[-3000:]}")
    return {"command": command, "exit": done.returncode, "summary": summary_of_records(records)}


def summary_of_records(path: Path) -> dict:
    """The counts of aiperf's summary from its per-request records (profile_export.jsonl)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    errors: dict[str, int] = {}
    for r in records:
        if r.get("error"):
            errors[r["error"]["message"]] = errors.get(r["error"]["message"], 0) + 1
    return {
        "request_count": {"avg": len(records) - sum(errors.values())},
        "error_request_count": {"avg": sum(errors.values())},
        "error_summary": [{"error_details": {"message": m}, "count": n} for m, n in errors.items()],
    }


def metric(summary: dict, name: str, stat: str = "p50") -> float | None:
    """A statistic of one of aiperf's metrics (the summary maps a metric tag to {unit, avg, p50, ...})."""
    value = summary.get(name)
    return value.get(stat) if isinstance(value, dict) else None


def row(endpoint: str, summary: dict) -> dict:
    errors = summary.get("error_summary") or []
    return {
        "endpoint": ENDPOINTS[endpoint],
        "requests": int(metric(summary, "request_count", "avg") or 0),
        "errors": int(metric(summary, "error_request_count", "avg") or 0) or sum(e.get("count", 1) for e in errors),
        "ttft_p50_ms": metric(summary, "time_to_first_token"),
        "itl_p50_ms": metric(summary, "inter_token_latency"),
        "output_tok_s": metric(summary, "output_token_throughput", "avg"),
        "error_summary": errors,
    }


def main() -> int:
    ap = arg_parser(__doc__, "aiperf", model="default-fp16", prompt_len=128, new_tokens=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32, help="per endpoint")
    ap.add_argument("--workers", type=int, default=2, help="the server's HTTP workers")
    ap.add_argument("--venv", type=Path, default=data_dir() / "aiperf-venv", help="aiperf's own venv")
    ap.add_argument("--endpoints", nargs="+", choices=list(ENDPOINTS), default=list(ENDPOINTS))
    args = ap.parse_args()
    exe = ensure_venv(args.venv)
    path = model_dir(args.model)
    before = machine()
    rows, runs = [], {}
    with ServerProcess(
        path, "--workers", str(args.workers), "--log-level", "warning", log_path=LOGS / "aiperf-serve.log"
    ) as srv:
        model = srv.model_id()
        for endpoint in args.endpoints:
            run = run_aiperf(exe, srv.base, model, path, endpoint, args, LOGS / f"aiperf-{endpoint}")
            runs[endpoint] = run
            rows.append(row(endpoint, run["summary"]))
    print_table(rows, COLUMNS, title=f"{AIPERF}, streaming, concurrency {args.concurrency}, {args.model}")
    save_results(args, "aiperf", before, aiperf=AIPERF, rows=rows, runs=runs)
    failed = [r for r in rows if r["errors"] or r["requests"] < args.requests]
    for r in failed:
        print(f"{r['endpoint']}: {r['errors']} errors, {r['requests']} requests: {r['error_summary']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
