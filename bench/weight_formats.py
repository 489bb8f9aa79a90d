"""Which weight format decodes fastest at batch 1 on this CPU: the kernel the CPU plugin picks for the FullyConnected
nodes, their time, and the CPU time a decode step costs, per weight format and compile property.

Three commands:
- `variant SRC OUT --format F [--lm-head F]`: a copy of an OpenVINO export (SRC, e.g. bench.models' NNCF int4) with
  every compressed weight re-made from the manifest's HF source weights (safetensors, one tensor at a time) in
  format F: `i4s:G` (int4 symmetric, group G; 0 = per output channel), `u4a:G` (int4 with a u4 zero point),
  `i8s:0` / `u8a:0` (int8 per channel), `keep`. A 1.5B variant takes 1-2.5 min at 4.5-5 GB peak RSS (the full
  exporter: 9.1 GiB, its fp32 load and trace). Quantization is plain round-to-nearest (no NNCF search): these are
  for timing kernels; the exporter's NNCF output is what serves.
- `kernels`: a 4-layer MLP stack of the Qwen2.5-1.5B shape (1536 -> 8960 -> 1536, 12 FullyConnected nodes) at batch
  1 in each format x DYNAMIC_QUANTIZATION_GROUP_SIZE, compiled once each, inferred round-robin; median wall and
  process CPU time per infer (CPU time holds up on a loaded box; wall does not).
- `profile EXPORT ...`: a stateful decode (32-token prompt, then 24 single-token steps, u8 KV) per export, the
  exports interleaved over `--rounds`: median CPU and wall ms per step, and the PERF_COUNT time per (node type,
  kernel), so which primitive runs the FC nodes and what share of the step they are.

Measured on the 2-vCPU AVX2 EPYC (no VNNI, 1 thread per core, OpenVINO 2026.4), load average 5.5-8.5 (other
agents), docs/performance-log.md "Weight formats on AVX2":
- every format runs FullyConnectedCompressed as brgemm_avx2_f32: weights decompressed to f32, f32 FMAs. No
  DYNAMIC_QUANTIZATION_GROUP_SIZE (32, 128) changes the kernel or the CPU time for any format (the plugin's
  dynamic quantization needs VNNI). The FC nodes are 97% of a decode step's node time;
- CPU per step of the 1.5B shape (medians of 2 rounds): u4 asym g128 (NNCF's default, the served export) 213 ms,
  i4 sym g128 159 (0.75x), i4 sym per-channel 153, i8 sym per-channel 153 (twice the bytes, same arithmetic);
- kernels (CPU ms per 12 FCs): u4a g128 22.7, u4a g64 22.8, i4s g128 17.9, i4s per-channel 16.2, u8a per-channel
  17.9, i8s per-channel 16.1, u8a g128 22.2, f16 37.8; ONNX Runtime's MatMulNBits int4 on the same stack: 49-53
  with f32 compute (accuracy_level 0), 19-20.5 with int8 activations (accuracy_level 4): no better than i4s.

    python -m bench.weight_formats variant SRC OUT --format i4s:128 [--lm-head i8s]
    python -m bench.weight_formats kernels [--formats u4a:128 i4s:128 ...] [--dq 0 32 128] [--rounds 15]
    python -m bench.weight_formats profile EXPORT [EXPORT ...] [--prop KEY=VALUE ...] [--rounds 2] \\
        [--gguf FILE --llamacpp-python PYTHON]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import machine, write_json

HIDDEN, INTERMEDIATE, LAYERS = 1536, 8960, 4  # Qwen2.5-1.5B's MLP
BYTES_PER_WEIGHT = {"f16": 2.0, "u4a": 0.5, "i4s": 0.5, "u8a": 1.0, "i8s": 1.0}
KERNEL_FORMATS = ["f16:0", "u4a:128", "u4a:64", "u4a:32", "u4a:0", "i4s:128", "i4s:32", "i4s:0", "u8a:0", "i8s:0"]


def _spec(text: str) -> tuple[str, int]:
    kind, _, group = text.partition(":")
    if kind not in BYTES_PER_WEIGHT:
        raise SystemExit(f"unknown format {text!r}: one of {', '.join(BYTES_PER_WEIGHT)} with :GROUP")
    return kind, int(group or 0)


def quantize(w: np.ndarray, kind: str, group: int) -> tuple[np.ndarray, Any, np.ndarray, np.ndarray | None]:
    """w [N, K] f32 -> (values, OpenVINO element type, scale, zero point or None); grouped values are [N, K/G, G]
    with scales [N, K/G, 1], per-channel ones [N, K] with [N, 1] (the layouts NNCF writes)."""
    import openvino as ov

    n, k = w.shape
    g = group or k
    x = w.reshape(n, k // g, g) if g != k else w
    if kind in ("i4s", "i8s"):
        top = 7 if kind == "i4s" else 127
        d = np.abs(x).max(-1, keepdims=True) / top
        q = np.clip(np.round(x / np.where(d == 0, 1, d)), -top - 1, top)
        return q.astype(np.int8), ov.Type.i4 if kind == "i4s" else ov.Type.i8, d, None
    top = 15 if kind == "u4a" else 255
    lo, hi = np.minimum(x.min(-1, keepdims=True), 0), np.maximum(x.max(-1, keepdims=True), 0)
    d = np.where(hi == lo, 1, (hi - lo) / top)
    z = np.clip(np.round(-lo / d), 0, top)
    q = np.clip(np.round(x / d) + z, 0, top)
    return q.astype(np.uint8), ov.Type.u4 if kind == "u4a" else ov.Type.u8, d, z.astype(np.uint8)


def decompressed(w: np.ndarray, kind: str, group: int) -> Any:
    """The compressed-weight pattern the CPU plugin fuses into FullyConnectedCompressed: Convert -> (Subtract a
    converted zero point) -> Multiply scale -> (Reshape) -> Convert f32."""
    import openvino as ov
    from openvino import opset13 as ops

    if kind == "f16":
        return ops.convert(ops.constant(w.astype(np.float16)), ov.Type.f32)
    values, element, scale, zero = quantize(w, kind, group)
    out = ops.convert(ops.constant(values, element), ov.Type.f16)
    if zero is not None:
        out = ops.subtract(out, ops.convert(ops.constant(zero, element), ov.Type.f16))
    out = ops.multiply(out, ops.constant(scale.astype(np.float16)))
    if values.ndim == 3:
        out = ops.reshape(out, ops.constant(np.array(w.shape, np.int64)), False)
    return ops.convert(out, ov.Type.f32)


# ---------------------------------------------------------------- variant


def variant(src: Path, out: Path, fmt: str, lm_head: str) -> dict:
    import openvino as ov
    from safetensors import safe_open

    manifest = json.loads((src / "appliance_manifest.json").read_text())
    files = sorted(Path(manifest["source"]).glob("*.safetensors"))
    if out.exists():
        raise SystemExit(f"{out} exists: a variant never overwrites")
    handles = [safe_open(str(f), "pt") for f in files]
    where = {name: h for h in handles for name in h.keys()}  # noqa: SIM118 - safe_open has keys(), no __iter__
    model = ov.Core().read_model(src / manifest["model_file"])
    done: collections.Counter[str] = collections.Counter()
    for node in list(model.get_ordered_ops()):
        if node.get_type_name() != "Constant":
            continue
        name = node.get_friendly_name()
        compressed = node.get_element_type() in (ov.Type.u4, ov.Type.u8, ov.Type.i4, ov.Type.i8)
        if not compressed or name.endswith("/zero_point"):
            continue
        end = node  # walk the decompression ops to the node a MatMul or Gather reads
        for _ in range(8):
            users = [t.get_node() for t in end.output(0).get_target_inputs()]
            if any(u.get_type_name() in ("MatMul", "Gather") for u in users):
                break
            end = next(u for u in users if u.get_type_name() in ("Convert", "Subtract", "Multiply", "Reshape"))
        source_name = name.removeprefix("self.")
        spec = lm_head if "embed_tokens" in source_name or "lm_head" in source_name else fmt
        if spec == "keep":
            continue
        w = where[source_name].get_tensor(source_name).float().numpy()
        new = decompressed(w, *_spec(spec))
        for target in list(end.output(0).get_target_inputs()):
            target.replace_source_output(new.output(0))
        done[spec] += 1
    out.mkdir(parents=True)
    for p in src.iterdir():
        if p.suffix not in (".xml", ".bin"):
            shutil.copy(p, out / p.name)
    ov.save_model(model, out / manifest["model_file"], compress_to_fp16=False)
    info = {"method": "bench.weight_formats variant (round to nearest, for timing)", "mode": fmt, "lm_head": lm_head}
    manifest["weight_compression"] = info | {"weights": dict(done)}
    (out / "appliance_manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest["weight_compression"]


# ---------------------------------------------------------------- kernels


def mlp_stack(kind: str, group: int, seed: int = 0) -> Any:
    import openvino as ov
    from openvino import opset13 as ops

    rng = np.random.default_rng(seed)

    def weight(n: int, k: int) -> Any:
        return decompressed((rng.standard_normal((n, k)) * 0.02).astype(np.float32), kind, group)

    x = ops.parameter([-1, -1, HIDDEN], ov.Type.f32, name="x")
    h = x
    for _ in range(LAYERS):
        gate = ops.matmul(h, weight(INTERMEDIATE, HIDDEN), False, True)
        up = ops.matmul(h, weight(INTERMEDIATE, HIDDEN), False, True)
        h = ops.add(h, ops.matmul(ops.multiply(ops.swish(gate), up), weight(HIDDEN, INTERMEDIATE), False, True))
    return ov.Model([h], [x])


def kernels(formats: list[str], dqs: list[int], rounds: int, threads: int) -> list[dict]:
    import openvino as ov

    core = ov.Core()
    sides = []
    for fmt in formats:
        kind, group = _spec(fmt)
        model = mlp_stack(kind, group)
        for dq in dqs:
            props = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": dq, "PERF_COUNT": True}
            props["INFERENCE_NUM_THREADS"] = threads
            sides.append((fmt, dq, kind, core.compile_model(model, "CPU", props).create_infer_request()))
    x = np.random.default_rng(1).random((1, 1, HIDDEN), np.float32)
    times: dict[tuple[str, int], tuple[list[float], list[float]]] = {(f, d): ([], []) for f, d, _, _ in sides}
    for r in range(rounds):
        for fmt, dq, _, request in sides if r % 2 else sides[::-1]:
            request.infer({0: x})
            for _ in range(3):
                t, c = time.perf_counter(), time.process_time()
                request.infer({0: x})
                times[fmt, dq][0].append(time.perf_counter() - t)
                times[fmt, dq][1].append(time.process_time() - c)
    rows = []
    for fmt, dq, kind, request in sides:
        fc = [p for p in request.profiling_info if p.node_type.startswith("FullyConnected")]
        wall, cpu = statistics.median(times[fmt, dq][0]), statistics.median(times[fmt, dq][1])
        nbytes = LAYERS * 3 * HIDDEN * INTERMEDIATE * BYTES_PER_WEIGHT[kind]
        rows.append(
            {
                "format": fmt,
                "dq_group": dq,
                "fc_kernels": sorted({f"{p.node_type}:{p.exec_type}" for p in fc}),
                "wall_ms": round(wall * 1e3, 2),
                "cpu_ms": round(cpu * 1e3, 2),
                "weight_mb": round(nbytes / 1e6, 1),
                "gbps_wall": round(nbytes / wall / 1e9, 2),
            }
        )
    return rows


# ---------------------------------------------------------------- profile


def profile_once(export: Path, props: dict[str, Any], steps: int = 24) -> dict:
    import openvino as ov

    compiled = ov.Core().compile_model(
        export / "openvino_model.xml", "CPU", {"PERF_COUNT": True, "KV_CACHE_PRECISION": "u8", **props}
    )
    request = compiled.create_infer_request()

    def step(ids: list[int], pos: int) -> None:
        n = len(ids)
        request.infer(
            {
                "input_ids": np.array([ids], np.int64),
                "attention_mask": np.ones((1, pos + n), np.int64),
                "position_ids": np.arange(pos, pos + n, dtype=np.int64)[None],
                "beam_idx": np.zeros(1, np.int32),
            }
        )

    walls, cpus = [], []
    nodes: dict[str, float] = collections.defaultdict(float)
    for rep in range(2):  # the first pass warms up
        request.reset_state()
        step(list(range(100, 132)), 0)
        for i in range(steps):
            t, c = time.perf_counter(), time.process_time()
            step([500 + i], 32 + i)
            if rep:
                walls.append(time.perf_counter() - t)
                cpus.append(time.process_time() - c)
                for p in request.profiling_info:
                    nodes[f"{p.node_type}:{p.exec_type}"] += p.real_time.total_seconds() * 1e3 / steps
    total = sum(nodes.values())
    fc = {k: round(v, 1) for k, v in nodes.items() if k.startswith("FullyConnected")}
    return {
        "export": str(export),
        "props": props,
        "step_wall_ms": round(statistics.median(walls) * 1e3, 1),
        "step_cpu_ms": round(statistics.median(cpus) * 1e3, 1),
        "fc_kernels_ms": fc,
        "fc_share_of_node_time": round(sum(fc.values()) / total, 3) if total else None,
    }


# Runs in --llamacpp-python's interpreter: the same decode as profile_once on a GGUF, CPU and wall ms per step.
_LLAMACPP_CHILD = """
import json, statistics, sys, time
from llama_cpp import Llama
gguf, threads, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(gguf, n_ctx=512, n_batch=64, n_threads=threads, n_threads_batch=threads, verbose=False)
walls, cpus = [], []
for rep in range(2):
    llm.reset()
    llm.eval(list(range(100, 132)))
    for i in range(steps):
        t, c = time.perf_counter(), time.process_time()
        llm.eval([500 + i])
        if rep:
            walls.append(time.perf_counter() - t)
            cpus.append(time.process_time() - c)
print(json.dumps({"step_wall_ms": round(statistics.median(walls) * 1e3, 1),
                  "step_cpu_ms": round(statistics.median(cpus) * 1e3, 1)}))
"""


def llamacpp_once(python: str, gguf: Path, threads: int, steps: int = 24) -> dict:
    """llama.cpp's decode of the same steps (its CPU time: with 1 thread no OpenMP barrier spins into it)."""
    import subprocess

    done = subprocess.run(
        [python, "-c", _LLAMACPP_CHILD, str(gguf), str(threads), str(steps)],
        capture_output=True,
        text=True,
        check=True,
    )
    return {"export": str(gguf), "props": {"n_threads": threads}} | json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    sub = ap.add_subparsers(dest="command", required=True)
    v = sub.add_parser("variant")
    v.add_argument("src", type=Path)
    v.add_argument("out", type=Path)
    v.add_argument("--format", required=True)
    v.add_argument("--lm-head", default="i8s:0")
    k = sub.add_parser("kernels")
    k.add_argument("--formats", nargs="+", default=KERNEL_FORMATS)
    k.add_argument("--dq", nargs="+", type=int, default=[0, 32, 128])
    k.add_argument("--rounds", type=int, default=15)
    k.add_argument("--threads", type=int, default=2)
    p = sub.add_parser("profile")
    p.add_argument("exports", nargs="+", type=Path)
    p.add_argument("--prop", action="append", default=[], help="KEY=VALUE compile property (repeat)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--gguf", type=Path, help="llama.cpp's side too: a GGUF of the same weights")
    p.add_argument("--llamacpp-python", help="a python with llama_cpp (for --gguf)")
    for s in (k, p):
        s.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "weight_formats.json")
    args = ap.parse_args(argv)
    if args.command == "variant":
        print(json.dumps(variant(args.src, args.out, args.format, args.lm_head)))
        return 0
    before = machine()
    if args.command == "kernels":
        rows = kernels(args.formats, args.dq, args.rounds, args.threads)
    else:
        props: dict[str, Any] = {}
        for item in args.prop:
            key, _, value = item.partition("=")
            props[key] = int(value) if value.lstrip("-").isdigit() else value
        rows = []
        for r in range(args.rounds):
            sides: list[Path | None] = [*args.exports, *([None] if args.gguf else [])]
            for export in sides if r % 2 == 0 else sides[::-1]:
                load = {"round": r, "load": Path("/proc/loadavg").read_text().strip()}
                if export is None:
                    threads = int(props.get("INFERENCE_NUM_THREADS", 0)) or os.cpu_count() or 1
                    rows.append(llamacpp_once(args.llamacpp_python, args.gguf, threads) | load)
                else:
                    rows.append(profile_once(export, props) | load)
        summary = collections.defaultdict(list)
        for row in rows:
            summary[row["export"]].append(row["step_cpu_ms"])
        rows += [{"export": e, "median_step_cpu_ms": statistics.median(c)} for e, c in summary.items()]
    for row in rows:
        print(json.dumps(row), flush=True)
    write_json(
        args.out,
        {
            "benchmark": f"weight_formats {args.command}",
            "args": vars(args),
            "machine": before,
            "machine_after": machine(),
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
