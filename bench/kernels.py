"""Our LowBitMatMul (appliance.runtime.kernels) against OpenVINO's own u4 decompression + MatMul, per weight shape,
format and row count M, the two compiled from the same weights and timed interleaved: medians of the per-repetition
ratio ours / native (< 1: ours faster), of wall time and of process CPU time (which a loaded box distorts less). Read
ratios only: the box may be shared. Measured here: docs/performance.md, "Low-bit kernels"; the choices it made:
appliance/runtime/kernels KERNEL_ROWS.

Each side is a model of `--layers` independent MatMuls of one shape reading the same x (4 x 6.9 MB at the
Qwen2.5-1.5B MLP shape). Give it more layers than the last-level cache holds, as a decode step's weights are: the
AVX512-VNNI box's L3 is 300 MB, where 4 layers sit in cache (its 8960x1536 M = 1 ratio, 64 layers: 0.84, CPU
time 0.81 at load 4; in the decode graph the MLP measured 1.03x). Formats: `u4a:128` (NNCF's int4 asym
group 128 with u4 zero points: bench.models' exports) and `q4_1` (export/grid.py's exact Q4_1 grid: u4, group 32,
f16 zero points: the default model's served int4), `u8` (NNCF's int8 LM head, per output channel: on AVX2 as
s8 = u8 - 128, rewrite.U8_ISAS; 151936x1536 is Qwen2.5-1.5B's). Native runs with the compile properties the server
would use for the precision (`--precision default`: the box's default, dynamic quantization where the CPU has VNNI;
`f32`: none); ours always computes in f32 with int8 activations, on `--isa` (default: the widest the CPU has).

    python -m bench.kernels [--shapes 8960x1536 1536x8960] [--rows 1 2 4 8 16] [--formats u4a:128 q4_1] \\
        [--threads 2] [--reps 15] [--precision default f32] [--isa avx2 ...]
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from bench.common import arg_parser, finish, machine, median, rotate

SHAPES = ["8960x1536", "1536x8960"]  # Qwen2.5-1.5B MLP: gate/up, down
ROWS = [1, 2, 4, 8, 16]


def weights(n: int, k: int, fmt: str, rng: np.random.Generator) -> Any:
    """The decompression chain of one random [N, K] weight in `fmt`, as the exporters write it."""
    import openvino as ov
    from openvino import opset13 as ops

    from bench.weight_formats import decompressed

    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    if fmt.startswith("u4a:"):
        return decompressed(w, "u4a", int(fmt.split(":")[1]))
    if fmt == "u8":  # NNCF's int8 LM head: u8 per output channel, u8 zero point, f16 scale
        lo, hi = w.min(1, keepdims=True), w.max(1, keepdims=True)
        d = (hi - lo) / 255
        zero = np.round(-lo / d).astype(np.uint8)
        q = np.clip(np.round(w / d) + zero, 0, 255).astype(np.uint8)
        out = ops.subtract(ops.convert(ops.constant(q), ov.Type.f16), ops.convert(ops.constant(zero), ov.Type.f16))
        return ops.convert(ops.multiply(out, ops.constant(d.astype(np.float16))), ov.Type.f32)
    g = w.reshape(n, k // 32, 32)
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    d = np.where(hi == lo, 1, (hi - lo) / 15)
    q = np.clip(np.round((g - lo) / d), 0, 15).astype(np.uint8)
    out = ops.convert(ops.constant(q, ov.Type.u4), ov.Type.f16)
    out = ops.subtract(out, ops.constant((-lo / d).astype(np.float16)))
    out = ops.multiply(out, ops.constant(d.astype(np.float16)))
    return ops.convert(ops.reshape(out, ops.constant(np.array([n, k], np.int64)), False), ov.Type.f32)


def rolled(output: Any, n: int, shift: int) -> Any:
    """A copy of the decompression chain ending at `output` whose per-row constants (dim 0 = n) have their rows
    rolled by `shift`: another layer's weights in their own memory, with the same statistics, without quantizing
    again (2.5 s per 8960 x 1536 layer on a loaded box, minutes for a model larger than the cache)."""
    import openvino as ov
    from openvino import opset13 as ops

    node = output.get_node()
    if node.get_type_name() == "Constant":
        if not node.shape or node.shape[0] != n:
            return output
        data = np.asarray(node.get_data())  # u4: two per byte, each row's bytes contiguous (K even)
        tensor = ov.Tensor(node.get_element_type(), node.shape)  # owns its memory; packed for u4
        np.asarray(tensor.data).reshape(n, -1)[:] = np.roll(data.reshape(n, -1), shift, 0)
        return ops.constant(tensor).output(0)
    inputs = [rolled(node.input_value(i), n, shift) for i in range(node.get_input_size())]
    kind = node.get_type_name()
    if kind == "Convert":
        return ops.convert(inputs[0], node.get_output_element_type(0)).output(0)
    if kind == "Reshape":
        return ops.reshape(inputs[0], inputs[1], node.get_attributes()["special_zero"]).output(0)
    return {"Subtract": ops.subtract, "Multiply": ops.multiply}[kind](*inputs).output(0)


def model(n: int, k: int, fmt: str, layers: int) -> Any:
    import openvino as ov
    from openvino import opset13 as ops

    rng = np.random.default_rng(0)
    x = ops.parameter([-1, k], ov.Type.f32, name="x")
    first = weights(n, k, fmt, rng)
    chains = [first.output(0)] + [rolled(first.output(0), n, 1 + i) for i in range(layers - 1)]
    return ov.Model([ops.matmul(x, w, False, True) for w in chains], [x])


def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(__doc__ or "", "kernels", reps=15, prompt_len=None, new_tokens=None)
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="NxK (output x input channels)")
    ap.add_argument("--rows", nargs="+", type=int, default=ROWS)
    ap.add_argument("--formats", nargs="+", default=["u4a:128", "q4_1"])
    ap.add_argument("--precision", nargs="+", default=["default", "f32"], choices=["default", "f32"])
    ap.add_argument("--isa", nargs="+", default=[None], help="our paths to time (default: the widest)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args(argv)

    import openvino as ov

    from appliance import cpu_isa
    from appliance.runtime import kernels
    from appliance.runtime.kernels.rewrite import rewrite

    before = machine()
    core = ov.Core()
    loaded, why = kernels.load(core)
    if loaded is None:
        raise SystemExit(f"our kernels are not available: {why}")
    isas = [i or loaded.isa for i in args.isa]
    isa = cpu_isa.detect()
    runs, summary = [], []
    for shape in args.shapes:
        n, k = map(int, shape.split("x"))
        for fmt in args.formats:
            sides: dict[str, Any] = {}
            for precision in args.precision:
                props = cpu_isa.plugin_properties(isa, None if precision == "default" else precision)
                props |= {"INFERENCE_NUM_THREADS": args.threads, "PERFORMANCE_HINT": "LATENCY"}
                if precision == "f32":
                    props["INFERENCE_PRECISION_HINT"] = "f32"
                sides[f"native-{precision}"] = core.compile_model(model(n, k, fmt, args.layers), "CPU", props)
            for path in isas:
                ours = model(n, k, fmt, args.layers)
                if rewrite(ours, loaded.factory, path) != args.layers:
                    raise SystemExit(f"{fmt} was not rewritten")
                props = {"INFERENCE_NUM_THREADS": args.threads, "INFERENCE_PRECISION_HINT": "f32"}
                sides[f"ours-{path}"] = core.compile_model(ours, "CPU", props)
            requests = {name: c.create_infer_request() for name, c in sides.items()}
            for m in args.rows:
                x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
                times: dict[str, list[float]] = {name: [] for name in requests}
                cpu: dict[str, list[float]] = {name: [] for name in requests}
                for rep in range(args.reps):
                    for name in rotate(list(requests), rep):
                        requests[name].infer({0: x})
                        t, c = time.perf_counter(), time.process_time()
                        for _ in range(3):
                            requests[name].infer({0: x})
                        times[name].append((time.perf_counter() - t) / 3)
                        cpu[name].append((time.process_time() - c) / 3)
                for name, ts in times.items():
                    runs += [
                        {"shape": shape, "format": fmt, "rows": m, "side": name, "rep": i, "s": t, "cpu_s": c}
                        for i, (t, c) in enumerate(zip(ts, cpu[name]))
                    ]
                row: dict[str, Any] = {"shape": shape, "format": fmt, "rows": m}
                for name in requests:
                    if name.startswith("ours"):
                        for base in (b for b in requests if b.startswith("native")):
                            row[f"{name}/{base}"] = median(a / b for a, b in zip(times[name], times[base]))
                            row[f"cpu {name}/{base}"] = median(a / b for a, b in zip(cpu[name], cpu[base]))
                summary.append(row)
                print({k_: (round(v, 3) if isinstance(v, float) else v) for k_, v in row.items()}, flush=True)
    columns = [("shape", "shape", ""), ("format", "format", ""), ("rows", "M", "d")]
    columns += [(key, key, ".3f") for key in summary[0] if "/" in key]
    return finish(
        args,
        "kernels",
        before,
        summary,
        columns,
        title=f"time ours / native (threads {args.threads}, load {os.getloadavg()[0]:.1f})",
        runs=runs,
    )


if __name__ == "__main__":
    raise SystemExit(main())
