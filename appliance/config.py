"""Engine configuration: one dataclass, filled from CLI flags / env / config file by the caller."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    device: str = "CPU"                 # CPU, GPU, NPU, AUTO, HETERO:...
    # None keeps the device's fast default (bf16 on AVX-512-bf16 CPUs); "f32" with fp32 weights gives transformers
    # parity.
    precision: str | None = None
    # KV cache element type; None: f32 when precision is f32, else u8 on CPU (~30% faster decode than f16).
    kv_cache_precision: str | None = None
    # Paged KV pool budget, all sequences together (appliance/kv_budget.py): kv_cache_bytes wins when set; both
    # None = auto (a quarter of the memory free after loading, capped at max_num_seqs full contexts; what `serve`
    # does).
    # Static-shape backends ignore both: their KV is static_batch x static_context.
    kv_cache_tokens: int | None = 16384
    kv_cache_bytes: int | None = None
    max_num_seqs: int = 32              # sequences decoded together in one step
    max_num_batched_tokens: int = 512   # tokens per step: decode tokens + prefill chunks (chunked prefill)
    max_queued: int = 256               # waiting sequences before a submission raises QueueFull
    prefix_caching: bool = True         # reuse KV blocks of shared prompt prefixes (paged backends)
    static: bool = False                # static shapes (what an NPU needs); implied by device NPU
    static_context: int = 1024          # static: KV positions per sequence slot
    static_batch: int = 4               # static: sequence slots decoded per call
    static_prefill_chunk: int = 128     # static: prompt tokens per prefill call (padded)
    num_threads: int | None = None      # inference threads; None: the runtime's default
    cache_dir: str | None = None        # OpenVINO compiled-model cache (faster start-up)

    def kv_precision(self) -> str | None:
        if self.kv_cache_precision:
            return self.kv_cache_precision
        if self.precision == "f32":
            return "f32"
        return "u8" if self.device.upper() == "CPU" else None
