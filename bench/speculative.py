"""Speculative decoding, interleaved: our engine without speculation, with prompt lookup and with a draft
model vs openvino_genai.LLMPipeline without and with its own prompt lookup / draft model, at batch 1, greedy, on
input-grounded prompts (summarize / rewrite / extract from a given text, code edits of a given function) and on
free-form chat prompts; then 1 / 2 / 4 / 8 concurrent grounded and chat requests: plain (on the prompt-lookup
engine itself: bench_concurrency says why), prompt lookup as the engine's step-cost policy decides (ours_pl) and
prompt lookup drafting k on every step as it did before the policy (ours_pl_fixed), with aggregate tok/s, tokens per
CPU-second and the load average per run; then decode speed-up against acceptance rate on the large random-weight
shapes.

Prompts come from text every box has offline (Python's stdlib sources and docstrings, /usr/share/common-licenses),
picked by a seed, and go through the model's chat template the way the server renders chat
(Tokenizer.encode_chat): the same token ids go to every side (genai with apply_chat_template off). A per-call
nonce in the system message keeps every side's prefix cache (ours; genai's continuous-batching pipelines behind
prompt lookup / draft; the stateful LLMPipeline's KV reuse) from serving one call's prompt to the next. Outputs stop
at EOS (the engine's EOS ids on every side) or --new-tokens, so the text after EOS (repetitive, an easy target for
lookup) is never counted. Greedy sides produce the same tokens up to rounding: in the default precision (bf16 on
this box) a multi-token verification forward rounds differently from a 1-token one and flips near-ties (ours and
genai alike: 10/16 and 7/16 grounded outputs differed somewhere; with --precision f32, 0/8), so lengths may differ a
little; rates, not times, are compared.

Metrics per call, on the caller's clock: TTFT, decode tok/s = tokens after the first event / (last event - first
event), tokens per step after the first token (genai streams once per step; our engine a chunk per token, so
ours is 1 + accepted drafts per step), acceptance (ours: the last chunk's
accepted / rejected_prediction_tokens; genai's draft: extended_perf_metrics; genai's prompt lookup exposes none,
its tokens per step stands in), and whether our speculative greedy tokens equal our non-speculative ones. Ratios are
medians of per-call ratios (the two sides ran back to back on the same prompt), sides rotating on every prompt.

The acceptance sweep: random weights accept nothing on real text, so the acceptance is controlled instead. Greedy
runs once without speculation; its own output, with a fraction f of the tokens replaced by random ones, becomes the
request's `prediction` (OpenAI's Predicted Outputs, a prompt-lookup source). Reported: decode speed-up vs the
non-speculative run, and the acceptance actually reached (re-tokenizing the corrupted text and the n-gram matching
lose some). Measured: random weights have near-flat logits, so the speculative run leaves the reference within a
few tokens even in f32 and the acceptance reached does not follow f there (it shows speed-up at whatever acceptance
the self-repeating output reaches); on the real default model (`--sweep-models default-fp16`) it does.

genai needs openvino_tokenizer.xml beside a model for prompt lookup / draft: a bench-side copy of each export
(symlinks plus the converted tokenizer) lives under data_dir()/bench/genai/.

Two diagnostics, not in the default set: `--only profile` times our engines' steps by part (forward, proposal,
verification) and by tokens fed; `--only shapes` times backend.forward alone by tokens fed with a steady shape vs a
shape changing every call (the CPU plugin's cost of a shape change, which adaptive draft lengths pay).

    python -m bench.speculative [--model default-fp16] [--draft DIR] [--reps 2] [--prompts 8] [--new-tokens 128]
        [--concurrency 1 2 4 8] [--sweep-models random250m-int8 DIR ...] [--corruption 0 0.1 0.3 0.6 1]
        [--only batch1 concurrency sweep profile shapes] [--sides ours ours_pl ...] [--precision f32]
        [--no-genai] [--quick]
"""

from __future__ import annotations

import ast
import random
import sys
import sysconfig
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from tqdm import tqdm

from bench.common import (
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

# ---------------------------------------------------------------- prompts

STDLIB_MODULES = (
    "textwrap shlex difflib fnmatch posixpath string calendar heapq bisect csv statistics fractions glob "
    "ipaddress configparser pprint gettext mimetypes base64 colorsys dataclasses filecmp ntpath pathlib random "
    "sched shutil tempfile zipfile"
).split()
LICENSES = ("Apache-2.0", "BSD", "MPL-2.0", "Artistic", "LGPL-2.1", "GPL-3")
MAX_CHARS = 1400  # the given text: ~350 tokens, so a call's prefill stays well under its decode
# (task, source, instruction): the input-grounded tasks, whose answers repeat much of the given text
GROUNDED = (
    ("edit: type hints", "function", "Add type hints to this Python function. Reply with the whole edited function."),
    (
        "edit: rename",
        "function",
        "In this Python function, rename `{arg}` to `{arg}_value` everywhere. Reply with the whole edited function.",
    ),
    (
        "edit: comments",
        "function",
        "Add a short comment above each statement of this Python function. Reply with the whole edited function.",
    ),
    ("summarize", "docstring", "Summarize the following documentation in a few sentences."),
    ("summarize", "license", "Summarize this license text in plain English."),
    ("rewrite", "license", "Rewrite the following text in simpler words, keeping every point."),
    (
        "extract",
        "function",
        "List every variable name used in this Python function, one per line, each with the "
        "line where it is first assigned.",
    ),
    (
        "extract",
        "docstring",
        "Quote, one per line, every sentence of the following text that names a function, a class or a parameter.",
    ),
)
CHAT = (
    "What are three good habits for staying healthy? Explain each briefly.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Why is the sky blue? Explain it to a ten-year-old.",
    "Give me some tips for learning a new language as an adult.",
    "Describe an ideal weekend in a few sentences.",
    "What is the difference between weather and climate?",
    "Write a poem about the first snow of winter.",
    "How should I prepare for a job interview at a small company?",
)


def _sources() -> dict[str, list[tuple[str, str]]]:
    """{source kind: [(origin, text)]}, each list sorted (the seed's choice depends on nothing else)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out: dict[str, list[tuple[str, str]]] = {"function": [], "docstring": [], "license": []}
    for name in STDLIB_MODULES:
        path = stdlib / f"{name}.py"
        if not path.is_file():
            continue
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
        doc = ast.get_docstring(tree)
        if doc and 400 <= len(doc) <= 2 * MAX_CHARS:
            out["docstring"].append((f"{name} module docstring", _cut(doc)))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.end_lineno:
                doc = ast.get_docstring(node)
                if isinstance(node, ast.ClassDef) and doc and len(doc) >= 400:
                    out["docstring"].append((f"{name}.{node.name} docstring", _cut(doc)))
                lines = node.end_lineno - node.lineno + 1
                text = ast.get_source_segment(source, node, padded=True) or ""
                if isinstance(node, ast.FunctionDef) and 8 <= lines <= 35 and len(text) <= MAX_CHARS:
                    out["function"].append((f"{name}.{node.name}:{node.lineno}", _dedent(text)))
    licenses = Path("/usr/share/common-licenses")
    for name in LICENSES:
        if (licenses / name).is_file():
            paragraphs = (licenses / name).read_text(encoding="utf-8", errors="replace").split("\n\n")
            for k, para in enumerate(paragraphs):
                if 400 <= len(para.strip()) <= MAX_CHARS:
                    out["license"].append((f"{name} paragraph {k}", para.strip()))
    if not out["license"]:  # no common-licenses (not Debian): docstrings stand in
        out["license"] = out["docstring"]
    return {k: sorted(v) for k, v in out.items()}


def _cut(text: str) -> str:
    """At most MAX_CHARS, cut at a line end."""
    return text if len(text) <= MAX_CHARS else text[: text.rfind("\n", 0, MAX_CHARS)].rstrip()


def _dedent(text: str) -> str:
    import textwrap

    return textwrap.dedent(text).strip("\n")


def _first_arg(function_source: str) -> str:
    node = ast.parse(function_source).body[0]
    assert isinstance(node, ast.FunctionDef)
    names = [
        a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs if a.arg not in ("self", "cls")
    ]
    return names[0] if names else node.name


def prompt_set(n: int, seed: int) -> list[dict]:
    """n input-grounded and n free-form chat prompts: {kind, task, origin, messages} (messages without the
    system turn: each call adds its own, with a nonce)."""
    rng = random.Random(seed)
    sources = _sources()
    used: set[str] = set()
    out = []
    for k in range(n):
        task, source, instruction = GROUNDED[k % len(GROUNDED)]
        origin, text = rng.choice([s for s in sources[source] if s[0] not in used] or sources[source])
        used.add(origin)
        if "{arg}" in instruction:
            instruction = instruction.format(arg=_first_arg(text))
        body = f"```python\n{text}\n```" if source == "function" else text
        out.append(
            {
                "kind": "grounded",
                "task": task,
                "origin": origin,
                "messages": [{"role": "user", "content": f"{instruction}\n\n{body}"}],
            }
        )
    for k in range(n):
        out.append(
            {
                "kind": "chat",
                "task": "chat",
                "origin": f"chat {k % len(CHAT)}",
                "messages": [{"role": "user", "content": CHAT[k % len(CHAT)]}],
            }
        )
    return out


def render(tokenizer, prompt: dict, nonce: int) -> list[int]:
    """The prompt's ids as the server renders chat, with a system turn that differs on every call."""
    system = {"role": "system", "content": f"You are a helpful AI assistant. Conversation {nonce}."}
    return tokenizer.encode_chat([system, *prompt["messages"]], add_generation_prompt=True)


# ---------------------------------------------------------------- one call per side


def _timing(t0: float, events: list[tuple[float, int]]) -> dict:
    """events: (time, tokens) per stream event. decode tok/s and tokens per step count after the first event
    (genai streams once per step; our engine once per token: ours_call counts its steps from the acceptance)."""
    n = sum(k for _, k in events)
    out = {"n_tokens": n, "ttft_s": events[0][0] - t0 if events else float("nan"), "events": len(events)}
    if len(events) > 1 and events[-1][0] > events[0][0]:
        out["decode_tok_s"] = (n - events[0][1]) / (events[-1][0] - events[0][0])
        out["tokens_per_step"] = (n - events[0][1]) / (len(events) - 1)
    else:
        out["decode_tok_s"] = out["tokens_per_step"] = float("nan")
    return out


def ours_call(engine, ids: list[int], params) -> dict:
    events: list[tuple[float, int]] = []
    tokens: list[int] = []
    last = None
    t0 = time.perf_counter()
    for chunk in engine.submit(ids, params):
        if chunk.token_ids:
            events.append((time.perf_counter(), len(chunk.token_ids)))
            tokens += chunk.token_ids
        last = chunk
    assert last is not None
    accepted, rejected = last.accepted_prediction_tokens, last.rejected_prediction_tokens
    timing = _timing(t0, events)
    if events:  # a chunk per token, not per step: a step keeps its accepted drafts and one token of its own
        after_first = timing["n_tokens"] - events[0][1]
        timing["tokens_per_step"] = after_first / (after_first - accepted) if after_first > accepted else float("nan")
    return {
        **timing,
        "tokens": tokens,
        "finish": last.finish_reason,
        "accepted": accepted,
        "drafted": accepted + rejected,
        "acceptance": accepted / (accepted + rejected) if accepted + rejected else None,
    }


def genai_call(pipe, ids: list[int], config) -> dict:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    class Stamps(ov_genai.StreamerBase):
        def __init__(self) -> None:
            super().__init__()
            self.events: list[tuple[float, int]] = []

        def write(self, token):
            self.events.append((time.perf_counter(), 1 if isinstance(token, int) else len(token)))
            return ov_genai.StreamingStatus.RUNNING

        def end(self) -> None:
            pass

    streamer = Stamps()
    t0 = time.perf_counter()
    res = pipe.generate(ov.Tensor(np.array([ids], np.int64)), config, streamer=streamer)
    out = {**_timing(t0, streamer.events), "tokens": [int(t) for t in res.tokens[0]], "accepted": None}
    out["acceptance"] = out["drafted"] = None
    sd = getattr(res, "extended_perf_metrics", None)  # draft model: SDPerModelsPerfMetrics
    if sd is not None and hasattr(sd, "get_num_draft_tokens"):
        out["accepted"], out["drafted"] = sd.get_num_accepted_tokens(), sd.get_num_draft_tokens()
        out["acceptance"] = out["accepted"] / out["drafted"] if out["drafted"] else None
    return out


# ---------------------------------------------------------------- loading the sides


def genai_dir(path: Path) -> Path:
    """A copy of export `path` genai's speculative pipelines accept: symlinks to its files plus
    openvino_tokenizer.xml / openvino_detokenizer.xml converted from its tokenizer.json (cached)."""
    from appliance.paths import data_dir

    out = data_dir() / "bench" / "genai" / "-".join(path.resolve().parts[-3:])
    if (out / "openvino_detokenizer.xml").is_file() and (out / "source").read_text() == str(path.resolve()):
        return out
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    for f in path.resolve().iterdir():
        link = out / f.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(f)
    tok, detok = convert_tokenizer(AutoTokenizer.from_pretrained(path), with_detokenizer=True)
    ov.save_model(tok, out / "openvino_tokenizer.xml")
    ov.save_model(detok, out / "openvino_detokenizer.xml")
    (out / "source").write_text(str(path.resolve()))
    return out


def _policy_info(engine) -> dict:
    """The step costs the engine's speculation policy measured at load (ms by batch and tokens fed)."""
    policy = engine.speculation.policy
    if policy is None:
        return {}
    c = policy.costs
    return {
        "step_costs_ms": {
            f"b={b}": dict(zip(c.fed, (round(1e3 * t, 2) for t in row))) for b, row in zip(c.batches, c.seconds)
        },
        "shape_switch_ms": round(1e3 * c.switch, 2),
        "measured_s": round(c.measured_s, 3),
    }


class Sides:
    """The batch-1 sides on one model: ours (no speculation), ours_pl (prompt lookup), ours_draft (with a draft),
    genai, genai_pl, genai_draft (unless no_genai). `calls`: [(side, call(ids) -> result)]."""

    def __init__(self, path: Path, draft: Path | None, args) -> None:
        from appliance.config import EngineConfig
        from appliance.params import SamplingParams
        from bench.concurrency import engine_settings, load_engine

        k, ngram = args.num_assistant_tokens, args.max_ngram_size
        common = {"precision": args.precision}
        configs = {
            "ours": EngineConfig(**common),
            "ours_pl": EngineConfig(prompt_lookup=True, num_assistant_tokens=k, max_ngram_size=ngram, **common),
        }
        # prompt lookup as it was before the step-cost policy: every sequence drafts k on every step
        configs["ours_pl_fixed"] = configs["ours_pl"]
        if draft is not None:
            configs["ours_draft"] = EngineConfig(draft_model=str(draft), num_assistant_tokens=k, **common)
        self.engines = {}
        self.load_s: dict[str, float] = {}
        try:
            for name, config in configs.items():
                if name == "ours" or name in args.sides:
                    t0 = time.perf_counter()
                    self.engines[name] = load_engine(path, config)
                    self.load_s[name] = time.perf_counter() - t0
                    if name == "ours_pl_fixed":
                        self.engines[name].speculation.policy = None
            base = self.engines["ours"]
            self.tokenizer, self.eos = base.tokenizer, set(base.eos_token_ids)
            params = SamplingParams(max_tokens=args.new_tokens)
            self.calls: list[tuple[str, Callable[[list[int]], dict]]] = [
                (n, partial(ours_call, e, params=params)) for n, e in self.engines.items()
            ]
            self.settings: dict = {
                n: {**engine_settings(e), "config": repr(e.config), "load_s": self.load_s[n], **_policy_info(e)}
                for n, e in self.engines.items()
            }
            if not args.no_genai:
                self._genai(path, draft, args, base)
        except BaseException:
            self.close()
            raise

    def _genai(self, path: Path, draft: Path | None, args, base) -> None:
        import openvino_genai as ov_genai

        from appliance.runtime.backends.openvino_common import compile_properties

        props = compile_properties(base.config)  # the engine's, so only the generation loops differ
        gpath = str(genai_dir(path))
        kinds: dict[str, dict] = {"genai": {}, "genai_pl": {"prompt_lookup": True}}
        if draft is not None:
            kinds["genai_draft"] = {"draft_model": ov_genai.draft_model(str(genai_dir(draft)), "CPU", **props)}
        pipes = {n: ov_genai.LLMPipeline(gpath, "CPU", **kw, **props) for n, kw in kinds.items() if n in args.sides}
        for name, pipe in pipes.items():
            cfg = pipe.get_generation_config()
            cfg.max_new_tokens = args.new_tokens
            cfg.do_sample = False
            cfg.apply_chat_template = False
            cfg.stop_token_ids = self.eos
            if name != "genai":
                cfg.num_assistant_tokens = args.num_assistant_tokens
            if name == "genai_pl":
                cfg.max_ngram_size = args.max_ngram_size
            genai_call(pipe, [100 + i for i in range(16)], cfg)  # compile
            self.calls.append((name, partial(genai_call, pipe, config=cfg)))
            self.settings[name] = {
                "impl": "openvino_genai.LLMPipeline" + (" (prompt_lookup)" if name == "genai_pl" else ""),
                "path": gpath,
                "draft": str(draft) if name == "genai_draft" else None,
                "compile_properties": props,
                "num_assistant_tokens": cfg.num_assistant_tokens,
                "max_ngram_size": cfg.max_ngram_size,
            }

    def close(self) -> None:
        for e in self.engines.values():
            e.shutdown()


# ---------------------------------------------------------------- batch 1


def _strip(tokens: list[int], eos: set[int]) -> list[int]:
    while tokens and tokens[-1] in eos:
        tokens = tokens[:-1]
    return tokens


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where a and b differ (a length difference counts), or None."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def bench_batch1(sides: Sides, prompt_list: list[dict], reps: int, bar) -> list[dict]:
    """Every prompt on every side, rep times, the side order rotating on each prompt; one record per call."""
    runs = []
    for rep in range(reps):
        for i, prompt in enumerate(prompt_list):
            nonce = 1000 * rep + i
            ids = render(sides.tokenizer, prompt, nonce)
            results = {}
            for position, (side, call) in enumerate(rotate(sides.calls, nonce)):
                bar.set_postfix_str(f"{prompt['kind']} {i} rep {rep + 1} {side}")
                results[side] = {
                    "impl": side,
                    "rep": f"{rep}:{i}",
                    "kind": prompt["kind"],
                    "task": prompt["task"],
                    "origin": prompt["origin"],
                    "prompt_tokens": len(ids),
                    "position": position,
                    **call(ids),
                }
                bar.update()
            base = _strip(results["ours"]["tokens"], sides.eos)
            for r in results.values():
                r["first_difference"] = _first_difference(_strip(r.pop("tokens"), sides.eos), base)
                runs.append(r)
    return runs


SIDES = ("ours", "ours_pl", "ours_pl_fixed", "ours_draft", "genai", "genai_pl", "genai_draft")


def batch1_rows(runs: list[dict]) -> list[dict]:
    """Per (kind, side): medians, pooled acceptance, greedy mismatches vs ours."""
    rows = []
    for kind in ("grounded", "chat"):
        for side in SIDES:
            mine = [r for r in runs if r["kind"] == kind and r["impl"] == side]
            if not mine:
                continue
            drafted = sum(r["drafted"] or 0 for r in mine)
            rows.append(
                {
                    "kind": kind,
                    "side": side,
                    "calls": len(mine),
                    "tokens": median(r["n_tokens"] for r in mine),
                    "decode_tok_s": median(r["decode_tok_s"] for r in mine),
                    "ttft_ms": median(r["ttft_s"] for r in mine) * 1e3,
                    "tokens_per_step": median(r["tokens_per_step"] for r in mine),
                    "acceptance": sum(r["accepted"] or 0 for r in mine) / drafted if drafted else None,
                    "vs_ours": paired_ratio(runs, "decode_tok_s", side, "ours", kind=kind) if side != "ours" else None,
                    "ttft_vs_ours": paired_ratio(runs, "ttft_s", side, "ours", kind=kind) if side != "ours" else None,
                    "differ": f"{sum(r['first_difference'] is not None for r in mine)}/{len(mine)}",
                }
            )
    return rows


def task_rows(runs: list[dict]) -> list[dict]:
    """Grounded prompts by task: what prompt lookup reaches on each."""
    rows = []
    for task in dict.fromkeys(r["task"] for r in runs if r["kind"] == "grounded"):
        pl = [r for r in runs if r["task"] == task and r["impl"] == "ours_pl"]
        row = {"task": task, "calls": len(pl)}
        if pl:
            drafted = sum(r["drafted"] or 0 for r in pl)
            row["acceptance"] = sum(r["accepted"] or 0 for r in pl) / drafted if drafted else None
            row["tokens_per_step"] = median(r["tokens_per_step"] for r in pl)
        for side in ("genai_pl", "genai_draft", "ours_draft"):
            mine = [r for r in runs if r["task"] == task and r["impl"] == side]
            if mine:
                row[f"{side}_tokens_per_step"] = median(r["tokens_per_step"] for r in mine)
        for a, b in (("ours_pl", "ours"), ("ours_pl", "genai_pl"), ("genai_pl", "genai"), ("ours_draft", "ours")):
            row[f"{a}/{b}"] = paired_ratio(runs, "decode_tok_s", a, b, task=task, kind="grounded")
        rows.append(row)
    return rows


# ---------------------------------------------------------------- concurrency


def ours_batch(engine, batch: list[list[int]], params) -> dict:
    """All of `batch` submitted at once (bench.concurrency.stream_all); aggregate tok/s to the last token, and per
    CPU-second of this process (one engine runs at a time: its threads' CPU, less sensitive to other processes)."""
    import os

    from bench.concurrency import stream_all

    stats0 = engine.stats()
    cpu0 = time.process_time()
    t0, events, outputs, _ = stream_all(engine, batch, params)
    cpu = time.process_time() - cpu0
    end = max(e[-1] for e in events)
    stats1 = engine.stats()
    drafted = stats1.get("draft_tokens", 0) - stats0.get("draft_tokens", 0)
    accepted = stats1.get("accepted_draft_tokens", 0) - stats0.get("accepted_draft_tokens", 0)
    n = sum(map(len, outputs))
    return {
        "tok_s": n / (end - t0),
        "cpu_tok_s": n / cpu if cpu > 0 else float("nan"),
        "ttft_s": median(e[0] - t0 for e in events),
        "n_tokens": n,
        "acceptance": accepted / drafted if drafted else None,
        "drafted": drafted,
        "load1": os.getloadavg()[0],
        "outputs": outputs,
    }


CONC_SIDES = ("ours", "ours_pl", "ours_pl_fixed")


def bench_concurrency(
    sides: Sides, prompt_list: list[dict], levels: list[int], reps: int, new_tokens: int, bar
) -> list[dict]:
    """c prompts of each kind at once (the kind's prompts cycled, every request its own nonce) on ours and the
    prompt-lookup sides, the side order rotating per (rep, level, kind).

    Plain decoding ("ours") runs on the prompt-lookup engine itself, its requests asking for no drafts
    (num_assistant_tokens 0), so that the ratio compares speculation alone: two identical engines in one
    process were 1.02-1.16x apart at one chat request (8 of 8 reps, median 1.05; the default model on the 2-vCPU
    Xeon), as wide as the cells' distance from 1.0. Each side has its own prefix-cache scope (cache_scope), so the
    second side of a pair does not find the first one's prompts cached."""
    from dataclasses import replace

    from appliance.params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens)
    pair = [("ours", sides.engines["ours_pl"], replace(params, num_assistant_tokens=0, cache_scope="ours"))]
    pair += [(n, sides.engines[n], replace(params, cache_scope=n)) for n in CONC_SIDES[1:] if n in sides.engines]
    kinds = {kind: [p for p in prompt_list if p["kind"] == kind] for kind in ("grounded", "chat")}
    runs = []
    for rep in range(reps):
        for j, c in enumerate(levels):
            for q, (kind, chosen) in enumerate(kinds.items()):
                if not chosen:
                    continue
                batch = [
                    render(
                        sides.tokenizer, chosen[(rep * c + i) % len(chosen)], 100000 + 1000 * rep + 100 * j + 10 * q + i
                    )
                    for i in range(c)
                ]
                results = {}
                for side, engine, side_params in rotate(pair, rep + j + q):
                    bar.set_postfix_str(f"{kind} c={c} rep {rep + 1} {side}")
                    results[side] = {
                        "impl": side,
                        "rep": rep,
                        "kind": kind,
                        "concurrency": c,
                        **ours_batch(engine, batch, side_params),
                    }
                    bar.update()
                base = [_strip(o, sides.eos) for o in results["ours"]["outputs"]]
                for r in results.values():
                    r["differ"] = sum(_strip(o, sides.eos) != b for o, b in zip(r.pop("outputs"), base))
                    runs.append(r)
    return runs


def concurrency_rows(runs: list[dict]) -> list[dict]:
    rows = []
    for kind in dict.fromkeys(r["kind"] for r in runs):
        for c in dict.fromkeys(r["concurrency"] for r in runs):
            mine = {
                s: [r for r in runs if (r["kind"], r["concurrency"], r["impl"]) == (kind, c, s)] for s in CONC_SIDES
            }
            if not mine["ours"]:
                continue
            row: dict = {
                "kind": kind,
                "concurrency": c,
                "reps": len(mine["ours"]),
                "load1": median(r["load1"] for rs in mine.values() for r in rs),
                "ours_tok_s": median(r["tok_s"] for r in mine["ours"]),
            }
            for side in CONC_SIDES[1:]:
                if not mine[side]:
                    continue
                drafted = sum(r["drafted"] for r in mine[side])
                row[f"{side}_tok_s"] = median(r["tok_s"] for r in mine[side])
                row[f"{side}_ratio"] = paired_ratio(runs, "tok_s", side, "ours", concurrency=c, kind=kind)
                row[f"{side}_cpu_ratio"] = paired_ratio(runs, "cpu_tok_s", side, "ours", concurrency=c, kind=kind)
                row[f"{side}_ttft_ratio"] = paired_ratio(runs, "ttft_s", side, "ours", concurrency=c, kind=kind)
                row[f"{side}_acceptance"] = (
                    sum((r["acceptance"] or 0) * r["drafted"] for r in mine[side]) / drafted if drafted else None
                )
                row[f"{side}_drafted"] = drafted
                row[f"{side}_differ"] = f"{sum(r['differ'] for r in mine[side])}/{c * len(mine[side])}"
            rows.append(row)
    return rows


# ---------------------------------------------------------------- speed-up vs acceptance (random weights)


def corrupt(tokens: list[int], f: float, vocab: int, rng: random.Random) -> list[int]:
    """tokens with round(f * len) of them, at random positions, replaced by other random (non-special) ids."""
    out = list(tokens)
    for i in rng.sample(range(len(out)), round(f * len(out))):
        out[i] = rng.choice([t for t in (rng.randrange(3, vocab) for _ in range(2)) if t != out[i]] or [3])
    return out


def default_sweep_models() -> list[str]:
    """The large random-weight exports already built (bench/models.py); random250m-int8 (built here) if none."""
    from appliance.manifest import MANIFEST_NAME
    from bench.models import FAMILIES, root

    built = [
        str(d) for name in FAMILIES for d in sorted(root(name).glob("openvino-int*")) if (d / MANIFEST_NAME).is_file()
    ]
    return built or ["random250m-int8"]


def bench_sweep(
    name: str,
    fractions: list[float],
    reps: int,
    prompt_len: int,
    new_tokens: int,
    k: int,
    bar,
    seed: int,
    precision: str | None = None,
) -> list[dict]:
    """Per rep: a fresh random prompt, an untimed greedy reference run, then the non-speculative run and one run
    per corruption fraction f with the corrupted reference as `prediction`, the order rotating. Random weights
    give near-flat logits: in bf16 the verification's multi-token forward flips near-ties, the output leaves the
    reference and the prediction stops matching whatever f is; --precision f32 keeps the output on it."""
    from appliance.config import EngineConfig
    from appliance.params import SamplingParams
    from bench.concurrency import load_engine

    path = model_dir(name)
    engine = load_engine(path, EngineConfig(num_assistant_tokens=k, precision=precision))
    runs = []
    try:
        tok = engine.tokenizer
        vocab = min(tok.vocab_size, engine.manifest.vocab_size)
        # an LM head wider than the tokenizer (the Qwen shapes: 151936 vs 32000 ids) would draw ids no text can
        # carry into `prediction`: banned on every run alike (one vectorized add per sampled row)
        ban = {t: -1e4 for t in range(vocab, engine.manifest.vocab_size)}
        plain = SamplingParams(max_tokens=new_tokens, ignore_eos=True, logit_bias=ban)
        for rep in range(reps):
            rng = random.Random(seed + rep)
            prompt = prompts(vocab, 1, prompt_len, seed + rep)[0]
            bar.set_postfix_str(f"{Path(name).name} rep {rep + 1} reference")
            reference = ours_call(engine, prompt, plain)["tokens"]
            sides: list[tuple[str, float | None, object]] = [("none", None, plain)]
            for f in fractions:
                text = tok.decode(corrupt(reference, f, vocab, rng), skip_special_tokens=False)
                sides.append(
                    (
                        f"f={f:g}",
                        f,
                        SamplingParams(max_tokens=new_tokens, ignore_eos=True, logit_bias=ban, prediction=text),
                    )
                )
            for position, (side, f, params) in enumerate(rotate(sides, rep)):
                bar.set_postfix_str(f"{Path(name).name} rep {rep + 1} {side}")
                r = ours_call(engine, prompt, params)
                r["first_difference"] = _first_difference(r.pop("tokens"), reference)
                r["same"] = r["first_difference"] is None
                runs.append({"model": name, "impl": side, "fraction": f, "rep": rep, "position": position, **r})
                bar.update()
    finally:
        engine.shutdown()
    return runs


def sweep_rows(runs: list[dict]) -> list[dict]:
    rows = []
    for model in dict.fromkeys(r["model"] for r in runs):
        mine = [r for r in runs if r["model"] == model]
        base = [r for r in mine if r["impl"] == "none"]
        for side in dict.fromkeys(r["impl"] for r in mine if r["impl"] != "none"):
            these = [r for r in mine if r["impl"] == side]
            drafted = sum(r["drafted"] for r in these)
            rows.append(
                {
                    "model": Path(model).parent.name + "/" + Path(model).name if "/" in model else model,
                    "corruption": these[0]["fraction"],
                    "acceptance": sum(r["accepted"] for r in these) / drafted if drafted else None,
                    "tokens_per_step": median(r["tokens_per_step"] for r in these),
                    "base_tok_s": median(r["decode_tok_s"] for r in base),
                    "tok_s": median(r["decode_tok_s"] for r in these),
                    "speedup": paired_ratio(mine, "decode_tok_s", side, "none"),
                    "same": f"{sum(r['same'] for r in these)}/{len(these)}",
                }
            )
    return rows


# ---------------------------------------------------------------- where the time goes (--only profile)


class StepProfiler:
    """Times one engine's steps and their parts: instance attributes shadow Engine.step, engine.speculation's
    propose / verify and backend.forward (the engine thread calls them through their objects), so nothing in
    appliance/ changes. Per step: wall, forward, propose, verify (its per-position sampling and appends included),
    tokens fed and tokens emitted."""

    def __init__(self, engine) -> None:
        self.engine, self.on = engine, False
        self.steps: list[dict] = []
        self.cur: dict = {}
        for name in ("propose", "verify"):
            setattr(engine.speculation, name, self._timed(getattr(engine.speculation, name), name))
        engine.backend.forward = self._timed(engine.backend.forward, "forward")
        step = engine.step

        def timed_step() -> None:
            self.cur = {"forward": 0.0, "propose": 0.0, "verify": 0.0, "fed": 0}
            before = engine.counters["generated_tokens"]
            t0 = time.perf_counter()
            step()
            self.cur["wall"] = time.perf_counter() - t0
            self.cur["emitted"] = engine.counters["generated_tokens"] - before
            if self.on and self.cur["fed"]:
                self.steps.append(self.cur)

        engine.step = timed_step

    def _timed(self, fn: Callable, name: str) -> Callable:
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.cur[name] = self.cur.get(name, 0.0) + time.perf_counter() - t0
                if name == "forward":
                    self.cur["fed"] = a[0].num_tokens

        return timed


def bench_profile(sides: Sides, grounded: list[dict], bar) -> list[dict]:
    """Every grounded prompt once on each of our sides, profiled; one row per (side, tokens fed per decode step)."""
    profilers = {n: StepProfiler(e) for n, e in sides.engines.items()}
    for i, prompt in enumerate(grounded):
        ids = render(sides.tokenizer, prompt, 200000 + i)
        for name, call in rotate([c for c in sides.calls if c[0] in profilers], i):
            bar.set_postfix_str(f"profile {i} {name}")
            profilers[name].on = True
            call(ids)
            profilers[name].on = False
            bar.update()
    rows = []
    for name, prof in profilers.items():
        decode = [s for s in prof.steps if s["fed"] <= 16]  # batch 1: a prefill step feeds the prompt
        total = sum(s["wall"] for s in decode)
        emitted = sum(s["emitted"] for s in decode)
        rows.append(
            {
                "side": name,
                "fed": "all",
                "steps": len(decode),
                "emitted": emitted,
                "ms_per_token": 1e3 * total / emitted if emitted else None,
                **{
                    f"{k}_pct": 100 * sum(s[k] for s in decode) / total if total else None
                    for k in ("forward", "propose", "verify")
                },
            }
        )
        for fed in sorted({s["fed"] for s in decode}):
            mine = [s for s in decode if s["fed"] == fed]
            rows.append(
                {
                    "side": name,
                    "fed": str(fed),
                    "steps": len(mine),
                    "emitted": sum(s["emitted"] for s in mine),
                    **{f"{k}_ms": 1e3 * median(s[k] for s in mine) for k in ("wall", "forward", "propose", "verify")},
                    "tokens_per_step": sum(s["emitted"] for s in mine) / len(mine),
                }
            )
    return rows


def bench_shapes(path: Path, rounds: int, context: int = 480) -> list[dict]:
    """backend.forward alone at batch 1, one sequence `context` tokens in, feeding n = 1..6 tokens (1 + drafts,
    logits at every position as verification asks): the same n on every call (steady) vs n changing on every
    call, the patterns interleaved round by round. Separates what verifying n tokens costs from what a change of
    the input shape between calls costs."""
    import numpy as np

    from appliance.runtime.backends.base import StepBatch
    from bench.concurrency import load_engine

    engine = load_engine(path)
    try:
        backend, pool = engine.backend, engine.pool
        blocks = pool.allocate(pool.blocks_for(context + 8))  # the engine is idle: its pool has room
        rng = np.random.default_rng(0)
        vocab = engine.manifest.vocab_size
        backend.forward(StepBatch([rng.integers(100, vocab - 100, context).tolist()], [0], [blocks]))

        def forward(n: int) -> float:
            ids = rng.integers(100, vocab - 100, n).tolist()
            t0 = time.perf_counter()
            backend.forward(StepBatch([ids], [context], [blocks], all_logits=[True]))
            return time.perf_counter() - t0

        patterns = {f"steady {n}": [n] * 6 for n in range(1, 7)}
        patterns["changing 6,3,1,4,2,5"] = [6, 3, 1, 4, 2, 5]
        patterns["changing 2,3,2,3,2,3"] = [2, 3, 2, 3, 2, 3]
        times: dict[str, dict[int, list[float]]] = {k: {} for k in patterns}
        for r in range(rounds):
            for name, pattern in rotate(list(patterns.items()), r):
                forward(pattern[-1])  # the call before the pattern's first has the shape its cycle would
                for n in pattern:
                    times[name].setdefault(n, []).append(forward(n))
        pool.free(blocks)
    finally:
        engine.shutdown()
    return [{"pattern": name, **{f"n{n}_ms": 1e3 * median(v) for n, v in by_n.items()}} for name, by_n in times.items()]


SHAPE_COLUMNS = [("pattern", "fed tokens per call", "")] + [(f"n{n}_ms", f"n={n} ms", ".1f") for n in range(1, 7)]


PROFILE_COLUMNS = [
    ("side", "side", ""),
    ("fed", "fed/step", ""),
    ("steps", "steps", "d"),
    ("emitted", "tokens", "d"),
    ("tokens_per_step", "tok/step", ".2f"),
    ("wall_ms", "step ms", ".1f"),
    ("forward_ms", "forward ms", ".1f"),
    ("propose_ms", "propose ms", ".2f"),
    ("verify_ms", "verify ms", ".2f"),
    ("ms_per_token", "ms/token", ".1f"),
    ("forward_pct", "forward %", ".0f"),
    ("propose_pct", "propose %", ".1f"),
    ("verify_pct", "verify %", ".1f"),
]


# ---------------------------------------------------------------- targets and tables


def targets(batch1: list[dict], conc: list[dict]) -> list[dict]:
    rows = []

    def add(target: str, value: float, bound: float) -> None:
        if value == value:  # not NaN: both sides ran
            rows.append(
                {"target": target, "value": value, "bound": f">= {bound:g}", "met": "yes" if value >= bound else "NO"}
            )

    add(
        "grounded: prompt lookup vs ours non-speculative (decode)",
        paired_ratio(batch1, "decode_tok_s", "ours_pl", "ours", kind="grounded"),
        1.5,
    )
    add(
        "grounded: prompt lookup vs genai prompt lookup (decode)",
        paired_ratio(batch1, "decode_tok_s", "ours_pl", "genai_pl", kind="grounded"),
        1.0,
    )
    add(
        "grounded: draft vs genai draft (decode)",
        paired_ratio(batch1, "decode_tok_s", "ours_draft", "genai_draft", kind="grounded"),
        1.0,
    )
    add(
        "chat: prompt lookup vs ours non-speculative (decode)",
        paired_ratio(batch1, "decode_tok_s", "ours_pl", "ours", kind="chat"),
        0.95,
    )
    for kind in dict.fromkeys(r["kind"] for r in conc):
        for c in dict.fromkeys(r["concurrency"] for r in conc):
            add(
                f"{kind} c={c}: prompt lookup (policy) vs none (aggregate tok/s)",
                paired_ratio(conc, "tok_s", "ours_pl", "ours", concurrency=c, kind=kind),
                1.5 if kind == "grounded" and c <= 4 else 1.0,
            )
    return rows


BATCH1_COLUMNS = [
    ("kind", "prompts", ""),
    ("side", "side", ""),
    ("calls", "calls", "d"),
    ("tokens", "tokens", ".0f"),
    ("decode_tok_s", "decode tok/s", ".1f"),
    ("vs_ours", "vs ours", ".2f"),
    ("ttft_ms", "TTFT ms", ".0f"),
    ("ttft_vs_ours", "TTFT vs ours", ".2f"),
    ("tokens_per_step", "tok/step", ".2f"),
    ("acceptance", "accept", ".2f"),
    ("differ", "differ from ours", ""),
]
TASK_COLUMNS = [
    ("task", "grounded task", ""),
    ("calls", "calls", "d"),
    ("acceptance", "ours_pl accept", ".2f"),
    ("tokens_per_step", "ours_pl tok/step", ".2f"),
    ("genai_pl_tokens_per_step", "genai_pl tok/step", ".2f"),
    ("ours_pl/ours", "ours_pl/ours", ".2f"),
    ("ours_pl/genai_pl", "ours_pl/genai_pl", ".2f"),
    ("genai_pl/genai", "genai_pl/genai", ".2f"),
    ("ours_draft/ours", "ours_draft/ours", ".2f"),
]
CONC_COLUMNS = [
    ("kind", "prompts", ""),
    ("concurrency", "conc", "d"),
    ("reps", "reps", "d"),
    ("load1", "load", ".1f"),
    ("ours_tok_s", "plain tok/s", ".1f"),
    ("ours_pl_tok_s", "policy tok/s", ".1f"),
    ("ours_pl_ratio", "policy ratio", ".2f"),
    ("ours_pl_cpu_ratio", "policy CPU ratio", ".2f"),
    ("ours_pl_ttft_ratio", "policy TTFT", ".2f"),
    ("ours_pl_acceptance", "policy accept", ".2f"),
    ("ours_pl_fixed_ratio", "fixed k ratio", ".2f"),
    ("ours_pl_fixed_cpu_ratio", "fixed CPU ratio", ".2f"),
    ("ours_pl_fixed_acceptance", "fixed accept", ".2f"),
    ("ours_pl_differ", "policy differ", ""),
]
SWEEP_COLUMNS = [
    ("model", "model", ""),
    ("corruption", "corrupted", ".1f"),
    ("acceptance", "accept", ".2f"),
    ("tokens_per_step", "tok/step", ".2f"),
    ("base_tok_s", "plain tok/s", ".1f"),
    ("tok_s", "spec tok/s", ".1f"),
    ("speedup", "speed-up", ".2f"),
    ("same", "same tokens", ""),
]
TARGET_COLUMNS = [("target", "target", ""), ("value", "measured", ".2f"), ("bound", "bound", ""), ("met", "met", "")]


def main(argv=None) -> int:
    ap = arg_parser(
        __doc__,
        "speculative",
        model="default-fp16",
        reps=2,
        prompt_len=128,
        new_tokens=128,
        quick={
            "prompts": 2,
            "reps": 1,
            "new_tokens": 48,
            "concurrency": [4],
            "corruption": [0.0, 1.0],
            "sweep_models": ["default-int8"],
            "sweep_reps": 1,
        },
    )
    ap.add_argument("--draft", type=Path, help="a draft model's export directory (adds ours_draft and genai_draft)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts of each kind (grounded, chat)")
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--num-assistant-tokens", type=int, default=5, help="k on every speculative side")
    ap.add_argument("--max-ngram-size", type=int, default=3, help="prompt lookup's n on ours and genai")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--corruption", nargs="+", type=float, default=[0.0, 0.1, 0.3, 0.6, 1.0])
    ap.add_argument("--sweep-models", nargs="+", help="default: the built int8/int4 exports of bench/models.py")
    ap.add_argument("--sweep-reps", type=int, default=3)
    ap.add_argument(
        "--only",
        nargs="+",
        choices=("batch1", "concurrency", "sweep", "profile", "shapes"),
        default=["batch1", "concurrency", "sweep"],
        help="profile: where our time goes per step (timers around the engine's step parts); shapes: forward cost by "
        "tokens fed, steady vs changing shapes (neither is in the default set)",
    )
    ap.add_argument("--no-genai", action="store_true", help="our sides only")
    ap.add_argument(
        "--precision", choices=("f32",), help="inference precision of every side (default: the device's, bf16 here)"
    )
    ap.add_argument(
        "--sides", nargs="+", choices=SIDES, default=list(SIDES), help="the batch-1 sides (ours always: the baseline)"
    )
    args = ap.parse_args(argv)
    if "batch1" not in args.only:
        args.no_genai = True  # only the batch-1 table has genai sides
    if "concurrency" in args.only and "ours_pl" not in args.sides:
        raise SystemExit("appliance: --only concurrency compares ours with ours_pl: keep ours_pl in --sides")
    if args.draft is not None and not args.draft.is_dir():
        raise SystemExit(f"appliance: --draft {args.draft}: not a directory")

    info = machine()
    out: dict = {"prompts": prompt_set(args.prompts, args.seed)}
    tables = []
    batch1: list[dict] = []
    conc: list[dict] = []
    if {"batch1", "concurrency", "profile"} & set(args.only):
        path = model_dir(args.model)
        sides = Sides(path, args.draft, args)
        out["model_dir"], out["settings"] = str(path), sides.settings
        try:
            if "batch1" in args.only:
                total = args.reps * len(out["prompts"]) * len(sides.calls)
                with tqdm(total=total, desc="batch 1", file=sys.stderr, leave=False) as bar:
                    batch1 = bench_batch1(sides, out["prompts"], args.reps, bar)
            if "concurrency" in args.only:
                n_sides = sum(n in sides.engines for n in CONC_SIDES)
                with tqdm(
                    total=args.reps * len(args.concurrency) * 2 * n_sides,
                    desc="concurrency",
                    file=sys.stderr,
                    leave=False,
                ) as bar:
                    conc = bench_concurrency(sides, out["prompts"], args.concurrency, args.reps, args.new_tokens, bar)
            if "profile" in args.only:
                grounded = [p for p in out["prompts"] if p["kind"] == "grounded"]
                with tqdm(
                    total=len(grounded) * len(sides.engines), desc="profile", file=sys.stderr, leave=False
                ) as bar:
                    out["profile"] = bench_profile(sides, grounded, bar)
                tables.append(
                    print_table(
                        out["profile"],
                        PROFILE_COLUMNS,
                        title="where the time goes: grounded prompts, batch 1, "
                        "decode steps by tokens fed (1 + drafts); medians per step, shares of all decode time",
                    )
                )
        finally:
            sides.close()
        if batch1:
            out["batch1"] = {"runs": batch1, "summary": batch1_rows(batch1), "tasks": task_rows(batch1)}
            tables.append(
                print_table(
                    out["batch1"]["summary"],
                    BATCH1_COLUMNS,
                    title=f"batch 1, greedy, {args.model}: medians; vs ours = median of per-call ratios",
                )
            )
            tables.append(
                print_table(out["batch1"]["tasks"], TASK_COLUMNS, title="grounded prompts by task (decode ratios)")
            )
        if conc:
            out["concurrency"] = {"runs": conc, "summary": concurrency_rows(conc)}
            tables.append(
                print_table(
                    out["concurrency"]["summary"],
                    CONC_COLUMNS,
                    title="concurrent requests: prompt lookup with the step-cost policy / with a fixed k vs none "
                    "(ratios: medians of paired runs)",
                )
            )
    if "shapes" in args.only:
        out["shapes"] = bench_shapes(model_dir(args.model), 4 * args.reps)
        tables.append(
            print_table(out["shapes"], SHAPE_COLUMNS, title="backend.forward at batch 1 by tokens fed: medians, ms")
        )
    if "sweep" in args.only:
        models = args.sweep_models or default_sweep_models()
        sweep = []
        with tqdm(
            total=len(models) * args.sweep_reps * (len(args.corruption) + 1), desc="sweep", file=sys.stderr, leave=False
        ) as bar:
            for k, name in enumerate(models):
                sweep += bench_sweep(
                    name,
                    args.corruption,
                    args.sweep_reps,
                    args.prompt_len,
                    args.new_tokens,
                    args.num_assistant_tokens,
                    bar,
                    7000 + 100 * k,
                    args.precision,
                )
        out["sweep"] = {"runs": sweep, "summary": sweep_rows(sweep)}
        tables.append(
            print_table(
                out["sweep"]["summary"],
                SWEEP_COLUMNS,
                title="decode speed-up vs acceptance: prediction = the greedy output, a fraction corrupted",
            )
        )
    out["targets"] = targets(batch1, conc)
    if out["targets"]:
        tables.append(print_table(out["targets"], TARGET_COLUMNS, title="speculation targets"))
    save_results(args, "speculative", info, tables=tables, **out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
