"""Engine configuration: one dataclass, the Python API's (`Engine(model_dir, EngineConfig(...))`) and the source of
`appliance serve`'s engine flags: each field declares its default and help once (appliance/limits.py `setting`), and
appliance/options.py derives the flag, its APPLIANCE_* variable, its help and docs/serving.md's Options table from it.

Where a flag's default differs from the field's, the field says so (`cli=`): the CLI needs "not given" to refuse a
flag that cannot act (the --static-* knobs off static shapes), or a word it converts ("auto", "default"). The two
deliberate differences in behaviour are the KV pool (`kv_cache_tokens`) and the compile cache (`cache_dir`)."""

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
    # Which kernels run the low-bit MatMuls on CPU (appliance/runtime/kernels/): "auto" = ours (int8 activations x u4
    # weights) where the extension is built and the CPU has AVX2, except under --precision f32 (transformers parity:
    # like the plugin's dynamic quantization, int8 activations are a lossy shortcut); "ours" = also under f32;
    # "openvino" = the CPU plugin's own. Any failure falls back to OpenVINO's, never failing the load.
    kernels: str = setting(
        "auto",
        "low-bit MatMul kernels on CPU: auto (ours where built and the CPU has AVX2, not with --precision f32), "
        "ours, or openvino",
        flag="kernels",
    )
    # KV cache element type; None: f32 when precision is f32, else u8 on CPU (~30% faster decode than f16).
    kv_cache_precision: str | None = setting(
        None,
        "KV cache element type: u8, f16, f32, or auto (u8 on CPU; f32 with "
        "--precision f32; the device's choice elsewhere)",
        flag="kv-cache-precision",
        cli="auto",
    )
    # Paged KV pool budget, all sequences together (runtime/backends/kv_budget.py): kv_cache_bytes wins when set;
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
    prefix_cache_sharing: str = setting(
        "keys",
        "`keys`: each API key has its own prefix cache (a hit, `cached_tokens` and its speed, would tell one "
        "key what another sent); `shared`: all keys reuse each other's prefixes (one tenant)",
        flag="prefix-cache-sharing",
    )
    # The vision feature cache (runtime/vision/feature_cache.py): an image file seen before skips its decode and
    # vision encode (the prefix cache then skips its prefill). A budget per prefix-cache scope, so one API key never
    # evicts another's images: the memory is at most this x (API keys + 1). 64 MiB holds 42 Qwen2-VL-2B images of
    # 448 x 448 (1.5 MiB of features each).
    image_cache_bytes: int = setting(
        64 << 20,
        "vision-language models: bytes of encoded images kept per API key (per prefix-cache scope), so the same "
        "image file again skips its decode and vision encode (least recently used evicted); 0 turns it off",
        flag="image-cache-bytes",
    )
    # The prefix cache's disk tier (runtime/kv_disk.py, docs/kv-cache.md): off unless given a directory. Off by
    # default because it writes every full prompt block (a 2,000-token prompt of the default model: 27 MB) to the
    # disk, wear and bandwidth an edge box's flash should not pay for a deployment that does not reuse prefixes
    # across restarts; the operator turns it on where it pays (long shared system prompts, RAG contexts).
    kv_disk_dir: str | None = setting(
        None,
        "directory of the prefix cache's disk tier (KV blocks kept across restarts and past the RAM pool; "
        "paged attention only)",
        flag="kv-disk-dir",
        show="off",
    )
    kv_disk_bytes: int = setting(
        2 << 30,
        "the disk tier's size budget in bytes, for the whole directory across models (least recently used blocks "
        "evicted)",
        flag="kv-disk-bytes",
    )
    # A week: a prompt used weekly still hits after restarts, and one nobody sends again (a deleted stored
    # response's included) is off the disk a week after its last use.
    kv_disk_max_age: float = setting(
        7 * 86400.0,
        "seconds a disk tier block is kept after its last use (written or loaded), whatever the budget",
        flag="kv-disk-max-age",
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
    # OpenVINO's compile cache (CACHE_DIR): a later load of the same model, device and settings reads the compiled
    # blob instead of compiling (docs/deploy.md has the start-up times). `appliance serve` turns it on by default
    # (cli "auto": <APPLIANCE_DATA_DIR>/cache/openvino, appliance/paths.py); the Python API leaves it off: a library
    # shares its caller's disk, every distinct model x device x shape x precision it compiles adds a blob as large
    # as the weights (~270 MB for the default fp16 model) and nothing evicts them, while a server compiles the same
    # few configurations at every start. An unwritable directory turns the cache off with a warning (a read-only
    # box still serves). ONNX models ignore it, and so does the paged graph on CPU (`compile_cache` says why).
    cache_dir: str | None = setting(
        None,
        "OpenVINO compiled-model cache directory, for faster restarts (static shapes / NPU, GPU): a path, auto, "
        "or none (off)",
        flag="cache-dir",
        cli="auto",
        show="auto: <APPLIANCE_DATA_DIR>/cache/openvino (EngineConfig(): none)",
    )
    # OVMS's max_prompt_len (the NPU plugin's MAX_PROMPT_LEN, default 1024): on static shapes a longer prompt is
    # refused with a 400 naming this limit. The KV slot (static_context) must hold the prompt and the answer.
    max_prompt_len: int = setting(
        1024,
        "static shapes (NPU): longest prompt in tokens, longer ones get a 400 (OVMS's max_prompt_len)",
        flag="max-prompt-len",
        cli=None,
    )

    # Speculative decoding (runtime/speculative/, runtime/engine/speculation.py): a proposer drafts tokens, the
    # model verifies them all in one step (paged attention only; static shapes and ONNX refuse these flags). The
    # output is the same as without (greedy: token for token; sampling: the same distribution, the same tokens for
    # a seed); only the speed changes.
    prompt_lookup: bool = setting(
        False,
        "prompt-lookup (n-gram) speculative decoding: draft tokens copied from the prompt and the output so far, "
        "verified in one step (OVMS's prompt_lookup; paged attention)",
        flag="prompt-lookup",
    )
    draft_model: str | None = setting(
        None,
        "speculative decoding with a draft model: a small exported model with the same tokenizer drafts tokens "
        "for this one to verify (OVMS's draft_models_path; paged attention)",
        flag="draft-model",
        show="none",
    )
    draft_device: str | None = setting(
        None, "the draft model's OpenVINO device", flag="draft-device", show="--device's"
    )
    num_assistant_tokens: int = setting(
        5,
        "speculative decoding: draft tokens per step and sequence (a draft model drafts fewer while its drafts fail); "
        "a request's num_assistant_tokens overrides it",
        flag="num-assistant-tokens",
    )
    max_ngram_size: int = setting(
        3,
        "prompt lookup: longest n-gram of the latest tokens looked up in the prompt and output; a request's "
        "max_ngram_size overrides it",
        flag="max-ngram-size",
    )
    speculation_max_batch: int = setting(
        4,
        "speculative decoding runs while at most this many sequences decode in a step (a larger batch already "
        "uses the compute that verifying drafts would)",
        flag="speculation-max-batch",
    )

    def compile_cache(self) -> str | None:
        """cache_dir where OpenVINO can use it: static shapes (NPU, --static) on any device, the paged graph on GPU.
        The CPU plugin cannot import its own paged-attention blob (the PagedAttention nodes lose their k_head_size /
        num_k_heads runtime info on export), so it compiled anew at every start and rewrote the 270 MB blob, 36%
        slower than no cache (docs/deploy.md): there the cache stays off."""
        device = self.device.upper()
        return self.cache_dir if self.static or device.startswith(("NPU", "GPU")) else None

    def speculative(self) -> str | None:
        """The model's speculation: "draft" (a draft model), "prompt_lookup", or None (requests may still turn
        prompt lookup on: a prediction or max_ngram_size)."""
        return "draft" if self.draft_model else "prompt_lookup" if self.prompt_lookup else None

    def kv_precision(self) -> str | None:
        if self.kv_cache_precision:
            return self.kv_cache_precision
        if self.precision == "f32":
            return "f32"
        return "u8" if self.device.upper() == "CPU" else None
