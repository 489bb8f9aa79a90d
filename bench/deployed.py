"""Any export against any GGUF at deployed sizes: our server over HTTP, llama.cpp's server on a GGUF of the same
weights, and openvino_genai's ContinuousBatchingPipeline in this process, side by side in one run, interleaved
(rotating which goes first), with the box's bandwidth measured before every repetition and, per side at batch 1,
the bandwidth limit (bench.bandwidth) and the share of it reached.

bench.http compares exports of the default model with llama.cpp on the default model's GGUF; this one takes any
`--export DIR` and any `--gguf FILE` (e.g. bench.models' random Qwen2.5-1.5B int4 export and its Q4_K_M GGUF made
by bench.gguf). Prompts: random token ids of the export's tokenizer (ids below its size, so every side can decode
them), `--prompt-len` long; llama.cpp gets them as text (bench.llamacpp.text_prompts: re-encoded to exactly that
length by the same tokenizer, which the GGUF carries) with logit_bias keeping it off the special tokens. Every
request runs to `--new-tokens` (ignore_eos / finish_reason length).

- ours: `appliance serve DIR` (its defaults: threads, KV precision, compile properties), /v3/completions streamed.
- llama.cpp: `python -m llama_cpp.server` by --llamacpp-python (n_threads = CPUs), /v1/completions streamed; one
  request at a time (no continuous batching): only at --llamacpp-concurrency (default 1 8).
- native (`--native-side`): a second `appliance serve DIR --kernels openvino`: our server on OpenVINO's own
  low-bit kernels, against `ours` on our kernels (appliance/runtime/kernels; `--kernels auto`, the default).
- genai: ContinuousBatchingPipeline on the same export with our engine's compile properties (EngineConfig's
  defaults: u8 KV, LATENCY hint, cpu_isa's plugin properties), max_num_seqs / max_num_batched_tokens as ours, a KV
  pool for all requests of the largest level; at --genai-concurrency (default 1 8 16). In-process, so it pays no
  HTTP: a conservative comparison for ours.

Columns: aggregate tok/s (tokens / (last token - start)), decode tok/s (decode_rate: after the first token), TTFT;
ratios are medians of per-repetition ours / theirs. The limit table: bytes per token (bench.bandwidth), the best
bandwidth of the probes (a loaded box lowers every probe), limit tok/s, and each side's share of it at batch 1 (its
decode tok/s / limit tok/s); beside it the paired share: per repetition, the side's bytes per second over the
probe taken just before that repetition, the median over repetitions: where the box's memory itself changes
(other tenants of its host), it says how much of what the box gave at the time a side used; the best-probe share
(the target's) how far it is from the best the box gave. The probe times the threads while all of them read
(bench.bandwidth.probe): its wall-time form swung 35-64 GB/s on a 2-vCPU VM whose second vCPU sometimes woke
milliseconds late, while the memory gave ~70 throughout.

    python -m bench.deployed --export /tmp/basedata/bench/qwen2.5-1.5b/openvino-int4 \\
        --gguf /tmp/basedata/bench/qwen2.5-1.5b/qwen2.5-1.5b-q4_k_m.gguf --llamacpp-python /tmp/llama-venv/bin/python \\
        [--concurrency 1 8 16] [--reps 3] [--prompt-len 128] [--new-tokens 64] [--no-genai] [--no-llamacpp]
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.common import (
    LOGS,
    ServerProcess,
    arg_parser,
    finish,
    machine,
    median,
    paired_ratio,
    print_table,
    prompts,
    rotate,
    write_json,
)

COLUMNS = [
    ("concurrency", "conc", "d"),
    ("ours_tok_s", "ours tok/s", ".1f"),
    ("genai_tok_s", "genai CB tok/s", ".1f"),
    ("llamacpp_tok_s", "llama.cpp tok/s", ".1f"),
    ("native_tok_s", "ours-native tok/s", ".1f"),
    ("ratio_native", "ours/native", ".2f"),
    ("ratio_genai", "ours/CB", ".2f"),
    ("ratio_llamacpp", "ours/l.cpp", ".2f"),
    ("ours_ttft_ms", "ours TTFT ms", ".0f"),
    ("genai_ttft_ms", "CB TTFT ms", ".0f"),
    ("llamacpp_ttft_ms", "l.cpp TTFT ms", ".0f"),
    ("ttft_ratio_native", "TTFT ours/native", ".2f"),
    ("ttft_ratio_genai", "TTFT ours/CB", ".2f"),
    ("ttft_ratio_llamacpp", "TTFT ours/l.cpp", ".2f"),
    ("ours_decode_tok_s", "ours decode", ".1f"),
    ("genai_decode_tok_s", "CB decode", ".1f"),
    ("llamacpp_decode_tok_s", "l.cpp decode", ".1f"),
    ("decode_ratio_native", "decode ours/native", ".2f"),
    ("decode_ratio_llamacpp", "decode ours/l.cpp", ".2f"),
]
LIMIT_COLUMNS = [
    ("side", "side", ""),
    ("what", "weights", ""),
    ("bytes_per_token_mb", "MB read/token", ".1f"),
    ("bandwidth_gbps", "GB/s (probe)", ".1f"),
    ("limit_tok_s", "limit tok/s", ".1f"),
    ("decode_tok_s", "batch-1 decode", ".1f"),
    ("share_of_limit", "share", ".2f"),
    ("share_paired", "share (paired)", ".2f"),
]


def load_cb(export: Path, max_concurrency: int, prompt_len: int, new_tokens: int):
    """A ContinuousBatchingPipeline with our engine's defaults (EngineConfig()) and a pool for every request."""
    import openvino_genai as ov_genai

    from appliance.config import EngineConfig
    from appliance.runtime.backends.openvino_common import compile_properties
    from bench.concurrency import genai_run

    c = EngineConfig()
    sc = ov_genai.SchedulerConfig()
    sc.max_num_seqs = c.max_num_seqs
    sc.max_num_batched_tokens = c.max_num_batched_tokens
    sc.num_kv_blocks = 2 * max_concurrency * -(-(prompt_len + new_tokens + 32) // 32)
    sc.dynamic_split_fuse = True
    sc.enable_prefix_caching = False
    props = compile_properties(c)
    pipe = ov_genai.ContinuousBatchingPipeline(str(export), sc, "CPU", props)
    genai_run(pipe, [[100 + i for i in range(16)]], 4)
    settings = {
        "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "num_kv_blocks": sc.num_kv_blocks,
        "compile_properties": props,
    }
    return pipe, settings


def decode_rate(run: dict, new_tokens: int) -> float:
    """A stream's decode tok/s after its first token: (new_tokens - 1) / (last token - first token), from the run's
    wall and median TTFT (exact at one client). Not 1 / ITL: our server's events carry several tokens when the
    detokenizer holds back part of a character (random ids over a byte-level BPE: ~0.3 events per token), so its
    inter-event gaps are not inter-token gaps."""
    span = run["wall_s"] - run["ttft_s"]
    return (new_tokens - 1) / span if span > 0 else 0.0


def summarize(runs: list[dict], levels: list[int]) -> list[dict]:
    rows = []
    for c in levels:
        row: dict[str, Any] = {"concurrency": c}
        for side in ("ours", "native", "genai", "llamacpp"):
            mine = [r for r in runs if r["side"] == side and r["concurrency"] == c]
            if not mine:
                continue
            row[f"{side}_tok_s"] = median(r["tok_s"] for r in mine)
            row[f"{side}_ttft_ms"] = median(r["ttft_s"] for r in mine) * 1e3
            row[f"{side}_decode_tok_s"] = median(r["decode_tok_s"] for r in mine)
            row[f"{side}_loadavg"] = median(r["loadavg_1m"] for r in mine)
            if side != "ours":
                row[f"ratio_{side}"] = paired_ratio(runs, "tok_s", "ours", side, side="side", concurrency=c)
                row[f"ttft_ratio_{side}"] = paired_ratio(runs, "ttft_s", "ours", side, side="side", concurrency=c)
                row[f"decode_ratio_{side}"] = paired_ratio(
                    runs, "decode_tok_s", "ours", side, side="side", concurrency=c
                )
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = arg_parser(__doc__, "deployed", levels=True, reps=3, new_tokens=64, quick={"reps": 1})
    ap.set_defaults(concurrency=[1, 8, 16])
    ap.add_argument("--export", type=Path, required=True, help="an OpenVINO export directory (ours and genai)")
    ap.add_argument("--gguf", type=Path, help="a GGUF of the same weights (llama.cpp's side)")
    ap.add_argument("--llamacpp-python", help="a python with llama-cpp-python[server]")
    ap.add_argument("--llamacpp-threads", type=int, default=os.cpu_count())
    ap.add_argument("--llamacpp-concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--genai-concurrency", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--no-genai", action="store_true")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `appliance serve` argument (repeat)")
    ap.add_argument(
        "--native-side", action="store_true", help="also our server with --kernels openvino (side `native`)"
    )
    args = ap.parse_args(argv)

    from tokenizers import Tokenizer

    from appliance import cpu_isa
    from bench import bandwidth
    from bench.client import http_run
    from bench.concurrency import genai_run
    from bench.llamacpp import LlamaCppServer, isa_report, llamacpp_run, text_prompts

    info = machine()
    levels = list(args.concurrency)
    tokenizer = Tokenizer.from_file(str(args.export / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    special = [i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special]
    logit_bias = {str(i): -1e9 for i in special}
    use_llama = bool(args.gguf and args.llamacpp_python and not args.no_llamacpp)
    runs: list[dict] = []
    probes: list[dict] = []
    genai_settings: dict = {}
    seed = 9000
    with contextlib.ExitStack() as stack:
        sides: dict[str, Any] = {}
        srv = stack.enter_context(
            ServerProcess(args.export, "--log-level", "warning", *args.server_arg, log_path=LOGS / "deployed-serve.log")
        )
        model_id = srv.model_id()
        http_run(srv.base, model_id, prompts(vocab, 2, 16, 1), 4)  # warm-up
        sides["ours"] = (
            levels,
            lambda c, s: http_run(srv.base, model_id, prompts(vocab, c, args.prompt_len, s), args.new_tokens, srv.pid),
        )
        if args.native_side:
            native = stack.enter_context(
                ServerProcess(
                    args.export,
                    "--log-level",
                    "warning",
                    "--kernels",
                    "openvino",
                    *args.server_arg,
                    log_path=LOGS / "deployed-serve-native.log",
                )
            )
            native_id = native.model_id()
            http_run(native.base, native_id, prompts(vocab, 2, 16, 1), 4)
            sides["native"] = (
                levels,
                lambda c, s: http_run(
                    native.base, native_id, prompts(vocab, c, args.prompt_len, s), args.new_tokens, native.pid
                ),
            )
        llama = None
        if use_llama:
            n_ctx = max(2048, args.prompt_len + args.new_tokens + 16)
            llama = stack.enter_context(
                LlamaCppServer(
                    args.llamacpp_python, args.gguf, args.llamacpp_threads, n_ctx, LOGS / "deployed-llamacpp.log"
                )
            )
            llamacpp_run(llama, logit_bias, text_prompts(tokenizer, vocab, 1, 16, 2), 4)

            def theirs(c: int, s: int) -> dict:
                return llamacpp_run(
                    llama, logit_bias, text_prompts(tokenizer, vocab, c, args.prompt_len, s), args.new_tokens
                )

            sides["llamacpp"] = ([c for c in levels if c in args.llamacpp_concurrency], theirs)
        if not args.no_genai:
            pipe, genai_settings = load_cb(args.export, max(levels), args.prompt_len, args.new_tokens)
            sides["genai"] = (
                [c for c in levels if c in args.genai_concurrency],
                lambda c, s: genai_run(pipe, prompts(vocab, c, args.prompt_len, s), args.new_tokens),
            )
        cells = sum(len(lv) for lv, _ in sides.values()) * args.reps
        with tqdm(total=cells, desc="deployed", file=sys.stderr, leave=False) as bar:
            for rep in range(args.reps):
                bar.set_postfix_str("bandwidth probe")
                probes.append(bandwidth.probe(os.cpu_count() or 1))
                for k, c in enumerate(levels):
                    order = rotate([name for name, (lv, _) in sides.items() if c in lv], rep + k)
                    for name in order:
                        bar.set_postfix_str(f"c={c} rep {rep + 1} {name}")
                        r = sides[name][1](c, seed)
                        runs.append(
                            {
                                "side": name,
                                "concurrency": c,
                                "rep": rep,
                                "first": name == order[0],
                                "loadavg_1m": round(os.getloadavg()[0], 2),
                                "decode_tok_s": decode_rate(r, args.new_tokens),
                                **r,
                            }
                        )
                        seed += 1
                        bar.update()
                        # every cell as it ends, so a cut-short run keeps what it measured
                        write_json(args.out.with_suffix(".partial.json"), {"probes": probes, "runs": runs})
        llama_info = (
            {"version": llama.version, "settings": llama.settings, "system_info": llama.system_info} if llama else None
        )

    rows = summarize(runs, levels)
    gbps = max(p["gbps"] for p in probes)  # the best moment: the box delivers at least that
    context = args.prompt_len + args.new_tokens // 2
    limits = []
    b1 = next((r for r in rows if r["concurrency"] == 1), {})
    ours_bytes = bandwidth.export_bytes_per_token(args.export, context)

    def paired(side: str, bytes_per_token: float) -> float | None:
        shares = [
            bytes_per_token * r["decode_tok_s"] / (probes[r["rep"]]["gbps"] * 1e9)
            for r in runs
            if r["side"] == side and r["concurrency"] == 1 and r["decode_tok_s"]
        ]
        return round(median(shares), 3) if shares else None

    measured = [(side, args.export.name, ours_bytes) for side in ("ours", "native", "genai")]
    if use_llama:
        measured.append(("llamacpp", args.gguf.name, bandwidth.gguf_bytes_per_token(args.gguf)))
    for side, what, per_token in measured:
        if f"{side}_decode_tok_s" in b1:
            rate = b1[f"{side}_decode_tok_s"]
            lim = bandwidth.limit_row(per_token, gbps, 1e3 / rate)
            limits.append(
                {"side": side, "what": what, "decode_tok_s": rate, **lim, "share_paired": paired(side, per_token)}
            )
    isa_lines = isa_report(cpu_isa.detect(), llama_info["system_info"] if llama_info else None)
    print_table(
        rows,
        COLUMNS,
        title=f"{args.export} vs {args.gguf.name if args.gguf else '-'}: medians, ratios = median of per-repetition "
        "ours / theirs (TTFT < 1 is better); ours over HTTP, genai CB in-process",
    )
    print("\n".join(isa_lines))
    print_table(
        limits,
        LIMIT_COLUMNS,
        title=f"batch-1 bandwidth limit: bandwidth probe best of {len(probes)} "
        f"({', '.join(str(p['gbps']) for p in probes)} GB/s, {os.cpu_count()} threads), context {context}",
    )
    return finish(
        args,
        "deployed",
        info,
        rows,
        export=str(args.export),
        gguf=str(args.gguf) if args.gguf else None,
        llamacpp=llama_info,
        genai_settings=genai_settings,
        bandwidth_probes=probes,
        export_weight_bytes=bandwidth.export_weight_bytes(args.export),
        gguf_tensor_bytes=bandwidth.gguf_tensor_bytes(args.gguf) if args.gguf else None,
        limits=limits,
        isa_report=isa_lines,
        runs=runs,
    )


if __name__ == "__main__":
    sys.exit(main())
