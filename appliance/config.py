"""Engine configuration: one dataclass, the Python API's (`Engine(model_dir, EngineConfig(...))`) and the source of
`appliance serve`'s engine flags: each field declares its default and help once (appliance/limits.py `setting`), and
appliance/cli.py derives the flag, its APPLIANCE_* variable, its help and docs/serving.md's Options table from it.

Where a flag's default differs from the field's, the field says so (`cli=`): the CLI needs "not given" to refuse a
flag that cannot act (the --static-* knobs off static shapes), or a word it converts ("auto", "default"). The one
deliberate difference in behaviour is the KV pool: see `kv_cache_tokens`."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.limits import setting


@dataclass
class EngineConfig:
    device: str = setting("CPU", "OpenVINO device: CPU, GPU, NPU, AUTO, HETERO:...", flag="device")
    # None keeps the device's fast default (bf16 on AVX-512-bf16 CPUs); "f32" with fp32 weights gives transformers
    # parity. The flag's words: f32 -> "f32", default -> None.
    precision: str | None = setting(
        None,
        "inference precision: 'f32' (transformers parity with an fp32 export) or 'default' (fastest)",
        flag="precision",
        cli="default",
    )
    # KV cache element type; None: f32 when precision is f32, else u8 on CPU (~30% faster decode than f16).
    kv_cache_precision: str | None = setting(
        None,
        "KV cache element type: u8, f16, f32, or auto (u8 on CPU; f32 with "
        "--precision f32; the device's choice elsewhere)",
        flag="kv-cache-precision",
        cli="auto",
    )
    # Paged KV pool budget, all sequences together (appliance/backends/kv_budget.py): kv_cache_bytes wins when set;
    # both None = auto (a quarter of the memory free after loading, capped at max_num_seqs full contexts).
    # Static-shape backends ignore both: their KV is static_batch x static_context.
    # The Python API's default is a fixed 16384-token pool, on purpose: a library shares its process (tests,
    # benchmarks, notebooks) and gets the same pool on every machine; `appliance serve` owns its machine and defaults
    # to auto (both flags unset). This is the one default the API and the CLI do not share.
    kv_cache_bytes: int | None = setting(
        None,
        "KV cache pool, all sequences together, allocated once at start-up: GB "
        "as OVMS's cache_size (a bare number: 2, 1.5), a size with a unit "
        "(512MB, 2GiB; binary units), a token count (16384tokens), or auto (a "
        "quarter of the memory free after loading the model, at most "
        "max-num-seqs full contexts, at least 256 MB)",
        flag="kv-cache-size",
        kind=str,
        show="auto",
    )
    kv_cache_tokens: int | None = setting(
        16384,
        "KV cache budget in tokens: --kv-cache-size Ntokens (giving both is an error)",
        flag="kv-cache-tokens",
        cli=None,
        show="auto (EngineConfig(): {default})",
    )
    max_num_seqs: int = setting(32, "sequences decoded together in one step", flag="max-num-seqs")
    max_num_batched_tokens: int = setting(
        512,
        "tokens per step: one per running sequence + prefill chunks (so at least the sequences decoded per step)",
        flag="max-num-batched-tokens",
    )
    max_queued: int = setting(
        256,
        "waiting sequences (each choice, each prompt of a list) before a submission is "
        "refused whole (QueueFull; 429 over HTTP)",
        flag="max-queued",
    )
    prefix_caching: bool = setting(
        True,
        "reuse the KV blocks of shared prompt prefixes (OVMS's enable_prefix_caching; paged attention)",
        flag="enable-prefix-caching",
    )
    # The --static-* flags default to "not given" (cli=None): the CLI refuses them where static shapes are off.
    static: bool = setting(
        False,
        "static shapes, what an NPU needs (implied by --device NPU; --no-static with it is an error)",
        flag="static",
        cli=None,
        show="off (on for NPU)",
    )
    static_context: int = setting(
        1024, "static shapes (and ONNX models): KV positions per sequence slot", flag="static-context", cli=None
    )
    static_batch: int = setting(
        4, "static shapes (and ONNX models): sequence slots, decoded together", flag="static-batch", cli=None
    )
    static_prefill_chunk: int = setting(
        128,
        "static shapes (and ONNX models): prompt tokens per prefill call (padded)",
        flag="static-prefill-chunk",
        cli=None,
    )
    num_threads: int | None = setting(None, "inference threads (CPU)", flag="num-threads", show="the runtime's")
    cache_dir: str | None = setting(
        None, "OpenVINO compiled-model cache directory: faster restarts (OpenVINO models only)", flag="cache-dir"
    )

    def kv_precision(self) -> str | None:
        if self.kv_cache_precision:
            return self.kv_cache_precision
        if self.precision == "f32":
            return "f32"
        return "u8" if self.device.upper() == "CPU" else None
