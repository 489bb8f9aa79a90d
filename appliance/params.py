"""Typed request parameters. Validated once at the edge (HTTP layer or Python caller); the engine trusts them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

GrammarKind = Literal["json_schema", "regex", "lark", "gbnf"]
# How a model writes tool calls and reasoning: appliance/server/tool_prompt.py picks one from the chat template (or the
# serve flags), HTTP workers parse the output with it (appliance/api/tool_calls.py, reasoning.py)
TOOL_CALL_FORMATS = ("hermes", "llama3_json", "mistral")  # the first: a template that shows none
REASONING_FORMATS = ("none", "think")


@dataclass(frozen=True)
class Grammar:
    """A constraint on the generated text, compiled engine-side (appliance/runtime/grammar.py, llguidance) into a token
    mask applied at every step. `text`: the JSON schema as canonical JSON text (json_object is the schema
    {"type": "object"}), the regular expression, a Lark grammar (which may embed JSON schemas with `%json {...}`,
    as tool calls do) or a GBNF one (llama.cpp's; converted to Lark engine-side). Equal grammars share one
    compilation."""

    kind: GrammarKind
    text: str
    # Where it came from, for the 400 when it does not compile: the request field, and for a Lark grammar built of
    # clients' JSON schemas (tool calls) what each of its `%json` lines holds, in order ("the parameters of ...")
    param: str = "response_format"
    parts: tuple[str, ...] = ()


def from_model(default: float | int, key: str) -> Any:
    """A sampling attribute a model's generation_config.json may set: `key` is that file's name for it, read by
    appliance/api/sampling.py for every client API (a request's own value still wins). Declared here, on the
    attribute, so no API's wire table decides which models' defaults another API gets."""
    return field(default=default, metadata={"model_default": key})


@dataclass
class SamplingParams:
    """What to generate and how. Defaults mirror OVMS's built-ins; the server fills unset fields from the
    model's generation_config.json before constructing this."""

    max_tokens: int | None = None  # None: until EOS or the context is full
    temperature: float = from_model(0.0, "temperature")  # 0 -> greedy
    top_p: float = from_model(1.0, "top_p")
    top_k: int = from_model(-1, "top_k")  # -1: all tokens
    min_p: float = from_model(0.0, "min_p")
    # locally typical sampling: the mass of the most typical tokens kept; 1.0: off
    typical_p: float = from_model(1.0, "typical_p")
    repetition_penalty: float = from_model(1.0, "repetition_penalty")
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None  # same seed + same params -> same tokens
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = from_model(0, "min_new_tokens")
    logprobs: int | None = None  # None: off; k >= 0: chosen token's logprob plus k alternatives
    skip_special_tokens: bool = True
    n: int = 1
    best_of: int | None = None  # > 1: beam search
    length_penalty: float = from_model(1.0, "length_penalty")
    prompt_logprobs: int | None = None  # None: off; k >= 0: each prompt token's logprob plus k alternatives
    # structured output: the text must match this grammar (EOS only where it accepts); None: free text
    grammar: Grammar | None = None
    # Friendli's bad_words (strings, tokenized engine-side with and without a leading space) and bad_word_tokens:
    # a token that would complete one of these sequences is never sampled
    bad_words: list[str] = field(default_factory=list)
    bad_word_tokens: list[list[int]] = field(default_factory=list)
    no_repeat_ngram: int = 0  # > 1: no n-gram of this size occurs twice in prompt + generated (transformers)
    stop_token_sequences: list[list[int]] = field(default_factory=list)  # Friendli stop_tokens longer than one id
    # prompt-relative limits, resolved per sequence by the engine once the prompt is tokenized (Friendli
    # max_total_tokens / min_total_tokens: prompt + generated; Cerebras min_tokens -1: up to the length limit)
    max_total_tokens: int | None = None
    min_total_tokens: int | None = None
    min_tokens_to_limit: bool = False
    early_stopping: bool = False  # beam search: stop once best_of hypotheses finished (transformers' True)
    # speculative decoding (OVMS's names; the output does not change, only the speed): draft tokens per step
    # (0: no speculation for this request), the draft model's confidence below which it stops drafting, the
    # longest n-gram prompt lookup matches; None: the model's serve settings
    num_assistant_tokens: int | None = None
    assistant_confidence_threshold: float | None = None
    max_ngram_size: int | None = None
    # OpenAI's Predicted Outputs (`prediction.content`): text the answer is expected to repeat, a source of
    # prompt-lookup drafts (tokenized engine-side)
    prediction: str | None = None
    # `prediction` as token ids: Engine.prepare tokenizes it (and `bad_words` into bad_word_tokens) once per
    # request, on the caller's thread, so a request's choices share the work and the engine thread never does it
    prediction_ids: list[int] | None = None
    # prefix-cache namespace (the API key's, unless the operator shares the cache): blocks cached for one scope
    # are never a hit for another ("": the shared namespace)
    cache_scope: str = ""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
