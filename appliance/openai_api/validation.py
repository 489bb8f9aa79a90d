"""Request bodies -> typed, validated requests, once, at the edge. Nothing downstream re-checks them.

Rules and messages follow OVMS (see docs/serving.md); where the appliance goes further (logprobs 0..20 and in
streaming, prompt lists and token ids, n > 1) the messages keep OVMS's style. A JSON null means "not set" for
every optional field. Unknown fields are accepted and reported in `unknown` (the app logs them at debug).

Every bound comes from `appliance.limits.Limits`, and every bad input is a 400 here, never an exception further
down: one walk over the parsed body refuses strings that are not valid Unicode (a lone surrogate would fail in the
tokenizer, engine-side) and nesting deeper than `Limits.depth`; numbers too large for a float are refused as
numbers; chat messages keep only the fields a chat template may use, each of a known type.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from appliance.limits import Limits
from appliance.openai_api.errors import invalid
from appliance.params import SamplingParams

__all__ = ["Limits", "GenerationRequest", "CompletionRequest", "ChatRequest", "TokenizeRequest", "parse_completion",
           "parse_chat", "parse_tokenize", "sampling_params"]

UINT32_MAX = 4294967295
OVMS_DEFAULT_TOP_K = 40          # OVMS: sampling with no top_k given
Prompt = str | tuple[int, ...]   # text or token ids
_TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,9}")   # canonical decimal: "01", "+1", " 1", "1_0" name no token
MESSAGE_STRINGS = ("name", "tool_call_id")    # message fields passed to the chat template besides role/content


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

    def integer(self, name: str, message: str, *, low: int | None = None, high: int | None = None) -> int | None:
        """An integer (not a bool, not 2.0); with low/high, out of [low, high] gets the same message."""
        value = self.raw(name)
        if value is not None and (not _is_int(value) or (low is not None and value < low)
                                  or (high is not None and value > high)):
            raise invalid(message, name)
        return value

    def number(self, name: str, message: str | None = None) -> float | None:
        raw = self.raw(name)
        if raw is None:
            return None
        value = _finite(raw)
        if value is None:
            raise invalid(message or f"{name} is not a valid number", name)
        return value

    def in_range(self, name: str, low: float, high: float, message: str, *, open_high: bool = False) -> float | None:
        value = self.number(name)
        if value is not None and not (low <= value < high if open_high else low <= value <= high):
            raise invalid(message, name)
        return value

    def unknown(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.data) - self.seen))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: Any) -> float | None:
    """A JSON number as a finite float, else None (a string, a bool, NaN, infinity, or an integer too large for a
    float: float(10**400) raises OverflowError, as math.isfinite(10**400) does)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _object(body: Any, limits: Limits) -> _Body:
    if not isinstance(body, dict):
        raise invalid("Received json is not an object")
    _check_tree(body, limits.depth)
    return _Body(body)


def _check_tree(body: dict, max_depth: int) -> None:
    """One walk over the parsed body (iterative: no recursion to exhaust): every string, keys included, must encode
    as UTF-8 (JSON's \\ud800 escapes decode to lone surrogates, which no tokenizer takes), and objects and arrays
    nest at most `max_depth` deep (the body itself is level 1). The error names the top-level field at fault."""
    for name, value in body.items():
        stack = [(name, 2), (value, 2)]
        while stack:
            item, depth = stack.pop()
            if isinstance(item, str):
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    raise invalid(f"{name} contains a string that is not valid Unicode (a lone surrogate)",
                                  name) from None
            elif isinstance(item, (dict, list)):
                if depth > max_depth:
                    raise invalid(f"{name} nests objects and arrays deeper than {max_depth} levels", name)
                if isinstance(item, dict):
                    stack.extend((k, depth + 1) for k in item)
                    stack.extend((v, depth + 1) for v in item.values())
                else:
                    stack.extend((v, depth + 1) for v in item)


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

    pen = limits.penalty
    for name in ("frequency_penalty", "presence_penalty"):
        out[name] = b.in_range(name, -pen, pen, f"{name} out of range({-pen}, {pen})")
    out["repetition_penalty"] = b.number("repetition_penalty")
    if out["repetition_penalty"] is not None and out["repetition_penalty"] <= 0:
        raise invalid("repetition_penalty must be greater than 0", "repetition_penalty")
    if out["repetition_penalty"] is not None and out["repetition_penalty"] > limits.repetition_penalty:
        raise invalid(f"repetition_penalty out of range(0.0, {limits.repetition_penalty}]", "repetition_penalty")
    lp = limits.length_penalty
    out["length_penalty"] = b.in_range("length_penalty", -lp, lp, f"length_penalty out of range({-lp}, {lp})")
    out["temperature"] = b.in_range("temperature", 0.0, limits.temperature,
                                    f"temperature out of range(0.0, {limits.temperature})")
    out["top_p"] = b.in_range("top_p", 0.0, 1.0, "top_p out of range(0.0, 1.0)")
    out["min_p"] = b.in_range("min_p", 0.0, 1.0, "min_p out of range [0.0, 1.0)", open_high=True)

    top_k = b.integer("top_k", "top_k is not an integer")
    if top_k is not None and (top_k != -1 and top_k <= 0 or top_k > UINT32_MAX):
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
        if len(stop_ids) > limits.stop_token_ids:   # each id is checked against the vocabulary engine-side
            raise invalid(f"stop_token_ids must have no more than {limits.stop_token_ids} token ids",
                          "stop_token_ids")
        out["stop_token_ids"] = tuple(dict.fromkeys(stop_ids))

    out["min_tokens"] = b.integer("min_tokens", "min_tokens is not an unsigned integer", low=0, high=UINT32_MAX)

    out["logit_bias"] = _logit_bias(b.raw("logit_bias"), limits)

    timeout = b.number("timeout", "timeout must be a positive number of seconds")
    if timeout is not None and timeout <= 0:
        raise invalid("timeout must be a positive number of seconds", "timeout")
    if timeout is not None and timeout > limits.timeout:
        raise invalid(f"timeout must be at most {limits.timeout:g} seconds", "timeout")
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
    if any(len(s) > limits.stop_chars for s in values):
        raise invalid(f"stop strings must be at most {limits.stop_chars} characters long", "stop")
    return tuple(s for s in values if s)   # an empty stop string would match everywhere: it means nothing


def _logit_bias(value: Any, limits: Limits) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid("logit_bias is not an object", "logit_bias")
    if len(value) > limits.logit_bias:
        raise invalid(f"logit_bias must have no more than {limits.logit_bias} entries", "logit_bias")
    out = []
    for key, bias in value.items():
        # Canonical decimal only: int() would also take " 5", "+5", "1_0", "05" and other scripts' digits, and
        # "1" and "01" would then be two entries for one token. Bounded: the engine keeps token ids in int64 arrays.
        if not _TOKEN_ID.fullmatch(key) or int(key) > UINT32_MAX:
            raise invalid("logit_bias keys must be token ids", "logit_bias")
        bias = _finite(bias)
        if bias is None or not -100 <= bias <= 100:
            raise invalid("logit_bias values must be numbers in [-100, 100]", "logit_bias")
        out.append((int(key), bias))
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

def _check_queue(prompts: int, gen: dict, limits: Limits) -> None:
    """n x prompts against the engine's queue before anything is built for them (choices here, sequences there):
    a request that can never fit is a 400 (a 429 would tell clients to retry what can never succeed; the engine
    answers 429 to one that fits the queue but not its current room). Called once every other rule passed."""
    beam = gen["best_of"] is not None and gen["best_of"] > 1
    places = prompts * (1 if beam else gen["n"])   # a beam search queues one sequence per prompt
    if limits.max_queued is not None and places > limits.max_queued:
        raise invalid(f"this request needs {places} queue places (prompts x n), more than the {limits.max_queued} "
                      "the server has; send fewer prompts or a smaller n", "n")


def parse_completion(body: Any, limits: Limits = Limits()) -> CompletionRequest:
    b = _object(body, limits)
    gen = _generation(b, limits)
    prompts = _prompts(b.raw("prompt"), limits)
    echo = b.boolean("echo", "echo accepts values true or false") or False

    logprobs = b.integer("logprobs", "logprobs is not an integer")
    if logprobs is not None and not 0 <= logprobs <= limits.logprobs:
        raise invalid(f"logprobs out of range [0, {limits.logprobs}]", "logprobs")
    if gen["max_tokens"] == 0 and not echo:
        raise invalid("max_tokens value should be greater than 0 unless echo is set", "max_tokens")
    gen["logprobs"] = logprobs
    _check_queue(len(prompts), gen, limits)   # last: an invalid request is a 400 whatever its size
    return CompletionRequest(GenerationRequest(**gen, unknown=b.unknown()), prompts, echo)


def _prompts(value: Any, limits: Limits) -> tuple[Prompt, ...]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids (at most limits.prompts)."""
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
    if len(items) > limits.prompts:
        raise invalid(f"prompt array must have no more than {limits.prompts} prompts", "prompt")
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
    b = _object(body, limits)
    # OpenAI renamed max_tokens to max_completion_tokens for chat; the newer name wins when both are given, and
    # both are checked (an invalid value is an error even where the other one wins).
    field_name = "max_completion_tokens" if b.data.get("max_completion_tokens") is not None else "max_tokens"
    gen = _generation(b, limits, max_tokens_field=field_name)
    for name in ("max_tokens", "max_completion_tokens"):
        if (gen["max_tokens"] if name == field_name else _max_tokens(b, limits, name)) == 0:
            raise invalid(f"{name} value should be greater than 0", name)
    messages = _messages(b.raw("messages"), limits)

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
    _check_queue(1, gen, limits)
    return ChatRequest(GenerationRequest(**gen, unknown=b.unknown()), messages)


def _messages(value: Any, limits: Limits) -> tuple[dict, ...]:
    """Each message: an object with a string role; content a string, null or a list of text parts (joined).
    Only what a chat template may use goes on: role, content, name and tool_call_id (strings), tool_calls (an
    array of objects); other fields are dropped, so nothing unbounded reaches the template or the pickler."""
    if value is None:
        raise invalid("messages missing in request", "messages")
    if not isinstance(value, list):
        raise invalid("messages is not an array", "messages")
    if not value:
        raise invalid("messages array is empty", "messages")
    if len(value) > limits.messages:
        raise invalid(f"messages array must have no more than {limits.messages} messages", "messages")
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
        kept = {"role": role, "content": content if content is not None else ""}
        for name in MESSAGE_STRINGS:
            if message.get(name) is not None:
                if not isinstance(message[name], str):
                    raise invalid(f"message {name} is not a string", "messages")
                kept[name] = message[name]
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            if not isinstance(tool_calls, list) or not all(isinstance(c, dict) for c in tool_calls):
                raise invalid("message tool_calls is not an array of objects", "messages")
            kept["tool_calls"] = tool_calls
        out.append(kept)
    return tuple(out)


def parse_tokenize(body: Any, limits: Limits = Limits()) -> TokenizeRequest:
    b = _object(body, limits)
    model = _model(b)
    prompt = b.raw("prompt")
    if prompt is None:
        raise invalid("prompt is missing", "prompt")
    if isinstance(prompt, str):
        return TokenizeRequest(model, (prompt,), batched=False)
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        if len(prompt) > limits.prompts:
            raise invalid(f"prompt array must have no more than {limits.prompts} prompts", "prompt")
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
