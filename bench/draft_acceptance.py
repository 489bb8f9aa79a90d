"""Which draft model is worth it for the default model: acceptance of the target's greedy tokens, and the cost of
a draft step relative to a target step, for each candidate draft (appliance/runtime/speculative/draft.py's DraftModel).

Acceptance: the target (our Engine, greedy) answers each prompt (input-grounded: summarize / rewrite / extract /
code edit from a given text; free-form chat; all through the chat template); then speculative decoding is replayed
on that answer with a fixed k: the draft proposes k tokens, the step keeps the ones that equal the target's next
tokens plus the target's own token after them, and the draft KV rolls back (DraftModel.accepted). Reported: draft
tokens accepted / proposed, and target tokens per target step.

Cost: batch-1 forward times at a 256-token context, interleaved (each side first in turn), medians per repetition:
the target's one-token decode step, its (k + 1)-token verification step, one draft decode step, and a whole
DraftModel.propose of k tokens (k draft forwards + Python). est. speed-up = tokens per step x decode step /
(verify step + propose): what the engine can reach at batch 1 if nothing else costs.

    python -m bench.draft_acceptance [--model default-fp16] --drafts DIR... [--k 5] [--reps 5] [--quick]
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from appliance.config import EngineConfig
from appliance.manifest import Manifest
from appliance.params import SamplingParams
from appliance.runtime.backends.base import Backend, StepBatch
from appliance.runtime.engine import Engine
from appliance.runtime.kv_cache import BlockPool
from appliance.runtime.sequence import Sequence
from appliance.runtime.speculative.draft import DraftModel
from appliance.runtime.speculative.state import SpecState
from bench.common import arg_parser, machine, median, model_dir, print_table, rotate, save_results

TEXT = (
    "The Riverside Community Library will close for renovation from March 3 to May 28. During the closure, "
    "books can be returned at the City Hall drop box on Main Street, and the mobile library van will visit the "
    "Oak Park school every Tuesday and Thursday from 2 pm to 6 pm. The renovation, funded by a $1.2 million "
    "grant from the state, adds a children's reading room, twelve new computer stations and a solar roof. Head "
    "librarian Maria Gonzalez said the new building will reopen with extended hours, from 8 am to 9 pm on weekdays."
)
CODE = "def total(items):\n    t = 0\n    for i in items:\n        t = t + i.price * i.qty\n    return t\n"
GROUNDED = [
    f"Summarize the following text in three sentences.\n\n{TEXT}",
    f"Rewrite the following text in a formal tone, keeping every fact.\n\n{TEXT}",
    f"Extract every date, time, name and amount of money from the text below, one per line.\n\n{TEXT}",
    f"Rename the variable t to running_total and i to item in this Python function:\n\n{CODE}",
]
CHAT = [
    "Write a short poem about the sea.",
    "What are some tips for learning a new language?",
    "Explain how a rainbow forms.",
    "Tell me a short story about a dragon who is afraid of fire.",
]
CONTEXT = 256  # positions already in the KV when the cost is timed


def answers(engine: Engine, new_tokens: int) -> list[tuple[str, list[int], list[int]]]:
    """(kind, prompt ids, the target's greedy answer) for every prompt."""
    out = []
    for kind, texts in (("grounded", GROUNDED), ("chat", CHAT)):
        for text in texts:
            ids = engine.tokenizer.encode_chat([{"role": "user", "content": text}])
            result = engine.submit(ids, SamplingParams(temperature=0.0, max_tokens=new_tokens)).results()[0]
            out.append((kind, ids, result.token_ids))
    return out


def replay(draft: DraftModel, prompt: list[int], answer: list[int], k: int) -> dict[str, int]:
    """Speculative decoding of `answer` with fixed k: proposed / accepted draft tokens, target steps."""
    seq = Sequence("r", len(prompt), list(prompt), SamplingParams(), 1 << 20, None, None)  # type: ignore[arg-type]
    seq.spec = SpecState(draft.name, max_k=k)
    draft.start(seq)
    p = proposed = accepted = steps = 0
    while p < len(answer):
        guess = draft.propose([(seq, k)])[0]
        a = next((j for j, (g, t) in enumerate(zip(guess, answer[p:])) if g != t), min(len(guess), len(answer) - p))
        keep = answer[p : p + a + 1]
        seq.token_ids += keep
        seq.num_computed = len(seq.token_ids) - 1
        draft.accepted(seq)
        proposed, accepted, steps, p = proposed + len(guess), accepted + a, steps + 1, p + len(keep)
    draft.release(seq)
    return {"proposed": proposed, "accepted": accepted, "steps": steps, "tokens": len(answer)}


def timer(backend: Backend, pool: BlockPool, vocab: int, tokens: int) -> Callable[[], object]:
    """A function that runs one forward of `tokens` tokens at position CONTEXT (prefilled once)."""
    blocks = pool.allocate(pool.blocks_for(CONTEXT + tokens))
    ids = np.random.default_rng(0).integers(100, vocab - 100, CONTEXT + tokens).tolist()
    backend.forward(StepBatch([ids[:CONTEXT]], [0], [blocks]))
    return lambda: backend.forward(StepBatch([ids[CONTEXT:]], [CONTEXT], [blocks]))


def proposing(draft: DraftModel, seq: Sequence, k: int) -> Callable[[], object]:
    """A function that proposes k tokens, then rolls them back (as after a step that kept none of them)."""

    def run() -> None:
        draft.propose([(seq, k)])
        draft.accepted(seq)

    return run


def main() -> None:
    ap = arg_parser(__doc__, "draft_acceptance", model="default-fp16", reps=5, quick={"reps": 2, "new_tokens": 32})
    ap.add_argument("--drafts", nargs="+", type=Path, required=True, help="draft export directories")
    ap.add_argument("--k", type=int, default=5, help="draft tokens per step")
    ap.add_argument("--calls", type=int, default=20, help="timed calls per side and repetition")
    args = ap.parse_args()
    before = machine()
    target_dir = model_dir(args.model)
    config = EngineConfig()
    engine = Engine(target_dir, config)
    texts = answers(engine, args.new_tokens)
    vocab = Manifest.load(target_dir).vocab_size
    sides = {name: timer(engine.backend, engine.pool, vocab, n) for name, n in (("decode", 1), ("verify", args.k + 1))}
    rows, drafts = [], {}
    for path in args.drafts:
        draft = drafts[path.name] = DraftModel(
            path, config, target_dir, config.max_num_batched_tokens, config.kv_cache_tokens or 16384
        )
        counts = {
            kind: [replay(draft, p, a, args.k) for c, p, a in texts if c == kind] for kind in ("grounded", "chat")
        }
        sides[f"{path.name}/step"] = timer(draft.backend, draft.pool, vocab, 1)
        context = list(range(100, 100 + CONTEXT))
        seq = Sequence("t", CONTEXT, context, SamplingParams(), 1 << 20, None, None)  # type: ignore[arg-type]
        seq.spec = SpecState(draft.name, max_k=args.k)
        draft.propose([(seq, args.k)])  # the prompt: then each call feeds 1 token + k - 1 drafted ones
        sides[f"{path.name}/propose"] = proposing(draft, seq, args.k)
        rows.append({"draft": path.name, "counts": counts})
    times: dict[str, list[float]] = {name: [] for name in sides}
    for rep in range(args.reps):
        for name in rotate(list(sides), rep):
            samples = []
            for _ in range(args.calls):
                start = time.perf_counter()
                sides[name]()
                samples.append(time.perf_counter() - start)
            times[name].append(median(samples))
    decode, verify = median(times["decode"]), median(times["verify"])
    for row in rows:
        name = row["draft"]
        step = median(a / b for a, b in zip(times[f"{name}/step"], times["decode"]))
        propose = median(a / b for a, b in zip(times[f"{name}/propose"], times["decode"]))
        row.update(step_cost=step, propose_cost=propose)
        for kind, runs in row.pop("counts").items():
            proposed, accepted = sum(r["proposed"] for r in runs), sum(r["accepted"] for r in runs)
            per_step = sum(r["tokens"] for r in runs) / sum(r["steps"] for r in runs)
            row[f"{kind}_accept"] = accepted / max(1, proposed)
            row[f"{kind}_per_step"] = per_step
            row[f"{kind}_speedup"] = per_step / (verify / decode + propose)
    print_table(
        rows,
        [
            ("draft", "draft", ""),
            ("grounded_accept", "grounded accept", ".0%"),
            ("grounded_per_step", "tok/step", ".2f"),
            ("chat_accept", "chat accept", ".0%"),
            ("chat_per_step", "tok/step", ".2f"),
            ("step_cost", "draft step / target step", ".2f"),
            ("propose_cost", f"propose k={args.k} / target step", ".2f"),
            ("grounded_speedup", "est. grounded", ".2f"),
            ("chat_speedup", "est. chat", ".2f"),
        ],
        title=f"target {args.model}: decode {decode * 1e3:.1f} ms, verify {args.k + 1} tokens {verify * 1e3:.1f} ms "
        f"({verify / decode:.2f}x)",
    )
    save_results(args, "draft_acceptance", before, rows=rows, decode_ms=decode * 1e3, verify_ms=verify * 1e3)
    engine.shutdown()


if __name__ == "__main__":
    main()
