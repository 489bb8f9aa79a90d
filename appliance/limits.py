"""Every bound a request must keep, declared once: the `Limits` dataclass below.

One client must not be able to hurt the others: the engine is one thread shared by every request, and a worker
builds a choice per prompt x n. So every count, length and float range a request can carry is bounded here, and
everything else derives from these fields: validation (appliance/api/table.py) and the engine service
check them (400), `appliance serve` makes a flag of the
ones an operator may need to change (`flag` in a field's metadata: its default and help come from the field; the
`setting` field factory below declares EngineConfig's and ServeSettings' fields the same way),
`/v1/config` shows the effective values, and docs/serving.md's "Limits" table is `limits_table()` (a test keeps
the two equal). No numpy here: HTTP workers import this.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any


def setting(
    default: Any = MISSING,
    help_text: str = "",
    *,
    flag: str | None = None,
    default_factory: Any = MISSING,
    cli: Any = MISSING,
    show: str | None = None,
    kind: type | None = None,
) -> Any:
    """A configuration field, the one declaration of a default (Limits here, EngineConfig, ServeSettings): its
    default, a short help (flag help, docs tables) and the `appliance serve` flag that sets it, if an operator may
    (appliance/options.py derives the flag, its APPLIANCE_* variable, its help and docs/serving.md's Options table).
    `cli`: the flag's own default where it differs on purpose from the field's (None: "not given", so the CLI can
    refuse a flag that cannot act; or a word the CLI converts, "auto"); `show`: how help and docs write the default
    when the value alone would not say it; `kind`: the flag's type where it is not the field's."""
    metadata = {"help": help_text, "flag": flag, "show": show, "kind": kind}
    if cli is not MISSING:
        metadata["cli"] = cli
    return field(default=default, default_factory=default_factory, metadata=metadata)


@dataclass(frozen=True)
class Limits:
    """Server-side bounds of one request (OVMS's graph-config limits and what the appliance adds)."""

    # counts
    max_tokens: int | None = setting(
        None,
        "largest `max_tokens` / `max_completion_tokens` (OVMS's "
        "`max_tokens_limit`); none: only the model's context bounds it",
        flag="max-tokens-limit",
    )
    prompts: int = setting(
        256, "prompts per request: a completions prompt list, a `/tokenize` list", flag="max-prompts"
    )
    n: int = setting(20, "choices per request (`n`)", flag="max-n")
    best_of: int = setting(20, "beams of a beam search (`best_of`)", flag="max-best-of")
    logprobs: int = setting(20, "alternatives per token (completions `logprobs`, chat `top_logprobs`)")
    prompt_logprobs: int = setting(
        65536,
        "`echo` + `logprobs`: prompt tokens x (1 + logprobs) x n per request, checked after tokenization",
        flag="max-prompt-logprobs",
    )
    stop_strings: int = setting(16, "stop strings per request (OVMS)")
    stop_chars: int = setting(256, "characters per stop string")
    stop_token_ids: int = setting(64, "`stop_token_ids` per request (each also below the vocabulary size)")
    logit_bias: int = setting(300, "`logit_bias` entries (as OpenAI); keys are canonical decimal token ids")
    messages: int = setting(1024, "chat messages per request", flag="max-messages")
    tools: int = setting(128, "chat `tools` per request (as OpenAI)")
    bad_words: int = setting(
        256, "`bad_words` + `bad_word_tokens` entries (Friendli); each string at most `stop_chars` characters"
    )
    token_sequence: int = setting(32, "token ids in one `stop_tokens` / `bad_word_tokens` entry (Friendli)")
    grammar_chars: int = setting(
        65536,
        "characters of a `response_format` JSON schema (canonical JSON text), regex or grammar; for `tools` with "
        "`tool_choice` required or named, of the constrained tools' parameter schemas together",
    )
    depth: int = setting(32, "nesting of objects and arrays in a request body")
    # speculative decoding: a step verifies 1 + num_assistant_tokens positions per sequence, so this bounds what one
    # request adds to a step's batched tokens (transformers drafts 20 at most by default; acceptance past ~10 in a
    # row is rare, and a rejected draft costs its positions' compute)
    assistant_tokens: int = setting(
        32, "`num_assistant_tokens` (speculative decoding: draft tokens per step) in [0, this]"
    )
    ngram_size: int = setting(16, "`max_ngram_size` (prompt lookup: the longest n-gram matched) in [1, this]")
    prediction_chars: int = setting(
        65536, "characters of a `prediction` (OpenAI's Predicted Outputs: text the answer is expected to repeat)"
    )
    no_repeat_ngram: int = setting(
        32,
        "`no_repeat_ngram` (Friendli: no n-gram of this size repeats) in [0, this]; its index counts in `setup_work`",
    )
    # What a request's sequences cost the engine thread before and while they start, in positions indexed: per
    # sequence, its bad word tokens (the ban table; bad words are tokenized once per request, with and without a
    # leading space) + the prediction's tokens x the prompt-lookup n-gram size (the draft index) + the prompt's tokens
    # x (no_repeat_ngram - 1) (the n-gram ban index). Measured on the 2-core dev box: about 1 us and 150 bytes per
    # unit (prompt lookup: 65,536 tokens x 16 sizes = 1.0 s, 160 MB; no_repeat_ngram 4001 over 8,000 tokens:
    # 0.35 s, 130 MB), so the default keeps one request to well under half a second and ~80 MB of index. Typical
    # use is far below: 8,000 prompt tokens with no_repeat_ngram 3 x 20 choices is 320,000.
    setup_work: int = setting(
        524288,
        "per-request set-up work in positions indexed, summed over its sequences: bad word tokens + prediction "
        "tokens x n-gram size + prompt tokens x (no_repeat_ngram - 1); checked after tokenization, else 400",
        flag="max-setup-work",
    )
    generated_logprobs: int = setting(
        524288,
        "generated logprobs one request may produce: n x max tokens (or what the context leaves) x "
        "(1 + logprobs), checked after tokenization, else 400 (~150 bytes each in the HTTP worker)",
        flag="max-generated-logprobs",
    )
    # the Responses and Anthropic Messages adapters' own fields (what they map onto chat keeps the bounds above)
    content_parts: int = setting(
        1024, "content parts of one message: Responses input parts, Anthropic content and `system` blocks"
    )
    id_chars: int = setting(
        256,
        "characters of an id or identifier a request carries: `previous_response_id`, input item ids, call ids, "
        "`user`, `safety_identifier`, `prompt_cache_key` (Responses); `tool_use` ids (Anthropic)",
    )
    metadata: int = setting(16, "`metadata` entries (Responses, as OpenAI)")
    metadata_key_chars: int = setting(64, "characters of a `metadata` key (Responses, as OpenAI)")
    metadata_chars: int = setting(512, "characters of a `metadata` value (Responses, as OpenAI)")
    input_items_page: int = setting(100, "`limit` of GET /v3/responses/{id}/input_items in [1, this] (as OpenAI)")
    # images (vision-language models, docs/vision.md): the HTTP worker checks counts and file bytes (base64 decoded
    # or fetched), the engine process decodes (format, pixels); each refusal a 400 in the API's shape
    images: int = setting(8, "images per request, every message's image parts together", flag="max-images")
    image_bytes: int = setting(
        10 * 2**20, "bytes of one image file (after base64 decoding or fetching)", flag="max-image-bytes"
    )
    image_pixels: int = setting(
        16_777_216,
        "decoded pixels of one image (width x height, read from its header before decoding: decompression bombs)",
        flag="max-image-pixels",
    )
    # embeddings and rerank (appliance/server/encoders/embeddings.py): each input is also at most the model's max
    # length in tokens (its manifest's max_length), else 400 unless the request asks to `truncate`
    embedding_inputs: int = setting(
        2048, "inputs per embeddings request (an `input` list; OpenAI's bound)", flag="max-embedding-inputs"
    )
    embedding_tokens: int = setting(
        65536,
        "tokens of one embeddings or rerank request, its inputs (or query + document pairs) together after "
        "truncation, else 400 (256 inputs of all-MiniLM-L6-v2's 256 tokens: ~80 s of its int8 export on one core "
        "of the 2-core dev box under load, other requests taking turns in between)",
        flag="max-embedding-tokens",
    )
    rerank_documents: int = setting(1000, "documents per rerank request (Cohere's bound)", flag="max-rerank-documents")
    # float ranges
    temperature: float = setting(2.0, "`temperature` in [0, this]")
    penalty: float = setting(2.0, "`frequency_penalty`, `presence_penalty` in [-this, this]")
    repetition_penalty: float = setting(10.0, "`repetition_penalty` in (0, this]")
    length_penalty: float = setting(10.0, "`length_penalty` (beam search) in [-this, this]")
    timeout: float = setting(86400.0, "`timeout` in (0, this] seconds")
    # the engine's queue, as the HTTP workers see it (not a flag of its own: `appliance serve` copies it here)
    max_queued: int | None = setting(
        None,
        "queue places one request may take, n x prompts (beam search: prompts), "
        "else 400; `appliance serve` sets it from `--max-queued`",
    )

    @classmethod
    def from_dict(cls, data: dict) -> Limits:
        """The inverse of dataclasses.asdict (settings.json); unknown keys are dropped."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


# What a request body needs besides one image's base64 text (the question, the other fields, a conversation): an
# image of --max-image-bytes must fit --max-body-bytes with this much room, or `appliance serve` refuses to start
# (appliance/options.py check_server), since a client could never send the image the limit promises.
IMAGE_BODY_ROOM = 1024 * 1024


def base64_chars(size: int) -> int:
    """The length of the standard, padded base64 text of `size` bytes: 4 characters per 3 bytes, rounded up."""
    return 4 * -(-size // 3)


def image_body_bytes(image_bytes: int) -> int:
    """The smallest --max-body-bytes that carries one image of `image_bytes` as base64 (a data URL, Anthropic's and
    Ollama's base64 fields) with IMAGE_BODY_ROOM for the rest of the request."""
    return base64_chars(image_bytes) + IMAGE_BODY_ROOM


def flag_fields(cls: type = Limits) -> tuple[Field, ...]:
    """The fields of a `setting` dataclass (Limits by default) that `appliance serve` makes flags of."""
    return tuple(f for f in fields(cls) if f.metadata.get("flag"))


def field_default(f: Field) -> Any:
    """A field's default; None for a required one (or a default_factory)."""
    return f.default if f.default is not MISSING else None


def from_flags(values: dict[str, Any], **extra: Any) -> Limits:
    """Limits from the flag values (keyed by field name); a flagged bound must be at least 1 (or none where none is
    its default). ValueError names the flag."""
    for f in flag_fields():
        value = values.get(f.name)
        if value is None and field_default(f) is None:
            continue
        if value is None or value < 1:
            raise ValueError(f"--{f.metadata['flag']} must be at least 1")
    return Limits(**{f.name: values[f.name] for f in flag_fields() if f.name in values}, **extra)


def show(value: Any) -> str:
    """A default as docs/serving.md's table writes it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def limits_table() -> str:
    """docs/serving.md's "Limits" table (tests/api/test_api_validation.py checks the document holds exactly this)."""
    rows = ["| limit | default | flag | bounds |", "|---|---|---|---|"]
    for f in fields(Limits):
        flag = f"`--{f.metadata['flag']}`" if f.metadata["flag"] else ""
        rows.append(f"| `{f.name}` | {show(field_default(f))} | {flag} | {f.metadata['help']} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # python -m appliance.limits: the table for docs/serving.md
    print(limits_table(), end="")
