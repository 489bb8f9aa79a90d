"""Know the limit: the box's memory bandwidth with the threads the engine uses, the bytes a decode step must read
per token at batch 1, and so the fastest batch-1 decode any engine could reach on these weights here.

- Bandwidth: a streaming read of a buffer far larger than the caches (512 MiB), split over `threads` Python threads
  (numpy releases the GIL), each reducing its part (`bitwise_or` over uint64 and `max` over uint64: AVX2 loops, no
  stores) several times in a row; the rate while all threads read (`probe`), of the faster. On the 2-vCPU AVX2 EPYC
  box with 2 threads: 32 GB/s at load average 3.4, 15-20 GB/s at 5-13, 3.7 GB/s at 13+ (1 thread: 11-16 GB/s). An
  OpenVINO ReduceMax over the same bytes reached only 4.4 GB/s (its reduce kernels are not tuned for this), so numpy
  it is. It is a lower bound of what the box delivers: llama.cpp's one uncontended Q4_K_M decode of the 1.5B shape
  read 20.5 GB/s (980 MB x 20.9 tok/s) beside a 20.2 GB/s probe, so a share can pass 1.0 on a noisy box.
- Bytes per token of an OpenVINO export: every Constant that reaches a MatMul through decompression ops
  (Convert / Subtract / Multiply / Reshape / Transpose: the int4/int8 weights, their scales and zero points) is read
  once per step; a constant that only feeds a Gather (an untied embedding table) is not, only one row of it. Plus
  the KV cache the attention reads at the mean context of the run (layers x 2 x kv heads x head dim x bytes per
  element, the KV precision's: u8 on CPU by default, plus its per-token scale/zero point, ignored). Of a GGUF: the
  file's tensor bytes (a tied model's token_embd is read whole as the output matrix; untied, token_embd is left
  out), read from the GGUF header.
- Limit = bytes per token / bandwidth (ms per token); share reached = limit / the measured ms per token.

    python -m bench.bandwidth [--threads 2] [--export DIR ...] [--gguf FILE ...] [--context 192]
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import threading
import time
from pathlib import Path

import numpy as np

_PASS_THROUGH = {"Convert", "Subtract", "Multiply", "Reshape", "Transpose", "Unsqueeze", "Squeeze", "Concat"}


def probe(threads: int, mib: int = 512, passes: int = 8) -> dict:
    """Streaming-read bandwidth with `threads` threads, the faster of two reductions (`methods`). `gbps` is the rate
    while every thread reads: each thread reads its part `passes` times in a row, timing each pass; the window runs
    from the last thread's first start to the first thread's last end, and the threads' rates over their passes
    inside it (gaps included: reads that took turns count as such) add up. `gbps_wall`: every byte over the whole
    run's wall time, which counts a thread that starts late as idle. On the 2-vCPU Zen 4 VM that one swung 35-64
    GB/s within minutes while the memory did not: two 1-thread processes side by side read 34.0 + 33.7 GB/s, a
    2-thread C read 65.4 GB/s over 10 ms but 38 over 4.3 ms, and the threads' own rates summed to 57-72 while the
    wall rate read 37.7. The second thread of a pair started milliseconds late, at some moments (a halted vCPU
    woken by the host), and the wall rate measured that, not the memory."""
    buf = np.ones(mib * 2**20 // 8, np.uint64)
    chunks = np.array_split(buf, threads)
    methods = {"u64_or": np.bitwise_or.reduce, "u64_max": np.max}
    out: dict = {"threads": threads, "mib": mib, "methods": {}, "methods_wall": {}}
    for name, fn in methods.items():
        spans: list[list[tuple[float, float]]] = [[] for _ in range(threads)]

        def read(i: int, fn=fn, spans=spans) -> None:
            for _ in range(passes):
                t0 = time.perf_counter()
                fn(chunks[i])
                spans[i].append((t0, time.perf_counter()))

        ts = [threading.Thread(target=read, args=(i,)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        wall = max(s[-1][1] for s in spans) - min(s[0][0] for s in spans)
        out["methods"][name] = round(concurrent_rate(spans, [c.nbytes for c in chunks]) / 1e9, 2)
        out["methods_wall"][name] = round(buf.nbytes * passes / wall / 1e9, 2)
    out["gbps_wall"] = max(out["methods_wall"].values())
    out["gbps"] = max(out["methods"].values()) or out["gbps_wall"]
    out["loadavg_1m"] = round(os.getloadavg()[0], 2)
    return out


def concurrent_rate(spans: list[list[tuple[float, float]]], nbytes: list[int]) -> float:
    """Bytes per second while every thread read: thread i read nbytes[i] in each of its passes spans[i] (start, end),
    back to back. The window runs from the last first start to the first last end; a thread's rate is over its
    passes inside it, from the first one's start to the last one's end, so a thread that waited between its passes
    (threads that took turns) reads at what it got. 0 where a thread has fewer than 2 passes inside."""
    start, end = max(s[0][0] for s in spans), min(s[-1][1] for s in spans)
    rate = 0.0
    for size, own in zip(nbytes, spans):
        inside = [p for p in own if p[0] >= start and p[1] <= end]
        if len(inside) < 2:
            return 0.0
        rate += len(inside) * size / (inside[-1][1] - inside[0][0])
    return rate


def export_weight_bytes(export: Path) -> dict:
    """Bytes of the constants a decode step reads (those reaching a MatMul), and of those feeding only a Gather."""
    import openvino as ov

    model = ov.Core().read_model(str(export / "openvino_model.xml"))

    def reaches(node, seen) -> set[str]:
        kinds: set[str] = set()
        for out in node.outputs():
            for target in out.get_target_inputs():
                consumer = target.get_node()
                kind = consumer.get_type_name()
                if kind in _PASS_THROUGH:
                    if consumer.get_friendly_name() not in seen:
                        seen.add(consumer.get_friendly_name())
                        kinds |= reaches(consumer, seen)
                else:
                    kinds.add(kind)
        return kinds

    matmul = gather = other = 0
    for op in model.get_ordered_ops():
        if op.get_type_name() != "Constant":
            continue
        size = op.get_byte_size()
        if size < 4096:
            continue
        kinds = reaches(op, set())
        if "MatMul" in kinds:
            matmul += size
        elif kinds <= {"Gather"}:
            gather += size
        else:
            other += size
    return {"matmul_bytes": matmul, "gather_only_bytes": gather, "other_bytes": other}


def kv_bytes_per_token(export: Path, context: int, kv_element_bytes: float = 1.0) -> float:
    from appliance.manifest import Manifest

    m = Manifest.load(export)
    return m.num_layers * 2 * m.num_kv_heads * m.head_dim * kv_element_bytes * context


def gguf_tensor_bytes(path: Path) -> dict:
    """Tensor bytes of a GGUF by name, from its header (GGUF v3): {total, token_embd, output}."""
    with open(path, "rb") as f:
        data = f.read(64 * 2**20)  # the header is a few MB at most
    pos = 0

    def take(fmt: str):
        nonlocal pos
        v = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return v[0] if len(v) == 1 else v

    def string() -> str:
        nonlocal pos
        n = take("Q")
        s = data[pos : pos + n].decode("utf-8", "replace")
        pos += n
        return s

    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def value(kind: int):
        if kind == 8:
            return string()
        if kind == 9:
            sub, n = take("I"), take("Q")
            if sub in scalar:
                nonlocal pos
                pos += struct.calcsize("<" + scalar[sub]) * n
                return None
            for _ in range(n):
                value(sub)
            return None
        return take(scalar[kind])

    assert data[:4] == b"GGUF", f"{path}: not a GGUF"
    pos = 4
    _version, n_tensors, n_kv = take("I"), take("Q"), take("Q")
    meta = {}
    for _ in range(n_kv):
        key = string()
        meta[key] = value(take("I"))
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("Q") for _ in range(take("I"))]
        qtype, offset = take("I"), take("Q")
        infos.append((name, dims, qtype, offset))
    align = int(meta.get("general.alignment") or 32)
    start = (pos + align - 1) // align * align
    size = path.stat().st_size
    offsets = sorted(o for *_, o in infos) + [size - start]
    nbytes = {name: offsets[offsets.index(o) + 1] - o for name, _d, _q, o in infos}
    total = sum(nbytes.values())
    return {
        "total": total,
        "token_embd": nbytes.get("token_embd.weight", 0),
        "output": nbytes.get("output.weight", 0),
        "n_tensors": len(infos),
    }


def gguf_bytes_per_token(path: Path) -> int:
    t = gguf_tensor_bytes(path)
    return t["total"] - (t["token_embd"] if t["output"] else 0)


def limit_row(bytes_per_token: float, gbps: float, ms_per_token: float | None) -> dict:
    limit_ms = bytes_per_token / (gbps * 1e9) * 1e3
    return {
        "bytes_per_token_mb": round(bytes_per_token / 1e6, 1),
        "bandwidth_gbps": gbps,
        "limit_ms": round(limit_ms, 2),
        "limit_tok_s": round(1e3 / limit_ms, 1),
        "share_of_limit": round(limit_ms / ms_per_token, 3) if ms_per_token else None,
    }


def export_bytes_per_token(export: Path, context: int) -> float:
    w = export_weight_bytes(export)
    return w["matmul_bytes"] + w["other_bytes"] + kv_bytes_per_token(export, context)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--export", type=Path, nargs="*", default=[])
    ap.add_argument("--gguf", type=Path, nargs="*", default=[])
    ap.add_argument("--context", type=int, default=192, help="mean context of a decode step (KV bytes read)")
    args = ap.parse_args(argv)
    bw = probe(args.threads)
    print(json.dumps(bw))
    gbps = bw["gbps"]
    for e in args.export:
        w = export_weight_bytes(e)
        row = limit_row(export_bytes_per_token(e, args.context), gbps, None)
        print(e, json.dumps({**w, **row}))
    for g in args.gguf:
        row = limit_row(gguf_bytes_per_token(g), gbps, None)
        print(g, json.dumps({**gguf_tensor_bytes(g), **row}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
