"""What the engine hands back, per step and at the end. Plain data: it crosses process boundaries (pickle)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    token: str  # the token's text (bytes decoded with errors="replace")
    logprob: float | None  # under the model's raw distribution (log-softmax of the logits); None: first prompt token
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (id, text, logprob), best first


@dataclass
class Chunk:
    """New output of one sequence after one engine step. `text` is safe to show: stop strings already cut,
    no half UTF-8 characters. The last chunk of a sequence has `finish_reason` set."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" (cancelled / error)
    error: str | None = None  # set with finish_reason "abort" when the engine failed the request
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (usage.prompt_tokens_details)
    # speculative decoding, so far in this sequence: draft tokens the model accepted / rejected (OpenAI's
    # usage.completion_tokens_details accepted_prediction_tokens / rejected_prediction_tokens)
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    # with the first chunk of a sequence when params.prompt_logprobs is set: one entry per prompt token; the
    # first one's logprob is None (nothing predicts it)
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class Timing:
    """Seconds, as the Cerebras API's time_info gives them."""

    created: float = 0.0  # unix time the request arrived
    queue_time: float = 0.0  # waiting before the first prefill step
    prompt_time: float = 0.0  # prefill, up to the first token
    completion_time: float = 0.0  # first token to last
    total_time: float = 0.0


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] | None
    timing: Timing
    prompt_logprobs: list[TokenLogprob] | None = None
