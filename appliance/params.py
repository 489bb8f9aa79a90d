"""Typed request parameters. Validated once at the edge (HTTP layer or Python caller); the engine trusts them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """What to generate and how. Defaults mirror OVMS's built-ins; the server fills unset fields from the
    model's generation_config.json before constructing this."""

    max_tokens: int | None = None  # None: until EOS or the context is full
    temperature: float = 0.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: all tokens
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None  # same seed + same params -> same tokens
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: off; k >= 0: chosen token's logprob plus k alternatives
    skip_special_tokens: bool = True
    n: int = 1
    best_of: int | None = None  # > 1: beam search (issue 3/4)
    length_penalty: float = 1.0
    prompt_logprobs: int | None = None  # None: off; k >= 0: each prompt token's logprob plus k alternatives

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
