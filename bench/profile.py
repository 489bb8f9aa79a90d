"""Where a batch-1 decode step's time goes: OpenVINO's per-op profile (PERF_COUNT) of our engine's decode steps,
grouped by role (LM head, attention projections, MLP, paged attention, embedding, norms/rope/elementwise, other)
with the kernels that ran them (exec types: brgemm_avx512_bf16, brgemm_avx2_f32, ref_any, jit_*), next to the
engine's decode step wall time and the time spent outside OpenVINO's nodes (step wall - sum of node times).

Measurement only: PERF_COUNT and the --property / --variant values are added by wrapping
appliance.runtime.backends.openvino_paged.compile_properties while each engine compiles (there is no config field for
arbitrary properties); the engine's own properties come first, these override them. PERF_COUNT itself costs a
little per node (`--variant noperf:PERF_COUNT=false` runs the same steps unprofiled, beside the others). Honours
ONEDNN_MAX_CPU_ISA (set it in the environment, or --isa-cap AVX2: appliance.cpu_isa derives the
properties a capped CPU needs); the ISA is printed.

    python -m bench.profile MODEL [MODEL ...] [--precision default f32] [--property KEY=VALUE ...]
                            [--variant NAME:KEY=VALUE,KEY=VALUE ...] [--steps 32] [--prompt-len 128] [--reps 3]

Every (model, precision, variant) is one engine, all loaded at once; each repetition runs one request on each,
in an order rotated per repetition (bench.common.rotate). The CPU plugin's profile gives node times only as a total
over the decode steps (Recorder), so they are means per step, and `outside` = mean step wall - mean node time; the
median step wall gives tok/s. Every figure: its median over repetitions.
"""

from __future__ import annotations

import re
import sys
import time
from collections import defaultdict
from typing import Any

from tqdm import tqdm

from appliance.runtime.kernels.rewrite import ATTENTION_PROJ
from bench.common import (
    arg_parser,
    isa_cap_option,
    machine,
    median,
    model_dir,
    print_table,
    prompts,
    rotate,
    save_results,
)

EFFECTIVE = (
    "INFERENCE_PRECISION_HINT",
    "KV_CACHE_PRECISION",
    "DYNAMIC_QUANTIZATION_GROUP_SIZE",
    "INFERENCE_NUM_THREADS",
)
ROLES = ("LM head", "attention projections", "MLP", "attention", "embedding", "norms/rope/elementwise", "other")
_PROJ = ATTENTION_PROJ  # a fused q/k/v keeps q_proj's name (projection_fusion.py, kernels/rewrite.py)
_MLP = re.compile(r"(?:^|[./])(?:gate|up|down|gate_up)_proj\b")
_ELEMENTWISE = {"RMS", "RoPE", "Eltwise", "Subgraph", "Add", "Multiply", "Subtract", "Divide", "Power", "Sqrt"}
_ELEMENTWISE |= {"ReduceMean", "MVN", "Swish", "Sigmoid", "Exp", "Cos", "Sin", "Concat"}


def role(name: str, node_type: str, head: str) -> str:
    if name.startswith(head) or "lm_head" in name:  # the logits FC and the Reorder of its output
        return "LM head"
    if _PROJ.search(name) or node_type in ("VariadicSplit", "Split"):  # the split after a fused q/k/v
        return "attention projections"
    if _MLP.search(name):
        return "MLP"
    if node_type in ("PagedAttentionExtension", "ScaledDotProductAttention"):
        return "attention"
    if node_type == "Reference" and name.startswith("PagedAttentionExtension"):  # ours in its place (attention.py)
        return "attention"
    if node_type.startswith("Gather"):
        return "embedding"
    if node_type in _ELEMENTWISE or "rotary_emb" in name:
        return "norms/rope/elementwise"
    return "other"


def parse_properties(items: list[str]) -> dict[str, Any]:
    """KEY=VALUE strings -> {KEY: int, bool or str}."""
    pairs = [item.partition("=") for item in items]
    if bad := [k for k, sep, _ in pairs if not sep]:
        raise SystemExit(f"expected KEY=VALUE, got {bad}")
    bools = {"true": True, "false": False}
    return {k.strip(): int(v) if re.fullmatch(r"-?\d+", v) else bools.get(v.lower(), v) for k, _, v in pairs}


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """NAME:KEY=VALUE,KEY=VALUE (NAME alone: no extra properties)."""
    name, _, props = spec.partition(":")
    return name, parse_properties([p for p in props.split(",") if p])


class Recorder:
    """Wraps an engine's step and backend.forward, counting inferences. The CPU plugin reports each node's average
    time over every execution since compilation (its PerfCount: total / count, whole microseconds), so the node
    times of a request's decode steps are a difference of cumulative totals, average x inferences, read after its
    prefill (`begin` arms it) and after its last decode step (`end`); every node runs once per inference, one that
    did not run reports 0. Nothing is read during the decode steps: their step and forward wall times, kept per
    step (batch-1 decode: one sequence, one token), are not disturbed."""

    def __init__(self, engine, head: str):
        self.engine, self.head, self.active, self.infers = engine, head, False, 0
        self.steps: list[dict] = []
        self._start: tuple[int, dict] | None = None
        self._pending: dict | None = None
        backend = engine.backend
        forward, step = backend.forward, engine.step
        # The request that runs decode steps: with our kernels, the backend's second compiled model (`_small`, for
        # steps of at most `kernel_rows` tokens); `request` then runs only prefill. Reading `request` profiled the
        # prefill graph (OpenVINO's brgemm kernels, 892 ms of nodes "per step" against a 132 ms step at
        # Qwen2.5-1.5B int4), not the graph that decoded.
        # A batch-1 decode step runs the graph of static shapes for one token where the backend has one (request_for).
        self.request = backend.request_for(1)

        def timed_forward(batch):
            t, c = time.perf_counter(), time.process_time()
            out = forward(batch)
            dt, dc = time.perf_counter() - t, time.process_time() - c
            tokens = sum(map(len, batch.token_ids))
            if backend.request_for(tokens) is self.request:  # the backend's own choice of request
                self.infers += 1  # inferences of self.request only: its profile is an average over them
            if self.active and len(batch.token_ids) == 1 and len(batch.token_ids[0]) == 1:
                self._pending = {"forward_ms": dt * 1e3, "forward_cpu_ms": dc * 1e3}
            elif self.active:  # the prefill (its last chunk): the decode steps start from here
                self._start = self._snapshot()
            return out

        def timed_step():
            self._pending = None
            t = time.perf_counter()
            step()
            dt = time.perf_counter() - t
            if self._pending is not None:
                self.steps.append({"step_ms": dt * 1e3, **self._pending})

        engine.backend.forward, engine.step = timed_forward, timed_step

    def _snapshot(self) -> tuple[int, dict[str, tuple[str, str, float]]]:
        """(inferences so far, {node: (type, exec type, average us)})."""
        info = self.request.profiling_info
        return self.infers, {p.node_name: (p.node_type, p.exec_type, p.real_time.total_seconds() * 1e6) for p in info}

    def begin(self) -> None:
        self.steps, self._start, self.active = [], None, True

    def end(self) -> dict:
        """The request's decode steps: their wall times, and node time per step by role and exec type."""
        self.active = False
        if self._start is None or not self.steps:
            raise RuntimeError("no prefill or no decode step was recorded")
        (n0, before), (n1, after) = self._start, self._snapshot()
        roles: dict[str, float] = defaultdict(float)
        kernels: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for name, (node_type, kind, avg) in after.items():
            ms = (avg * n1 - before.get(name, ("", "", 0.0))[2] * n0) / 1e3 / len(self.steps)
            r = role(name, node_type, self.head)
            roles[r] += ms
            kernels[r][kind] += ms
        return {
            "steps": self.steps,
            "nodes_ms": sum(roles.values()),
            "roles": dict(roles),
            "kernels": {r: dict(k) for r, k in kernels.items()},
        }


def load(path, precision: str, extra: dict[str, Any], kernels: str = "auto"):
    """An Engine compiled with the engine's properties + PERF_COUNT + `extra`, warmed up, its Recorder, and those
    properties (with the compiled model's own values of EFFECTIVE)."""
    import appliance.runtime.backends.openvino_paged as paged
    from appliance.config import EngineConfig
    from appliance.params import SamplingParams
    from appliance.runtime.backends.openvino_common import logits_matmul, read_model
    from appliance.runtime.engine import Engine

    original = paged.compile_properties
    used: dict[str, Any] = {}

    def with_extra(config, **kw):
        used.update(original(config, **kw))
        used.update({"PERF_COUNT": True, **extra})  # a variant with PERF_COUNT=false: what profiling costs
        return dict(used)

    paged.compile_properties = with_extra
    try:
        engine = Engine(
            path,
            EngineConfig(
                precision=None if precision == "default" else precision, kv_cache_tokens=2048, kernels=kernels
            ),
        )
    finally:
        paged.compile_properties = original
    head = logits_matmul(read_model(path, engine.manifest.model_file)).get_friendly_name()
    recorder = Recorder(engine, head)  # before any inference: it counts them all
    engine.generate([100 + i for i in range(16)], SamplingParams(max_tokens=4))  # compile kernels
    backend: Any = engine.backend  # the paged OpenVINO backend (the only one with compile_properties patched)
    for key in EFFECTIVE:  # what the plugin made of them
        try:
            value = backend.compiled.get_property(key)
            used[f"effective {key}"] = value.get_type_name() if hasattr(value, "get_type_name") else str(value)
        except RuntimeError:
            pass
    return engine, recorder, used


def summarize(reps: list[dict]) -> dict:
    """Per repetition: median and mean step wall, mean forward wall and node times per step (node times exist only
    as a total over the decode steps, so `outside` compares means: a step slowed by another process counts in both);
    then medians over repetitions."""

    def over_reps(f) -> float:
        return median(f(r) for r in reps)

    out: dict[str, Any] = {
        "steps": sum(len(r["steps"]) for r in reps),
        "step_ms": over_reps(lambda r: median(x["step_ms"] for x in r["steps"])),
        "step_mean_ms": over_reps(lambda r: sum(x["step_ms"] for x in r["steps"]) / len(r["steps"])),
        "forward_mean_ms": over_reps(lambda r: sum(x["forward_ms"] for x in r["steps"]) / len(r["steps"])),
        # CPU time of the process (every thread) per forward: what a box shared with other work distorts less than
        # wall time (a loaded 2-vCPU box gave 137-476 ms walls for the same step across repetitions).
        "forward_cpu_ms": over_reps(lambda r: median(x["forward_cpu_ms"] for x in r["steps"])),
        "nodes_ms": over_reps(lambda r: r["nodes_ms"]),
    }
    out["tok_s"] = 1e3 / out["step_ms"]
    out["outside_ms"] = out["step_mean_ms"] - out["nodes_ms"]  # means both: one slow step counts in both
    for name in ROLES:
        out[name] = over_reps(lambda r, name=name: r["roles"].get(name, 0.0))
    kinds: dict[tuple[str, str], float] = defaultdict(float)  # (role, exec type) -> ms over all repetitions
    for r in reps:
        kinds.update(
            {(name, kind): kinds[name, kind] + ms for name, k in r["kernels"].items() for kind, ms in k.items()}
        )
    ranked = sorted((k for k, ms in kinds.items() if ms > 0), key=lambda k: -kinds[k])
    out["kernels"] = {name: [kind for n, kind in ranked if n == name] for name in ROLES}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(__doc__, "profile", reps=3, new_tokens=None)
    ap.add_argument("models", nargs="+", help="default-<fmt> or export directories")
    ap.add_argument("--precision", nargs="+", default=["default"], choices=["default", "f32"])
    ap.add_argument("--property", action="append", default=[], help="KEY=VALUE added to every variant's properties")
    ap.add_argument("--variant", action="append", default=[], help="NAME:KEY=VALUE,KEY=VALUE (repeatable)")
    ap.add_argument("--steps", type=int, default=32, help="decode steps profiled per request")
    ap.add_argument("--kernels", nargs="+", default=["auto"], choices=["auto", "ours", "openvino"])
    isa_cap_option(ap)
    args = ap.parse_args(argv)

    from appliance.manifest import Manifest
    from appliance.params import SamplingParams

    info = machine()
    isa = info["isa"]
    common = parse_properties(args.property)
    variants = [parse_variant(v) for v in args.variant] or [("base", {})]
    configs = [(m, p, v, k) for m in args.models for p in args.precision for v, _ in variants for k in args.kernels]
    loaded: dict[tuple[str, str, str, str], tuple] = {}
    steps: dict[tuple[str, str, str, str], list[dict]] = {c: [] for c in configs}
    try:
        for m, p, v, k in tqdm(configs, "compiling", file=sys.stderr, leave=False):
            loaded[(m, p, v, k)] = load(model_dir(m), p, {**common, **dict(variants)[v]}, k)
        vocab = Manifest.load(model_dir(args.models[0])).vocab_size
        params = SamplingParams(max_tokens=args.steps + 1, ignore_eos=True)  # the prefill step gives the first token
        with tqdm(total=args.reps * len(configs), desc="profile", file=sys.stderr, leave=False) as bar:
            for rep in range(args.reps):
                for c in rotate(configs, rep):
                    engine, rec, _ = loaded[c]
                    time.sleep(0.2)  # the previous engine's worker threads stop spinning before this one starts
                    rec.begin()
                    engine.generate(prompts(vocab, 1, args.prompt_len, 41000 + rep)[0], params)
                    steps[c].append(rec.end())
                    bar.update()
    finally:
        for engine, _, _ in loaded.values():
            engine.shutdown()

    rows, role_rows = [], []
    for m, p, v, k in configs:
        s = summarize(steps[(m, p, v, k)])
        label = loaded[(m, p, v, k)][0].backend.kernels
        rows.append({"model": m, "precision": p, "variant": v, "path": label, "properties": loaded[(m, p, v, k)][2]})
        rows[-1].update(s)
        for r in ROLES:
            share = 100 * s[r] / s["nodes_ms"] if s["nodes_ms"] else 0.0
            kinds = ", ".join(s["kernels"].get(r, [])[:3])
            role_rows.append(
                {"config": f"{m} {p} {v} {label}", "role": r, "ms": s[r], "share": share, "kernels": kinds}
            )
    title = f"batch-1 decode step, {args.prompt_len}-token prompt, {args.steps} steps x {args.reps} reps, ISA {isa}"
    cols = [("model", "model", "s"), ("precision", "precision", "s"), ("variant", "variant", "s")]
    cols += [("path", "kernels", "s")]
    cols += [("step_ms", "step ms p50", ".2f"), ("tok_s", "tok/s", ".1f"), ("step_mean_ms", "step mean", ".2f")]
    cols += [
        ("forward_mean_ms", "fwd mean", ".2f"),
        ("forward_cpu_ms", "fwd cpu p50", ".2f"),
        ("nodes_ms", "nodes", ".2f"),
        ("outside_ms", "outside", ".2f"),
    ]
    cols += [(r, r.split("/")[0].replace("attention projections", "attn proj"), ".2f") for r in ROLES]
    print_table(rows, cols, title=title + " (ms per decode step; outside = step mean - nodes)")
    print_table(
        role_rows,
        [("config", "config", "s"), ("role", "role", "s"), ("ms", "ms/step", ".2f"), ("share", "share %", ".1f")]
        + [("kernels", "exec types (by time)", "s")],
        title="per role (share of the time in OpenVINO nodes)",
    )
    for v, props in variants:
        print(f"variant {v}: {props or 'engine defaults'}{f' + {common}' if common else ''}")
    save_results(
        args, "profile", info, isa=isa, summary=rows, roles=role_rows, steps=[[str(c), steps[c]] for c in configs]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
