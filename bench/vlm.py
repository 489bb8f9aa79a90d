"""Images in, text out: our server over HTTP against openvino_genai in this process, on the same VLM export,
interleaved (rotating which side goes first in every cell), one 448x448 picture and a short question per request.

- ours (`--sides ours`): `appliance serve --model DIR` on loopback; OpenAI chat on /v3/chat/completions with the
  picture as an `image_url` data URL (JPEG) before the question, `stream: true`, `ignore_eos`, temperature 0.
  TTFT = request sent -> the first chunk (the role, sent with the first token); decode tok/s = (tokens - 1) /
  (the finish chunk, sent with the last token, - the first). Not the text deltas: a random-weight model's greedy
  tokens may all be special tokens, whose text is empty (an answer of 64 `<|im_end|>` has no content event).
- genai (`--sides genai`): at batch 1 `VLMPipeline.generate` (TTFT and decode from a token streamer on the same
  clock); at 4 concurrent requests its `ContinuousBatchingPipeline` (the one genai pipeline that batches VLM requests
  in 2026.4: `add_request(id, prompt, images, config)` for each, then its step loop, each handle read after every
  step, as bench.concurrency drives it for text). Both get our server's compile properties (EngineConfig()
  defaults). genai takes decoded pixels, so its TTFT excludes the JPEG decode ours pays (~2 ms at 448x448).
- the repeated picture (`repeat` cell): the same picture again with another question, right after its first
  request: TTFT of the second / TTFT of the first (our prefix cache keys image tokens by the pixels' digest; target
  <= 0.3). genai's VLMPipeline gets the same pair, for reference (it has no prefix cache there).

Every request in a run gets a fresh picture (smooth random colours, its own seed), so nothing else is a cache hit.
Rows: medians per concurrency; ratios are medians of per-repetition ratios (pairs measured back to back), written
so that >= 1 means ours is faster (the issue's target on both TTFT and decode, at batch 1 and at 4).

    python -m bench.vlm                               # qwen2-vl-2b int4 (bench.vlm_models builds it), both sides
    python -m bench.vlm --sides genai --quick         # genai only: runs before our server serves images
    python -m bench.vlm --model smolvlm-256m --sides ours   # Idefics3: genai 2026.4 has no pipeline for it
    python -m bench.vlm --model /path/to/vlm-export --concurrency 1 4 --reps 5 --new-tokens 64
"""

from __future__ import annotations

import base64
import contextlib
import io
import itertools
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.client import http_run, sse_events
from bench.common import LOGS, ServerProcess, arg_parser, finish, machine, median, paired_ratio, rotate, write_json
from bench.concurrency import genai_steps

IMAGE_SIDE = 448
QUESTIONS = ("What does the gauge read? Answer in one sentence.", "What colour is the label on the left?")
DEFAULT_MODEL = "qwen2-vl-2b"
_ids = itertools.count()


def picture(seed: int) -> bytes:
    """A IMAGE_SIDE-square JPEG of smooth random colours (an 8x8 grid upscaled): a photo's file size, not noise's."""
    from PIL import Image

    grid = np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    image = Image.fromarray(grid, "RGB").resize((IMAGE_SIDE, IMAGE_SIDE), Image.Resampling.BICUBIC)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90)
    return out.getvalue()


def pixels(jpeg: bytes) -> Any:
    """The picture as genai takes it: an ov.Tensor [1, H, W, 3] uint8 (decoded by the same Pillow as our server)."""
    import openvino as ov
    from PIL import Image

    return ov.Tensor(np.array(Image.open(io.BytesIO(jpeg)).convert("RGB"))[None])


def _rates(t0: float, stamps: list[float], new_tokens: int) -> dict:
    if len(stamps) != new_tokens:
        raise RuntimeError(f"expected {new_tokens} tokens, got {len(stamps)}")
    return {"ttft_s": stamps[0] - t0, "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])}


# ---------------------------------------------------------------- ours, over HTTP


def chat_stream(base: str, model: str, request: tuple[bytes, str], new_tokens: int, session=None) -> dict:
    """One streaming chat: the picture as a data URL, then the question. Returns bench.client's stream record
    (content event times, usage's completion tokens) plus this request's decode tok/s."""
    jpeg, question = request
    url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": new_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    times, tokens, text_events, error = [], 0, 0, None
    for now, event in sse_events(base + "/v3/chat/completions", body, session):
        if "error" in event:
            error = str(event["error"])
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        choices = event.get("choices") or ()
        if choices:  # the role chunk (sent with the first token), each text delta, the finish chunk (the last token)
            times.append(now)
            text_events += any(c.get("delta", {}).get("content") for c in choices)
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    decode = (tokens - 1) / span if span > 0 else float("nan")
    return {"times": times, "tokens": tokens, "text_events": text_events, "error": error, "decode_tok_s": decode}


def ours_run(server: ServerProcess, model: str, requests: list[tuple[bytes, str]], new_tokens: int) -> dict:
    """len(requests) clients at once (bench.client.http_run): aggregate tok/s, median TTFT and per-request decode."""
    done: list[dict] = []

    def stream(request: tuple[bytes, str], session: Any) -> dict:
        done.append(chat_stream(server.base, model, request, new_tokens, session))
        return done[-1]

    run = http_run(server.base, model, requests, new_tokens, server.pid, stream=stream)
    return {"tok_s": run["tok_s"], "ttft_s": run["ttft_s"], "decode_tok_s": median(r["decode_tok_s"] for r in done)}


# ---------------------------------------------------------------- openvino_genai, in process


def _config(new_tokens: int) -> Any:
    import openvino_genai as genai

    config = genai.GenerationConfig()
    config.max_new_tokens = config.min_new_tokens = new_tokens
    config.ignore_eos = True
    return config


def genai_one(pipe: Any, request: tuple[bytes, str], new_tokens: int) -> dict:
    """VLMPipeline.generate on one picture and question, timed by a token streamer."""
    import openvino_genai as genai

    class Stamps(genai.StreamerBase):
        def __init__(self) -> None:
            super().__init__()
            self.t: list[float] = []

        def write(self, token: int | list[int]) -> Any:
            self.t += [time.perf_counter()] * (1 if isinstance(token, int) else len(token))
            return genai.StreamingStatus.RUNNING

        def end(self) -> None:
            pass

    image, streamer = pixels(request[0]), Stamps()
    t0 = time.perf_counter()
    pipe.generate(request[1], images=[image], generation_config=_config(new_tokens), streamer=streamer)
    r = _rates(t0, streamer.t, new_tokens)
    return {**r, "tok_s": new_tokens / (streamer.t[-1] - t0)}


def genai_batch(pipe: Any, requests: list[tuple[bytes, str]], new_tokens: int) -> dict:
    """ContinuousBatchingPipeline: every request added at once, then its step loop (bench.concurrency.genai_steps,
    as for text)."""
    images = [pixels(jpeg) for jpeg, _ in requests]
    t0 = time.perf_counter()
    handles = [
        pipe.add_request(next(_ids), question, [image], _config(new_tokens))
        for (_, question), image in zip(requests, images)
    ]
    s = genai_steps(pipe, handles, t0, new_tokens)
    return {"tok_s": s["tok_s"], "ttft_s": s["ttft_s"], "decode_tok_s": s["decode_tok_s_per_request"]}


def load_genai(path: Path, concurrency: int, new_tokens: int) -> tuple[Any, Any, dict]:
    """VLMPipeline and ContinuousBatchingPipeline on `path` with our server's compile properties and scheduler
    limits; the CB pool holds every request of the largest cell twice over."""
    import openvino_genai as genai

    from appliance.config import EngineConfig
    from appliance.runtime.backends.openvino_common import compile_properties

    c = EngineConfig()
    props = compile_properties(c)
    single = genai.VLMPipeline(str(path), "CPU", **props)
    sc = genai.SchedulerConfig()
    sc.max_num_seqs = c.max_num_seqs
    sc.max_num_batched_tokens = c.max_num_batched_tokens
    sc.num_kv_blocks = 2 * concurrency * -(-(400 + new_tokens) // 32)  # ~300 prompt tokens with a 448x448 picture
    sc.dynamic_split_fuse = True
    sc.enable_prefix_caching = False
    batched = genai.ContinuousBatchingPipeline(str(path), sc, "CPU", props)
    settings = {
        "batch_1": "openvino_genai.VLMPipeline.generate + a token streamer",
        "concurrent": "openvino_genai.ContinuousBatchingPipeline (add_request with images + step loop)",
        "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "num_kv_blocks": sc.num_kv_blocks,
        "compile_properties": props,
    }
    return single, batched, settings


# ---------------------------------------------------------------- the run


def summarize(runs: list[dict], levels: list[int], sides: list[str]) -> list[dict]:
    rows = []
    for cell in [*levels, "repeat"]:
        row: dict[str, Any] = {"cell": f"c={cell}" if cell != "repeat" else "repeat"}
        for side in sides:
            mine = [r for r in runs if r["side"] == side and r["cell"] == cell]
            row[f"{side}_ttft_ms"] = median(r["ttft_s"] for r in mine) * 1e3 if mine else None
            row[f"{side}_decode_tok_s"] = median(r["decode_tok_s"] for r in mine) if mine else None
            if cell == "repeat":
                row[f"{side}_repeat_ratio"] = median(r["repeat_ratio"] for r in mine) if mine else None
        if {"ours", "genai"} <= set(sides) and cell != "repeat":
            match = {"cell": cell}
            row["ttft_speedup"] = paired_ratio(runs, "ttft_s", "genai", "ours", side="side", **match)
            row["decode_ratio"] = paired_ratio(runs, "decode_tok_s", "ours", "genai", side="side", **match)
        rows.append(row)
    return rows


COLUMNS = [
    ("cell", "cell", ""),
    ("ours_ttft_ms", "ours TTFT ms", ".0f"),
    ("genai_ttft_ms", "genai TTFT ms", ".0f"),
    ("ttft_speedup", "TTFT genai/ours", ".2f"),
    ("ours_decode_tok_s", "ours tok/s", ".1f"),
    ("genai_decode_tok_s", "genai tok/s", ".1f"),
    ("decode_ratio", "decode ours/genai", ".2f"),
    ("ours_repeat_ratio", "ours repeat/first TTFT", ".2f"),
    ("genai_repeat_ratio", "genai repeat/first TTFT", ".2f"),
]


def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(
        __doc__ or "",
        "vlm",
        model=DEFAULT_MODEL,
        levels=True,
        reps=5,
        prompt_len=None,
        new_tokens=64,
        quick={"reps": 1, "new_tokens": 16},
    )
    ap.set_defaults(concurrency=[1, 4])
    ap.add_argument("--sides", nargs="+", choices=("ours", "genai"), default=["ours", "genai"])
    ap.add_argument("--server-arg", action="append", default=[], help="extra `appliance serve` argument (repeat)")
    args = ap.parse_args(argv)
    from bench.vlm_models import FAMILIES, ensure_model

    path = Path(args.model).expanduser()
    if args.model in FAMILIES:
        path = ensure_model(args.model, "int4")
    elif not path.is_dir():
        raise SystemExit(f"unknown model {args.model!r}: {', '.join(FAMILIES)} (int4) or a VLM export directory")
    info = machine()
    levels, seeds = list(args.concurrency), itertools.count(1)

    def requests(c: int) -> list[tuple[bytes, str]]:
        return [(picture(next(seeds)), QUESTIONS[0]) for _ in range(c)]

    runs: list[dict] = []
    genai_settings: dict = {}
    with contextlib.ExitStack() as stack:
        cells: dict[str, Any] = {}
        if "ours" in args.sides:
            server = stack.enter_context(
                ServerProcess(path, "--log-level", "warning", *args.server_arg, log_path=LOGS / "vlm-serve.log")
            )
            model = server.model_id()
            cells["ours"] = lambda reqs: ours_run(server, model, reqs, args.new_tokens)
        if "genai" in args.sides:
            single, batched, genai_settings = load_genai(path, max(levels), args.new_tokens)
            cells["genai"] = lambda reqs: (
                genai_one(single, reqs[0], args.new_tokens)
                if len(reqs) == 1
                else genai_batch(batched, reqs, args.new_tokens)
            )
        for run in cells.values():  # warm-up: compile, allocate, first-call costs
            run(requests(1))
            run(requests(max(levels)))
        with tqdm(total=args.reps * (len(levels) + 1) * len(cells), desc="vlm", file=sys.stderr) as bar:
            for rep in range(args.reps):
                for k, cell in enumerate([*levels, "repeat"]):
                    for side in rotate(list(cells), rep + k):
                        bar.set_postfix_str(f"{cell} rep {rep + 1} {side}")
                        if cell == "repeat":
                            first = requests(1)
                            a = cells[side](first)
                            b = cells[side]([(first[0][0], QUESTIONS[1])])
                            r = {**b, "first_ttft_s": a["ttft_s"], "repeat_ratio": b["ttft_s"] / a["ttft_s"]}
                        else:
                            r = cells[side](requests(cell))
                        runs.append({"side": side, "cell": cell, "rep": rep, **r})
                        bar.update()
                        write_json(args.out.with_suffix(".partial.json"), {"runs": runs})
    rows = summarize(runs, levels, list(cells))
    title = (
        f"{path}: one {IMAGE_SIDE}x{IMAGE_SIDE} picture + a question, {args.new_tokens} new tokens, medians of "
        f"{args.reps} interleaved repetitions; ratios >= 1: ours faster; repeat: the same picture's 2nd TTFT / 1st"
    )
    return finish(args, "vlm", info, rows, COLUMNS, title, export=str(path), genai_settings=genai_settings, runs=runs)


if __name__ == "__main__":
    sys.exit(main())
