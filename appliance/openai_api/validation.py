"""Request bodies -> typed, validated requests, once, at the edge. Nothing downstream re-checks them.

Rules and messages follow OVMS (see docs/serving.md); where the appliance goes further (logprobs 0..20 and in
streaming, prompt lists and token ids, n > 1) the messages keep OVMS's style. A JSON null means "not set" for
every optional field. Unknown fields are accepted and reported in `unknown` (the app logs them at debug).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from appliance.openai_api.errors import invalid
from appliance.params import SamplingParams

UINT32_MAX = 4294967295
OVMS_DEFAULT_TOP_K = 40          # OVMS: sampling with no top_k given
Prompt = str | tuple[int, ...]   # text or token ids


@dataclass(frozen=True)
class Limits:
    """Server-side bounds (OVMS's graph-config limits)."""

    max_tokens: int | None = None    # None: only the model's context bounds max_tokens
    best_of: int = 20
    stop_strings: int = 16
    logprobs: int = 20
    n: int = 20


@dataclass(frozen=True)
class GenerationRequest:
    """Fields completions and chat share. None = not set (defaults are applied by `sampling_params`)."""

    model: str
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    skip_special_tokens: bool | None = None
    logprobs: int | None = None      # None: off; k: chosen token + k alternatives
    n: int = 1
    timeout: float | None = None     # seconds; past it the request is cancelled and answered 429
    unknown: tuple[str, ...] = ()
    best_of: int | None = None       # > 1: beam search with best_of beams, the n best returned


@dataclass(frozen=True)
class CompletionRequest:
    gen: GenerationRequest
    prompts: tuple[Prompt, ...]
    echo: bool = False


@dataclass(frozen=True)
class ChatRequest:
    gen: GenerationRequest
    messages: tuple[dict, ...]


@dataclass(frozen=True)
class TokenizeRequest:
    model: str
    prompts: tuple[str, ...]
    batched: bool                    # prompt was a list: answer a list of lists


# ---------------------------------------------------------------- field readers

@dataclass
class _Body:
    """Typed getters over a JSON object; null reads as absent; remembers which fields were read."""

    data: dict
    seen: set = field(default_factory=set)

    def raw(self, name: str) -> Any:
        self.seen.add(name)
        return self.data.get(name)

    def boolean(self, name: str, message: str) -> bool | None:
        value = self.raw(name)
        if value is not None and not isinstance(value, bool):
            raise invalid(message, name)
        return value

    def integer(self, name: str, message: str) -> int | None:
        value = self.raw(name)
        if value is not None and not _is_int(value):
            raise invalid(message, name)
        return value

    def number(self, name: str, message: str | None = None) -> float | None:
        value = self.raw(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise invalid(message or f"{name} is not a valid number", name)
        return float(value)

    def in_range(self, name: str, low: float, high: float, message: str, *, open_high: bool = False) -> float | None:
        value = self.number(name)
        if value is not None and not (low <= value < high if open_high else low <= value <= high):
            raise invalid(message, name)
        return value

    def unknown(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.data) - self.seen))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _object(body: Any) -> _Body:
    if not isinstance(body, dict):
        raise invalid("Received json is not an object")
    return _Body(body)


def _model(b: _Body) -> str:
    model = b.raw("model")
    if model is None:
        raise invalid("model missing in request", "model")
    if not isinstance(model, str):
        raise invalid("model is not a string", "model")
    return model


# ---------------------------------------------------------------- shared rules

def _generation(b: _Body, limits: Limits, *, max_tokens_field: str = "max_tokens") -> dict:
    """The common fields, as keyword arguments for GenerationRequest (cross-field rules are checked by callers)."""
    out: dict[str, Any] = {"model": _model(b)}
    stream = b.boolean("stream", "Stream is not bool") or False
    out["stream"] = stream

    options = b.raw("stream_options")
    if options is not None:
        if not stream:
            raise invalid("stream_options provided, but stream not set to true", "stream_options")
        if not isinstance(options, dict):
            raise invalid("stream_options is not an object", "stream_options")
        if set(options) - {"include_usage"}:
            raise invalid("Found unexpected stream options. Properties accepted in stream_options: include_usage",
                          "stream_options")
        usage = options.get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise invalid("stream_options.include_usage is not a boolean", "stream_options")
        out["include_usage"] = bool(usage)

    out["ignore_eos"] = b.boolean("ignore_eos", "ignore_eos accepts values true or false")

    out["max_tokens"] = _max_tokens(b, limits, max_tokens_field)

    for name in ("frequency_penalty", "presence_penalty"):
        out[name] = b.in_range(name, -2.0, 2.0, f"{name} out of range(-2.0, 2.0)")
    out["repetition_penalty"] = b.number("repetition_penalty")
    if out["repetition_penalty"] is not None and out["repetition_penalty"] <= 0:
        raise invalid("repetition_penalty must be greater than 0", "repetition_penalty")
    out["length_penalty"] = b.number("length_penalty")
    out["temperature"] = b.in_range("temperature", 0.0, 2.0, "temperature out of range(0.0, 2.0)")
    out["top_p"] = b.in_range("top_p", 0.0, 1.0, "top_p out of range(0.0, 1.0)")
    out["min_p"] = b.in_range("min_p", 0.0, 1.0, "min_p out of range [0.0, 1.0)", open_high=True)

    top_k = b.integer("top_k", "top_k is not an integer")
    if top_k is not None and top_k != -1 and top_k <= 0:
        raise invalid("top_k must be -1 (all tokens) or a positive integer", "top_k")
    out["top_k"] = top_k

    seed = b.integer("seed", "seed is not an integer")
    if seed is not None and not 0 <= seed <= UINT32_MAX:
        raise invalid("seed out of range [0, 4294967295]", "seed")
    out["seed"] = seed

    out["stop"] = _stop(b.raw("stop"), limits)

    include_stop = b.boolean("include_stop_str_in_output", "include_stop_str_in_output accepts values true or false")
    if include_stop is False and stream:
        raise invalid("include_stop_str_in_output cannot be set to false if streaming is used",
                      "include_stop_str_in_output")
    out["include_stop_str_in_output"] = include_stop

    out["skip_special_tokens"] = b.boolean("skip_special_tokens", "skip_special_tokens is not a bool")

    stop_ids = b.raw("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(_is_int(t) and 0 <= t <= UINT32_MAX for t in stop_ids):
            raise invalid("stop_token_ids is not an array of token ids", "stop_token_ids")
        out["stop_token_ids"] = tuple(stop_ids)

    min_tokens = b.integer("min_tokens", "min_tokens is not an unsigned integer")
    if min_tokens is not None and min_tokens < 0:
        raise invalid("min_tokens is not an unsigned integer", "min_tokens")
    out["min_tokens"] = min_tokens

    out["logit_bias"] = _logit_bias(b.raw("logit_bias"))

    timeout = b.number("timeout", "timeout must be a positive number of seconds")
    if timeout is not None and timeout <= 0:
        raise invalid("timeout must be a positive number of seconds", "timeout")
    out["timeout"] = timeout

    out["n"], out["best_of"] = _n_and_best_of(b, limits, stream)
    b.raw("user")  # accepted, unused
    return out


def _max_tokens(b: _Body, limits: Limits, name: str) -> int | None:
    value = b.integer(name, f"{name} is not an unsigned integer")
    if value is not None:
        if not 0 <= value <= UINT32_MAX:
            raise invalid(f"{name} is not an unsigned integer", name)
        if limits.max_tokens is not None and value > limits.max_tokens:
            raise invalid(f"{name} exceeds limit provided in graph config: {limits.max_tokens}", name)
    return value


def _stop(value: Any, limits: Limits) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        values = [value]
    elif isinstance(value, list):
        if len(value) > limits.stop_strings:
            raise invalid(f"stop array must have no more than {limits.stop_strings} strings", "stop")
        if not all(isinstance(s, str) for s in value):
            raise invalid("stop array contains non string element", "stop")
        values = value
    else:
        raise invalid("stop is not a string or array of strings", "stop")
    return tuple(s for s in values if s)   # an empty stop string would match everywhere: it means nothing


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid("logit_bias is not an object", "logit_bias")
    out = []
    for key, bias in value.items():
        # ASCII digits only (int() would also take " 5", "+5", "1_0" and other scripts' digits), and bounded: the
        # engine keeps token ids in int64 arrays, so a huge id must never get that far.
        if not (key.isascii() and key.isdigit()) or len(key) > 10 or int(key) > UINT32_MAX:
            raise invalid("logit_bias keys must be token ids", "logit_bias")
        token = int(key)
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise invalid("logit_bias values must be numbers in [-100, 100]", "logit_bias")
        out.append((token, float(bias)))
    return tuple(out)


def _n_and_best_of(b: _Body, limits: Limits, stream: bool) -> tuple[int, int | None]:
    best_of = b.integer("best_of", "best_of is not an integer")
    if best_of is not None:
        if best_of <= 0:
            raise invalid("best_of value should be greater than 0", "best_of")
        if best_of > limits.best_of:
            raise invalid(f"best_of exceeds limit provided in graph config: {limits.best_of}", "best_of")
        if stream:
            raise invalid("best_of cannot be used in streaming mode", "best_of")
    n = b.integer("n", "n is not an integer")
    if n is None:
        n = 1
    if n <= 0:
        raise invalid("n value should be greater than 0", "n")
    if best_of is not None and n > best_of:
        raise invalid("n value cannot be greater than best_of", "n")
    if n > limits.n:
        raise invalid(f"n exceeds limit provided in graph config: {limits.n}", "n")
    return n, best_of


# ---------------------------------------------------------------- endpoints

def parse_completion(body: Any, limits: Limits = Limits()) -> CompletionRequest:
    b = _object(body)
    gen = _generation(b, limits)
    prompts = _prompts(b.raw("prompt"))
    echo = b.boolean("echo", "echo accepts values true or false") or False

    logprobs = b.integer("logprobs", "logprobs is not an integer")
    if logprobs is not None and not 0 <= logprobs <= limits.logprobs:
        raise invalid(f"logprobs out of range [0, {limits.logprobs}]", "logprobs")
    if gen["max_tokens"] == 0 and not echo:
        raise invalid("max_tokens value should be greater than 0 unless echo is set", "max_tokens")
    gen["logprobs"] = logprobs
    return CompletionRequest(GenerationRequest(**gen, unknown=b.unknown()), prompts, echo)


def _prompts(value: Any) -> tuple[Prompt, ...]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if value is None:
        raise invalid("prompt is missing", "prompt")
    if isinstance(value, str):
        items: list = [value]
    elif isinstance(value, list) and value and all(_is_int(t) for t in value):
        items = [value]
    elif isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        items = value
    elif isinstance(value, list) and not value:
        raise invalid("prompt is empty", "prompt")
    else:
        raise invalid("prompt is not a string, an array of strings, an array of token ids or an array of arrays "
                      "of token ids", "prompt")
    out: list[Prompt] = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise invalid("prompt is empty", "prompt")
            out.append(item)
        else:
            if not item:
                raise invalid("prompt is empty", "prompt")
            if not all(_is_int(t) and t >= 0 for t in item):
                raise invalid("prompt token ids must be non-negative integers", "prompt")
            out.append(tuple(item))
    return tuple(out)


def parse_chat(body: Any, limits: Limits = Limits()) -> ChatRequest:
    b = _object(body)
    # OpenAI renamed max_tokens to max_completion_tokens for chat; the newer name wins when both are given, and
    # both are checked (an invalid value is an error even where the other one wins).
    field_name = "max_completion_tokens" if b.data.get("max_completion_tokens") is not None else "max_tokens"
    gen = _generation(b, limits, max_tokens_field=field_name)
    for name in ("max_tokens", "max_completion_tokens"):
        if (gen["max_tokens"] if name == field_name else _max_tokens(b, limits, name)) == 0:
            raise invalid(f"{name} value should be greater than 0", name)
    messages = _messages(b.raw("messages"))

    logprobs = b.boolean("logprobs", "logprobs accepts values true or false")
    top = b.integer("top_logprobs", "top_logprobs is not an integer")
    if top is not None:
        if not 0 <= top <= limits.logprobs:
            raise invalid(f"top_logprobs out of range [0, {limits.logprobs}]", "top_logprobs")
        if not logprobs:
            raise invalid("top_logprobs requires logprobs to be true", "top_logprobs")
    gen["logprobs"] = (top or 0) if logprobs else None

    response_format = b.raw("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict) or response_format.get("type") != "text":
            raise invalid("response_format other than {\"type\": \"text\"} is not supported yet", "response_format")
    tools = b.raw("tools")
    if tools:  # silently ignoring tools would make a client wait for calls that never come
        raise invalid("tools are not supported yet", "tools")
    b.raw("tool_choice"), b.raw("parallel_tool_calls")
    return ChatRequest(GenerationRequest(**gen, unknown=b.unknown()), messages)


def _messages(value: Any) -> tuple[dict, ...]:
    """Each message: an object with a string role; content a string, null or a list of text parts (joined)."""
    if value is None:
        raise invalid("messages missing in request", "messages")
    if not isinstance(value, list):
        raise invalid("messages is not an array", "messages")
    if not value:
        raise invalid("messages array is empty", "messages")
    out = []
    for message in value:
        if not isinstance(message, dict):
            raise invalid("message is not an object", "messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise invalid("message role is missing or not a string", "messages")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise invalid("only text content parts are supported", "messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise invalid("message content is not a string or an array of text parts", "messages")
        out.append({**message, "content": content if content is not None else ""})
    return tuple(out)


def parse_tokenize(body: Any) -> TokenizeRequest:
    b = _object(body)
    model = _model(b)
    prompt = b.raw("prompt")
    if prompt is None:
        raise invalid("prompt is missing", "prompt")
    if isinstance(prompt, str):
        return TokenizeRequest(model, (prompt,), batched=False)
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return TokenizeRequest(model, tuple(prompt), batched=True)
    raise invalid("prompt is not a string or array of strings", "prompt")


# ---------------------------------------------------------------- defaults

def sampling_params(gen: GenerationRequest, defaults: dict) -> SamplingParams:
    """Request values, else the model's generation_config.json, else OVMS's built-ins.

    generation_config.json only makes sampling the default when it says `do_sample: true` (as in Hugging Face);
    a request with temperature > 0 samples, and without a top_k from request or model gets OVMS's top_k = 40.
    """
    def pick(value, key: str, builtin):
        if value is not None:
            return value
        return defaults[key] if defaults.get(key) is not None else builtin

    temperature = gen.temperature
    if temperature is None:
        temperature = float(defaults.get("temperature", 1.0)) if defaults.get("do_sample") else 0.0
    top_k = pick(gen.top_k, "top_k", None)
    beam = gen.best_of is not None and gen.best_of > 1
    if top_k is None or top_k == 0:   # HF writes top_k 0 for "disabled"
        top_k = OVMS_DEFAULT_TOP_K if temperature > 0 and top_k is None else -1
    return SamplingParams(
        max_tokens=gen.max_tokens,
        temperature=float(temperature),
        top_p=float(pick(gen.top_p, "top_p", 1.0)),
        top_k=int(top_k),
        min_p=float(pick(gen.min_p, "min_p", 0.0)),
        repetition_penalty=float(pick(gen.repetition_penalty, "repetition_penalty", 1.0)),
        frequency_penalty=gen.frequency_penalty or 0.0,
        presence_penalty=gen.presence_penalty or 0.0,
        logit_bias=dict(gen.logit_bias),
        seed=gen.seed,
        stop=list(gen.stop),
        stop_token_ids=list(gen.stop_token_ids),
        include_stop_str_in_output=gen.stream if gen.include_stop_str_in_output is None
        else gen.include_stop_str_in_output,
        ignore_eos=bool(gen.ignore_eos),
        min_tokens=int(pick(gen.min_tokens, "min_new_tokens", 0)),
        logprobs=gen.logprobs,
        skip_special_tokens=True if gen.skip_special_tokens is None else gen.skip_special_tokens,
        n=gen.n if beam else 1,   # sampling: the n choices are submitted together (Engine.submit_prompts)
        best_of=gen.best_of if beam else None,   # beam search: one search returns the n best of best_of beams
        length_penalty=float(pick(gen.length_penalty, "length_penalty", 1.0)),
    )
