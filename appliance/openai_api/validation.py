"""Request bodies -> typed, validated requests, once, at the edge. Nothing downstream re-checks them.

Rules and messages follow OVMS (see docs/serving.md); where the appliance goes further (logprobs 0..20 and in
streaming, prompt lists and token ids, n > 1) the messages keep OVMS's style. A JSON null means "not set" for
every optional field. Unknown fields are accepted and reported in `unknown` (the app logs them at debug).

Every bound comes from `appliance.limits.Limits`, and every bad input is a 400 here, never an exception further
down: one walk over the parsed body refuses strings that are not valid Unicode (a lone surrogate would fail in the
tokenizer, engine-side) and nesting deeper than `Limits.depth`; numbers too large for a float are refused as
numbers; chat messages keep only the fields a chat template may use, each of a known type.

Which fields there are, their types, bounds and messages are declared in appliance/openai_api/fields.py (which also
writes docs/openapi.json's request schemas); this module walks those tables (`_read`), parses the structured fields
(`PARSERS`; those of structured output, tools and the Friendli / Cerebras parameters are in parsers.py) and keeps the
rules across fields as code (`_generation`, the endpoint parsers, `_friendli`, `_check_queue`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from appliance.limits import Limits
from appliance.openai_api import fields as F
from appliance.openai_api import parsers as P
from appliance.openai_api.errors import invalid
from appliance.params import Grammar, SamplingParams

__all__ = [
    "Limits",
    "GenerationRequest",
    "CompletionRequest",
    "ChatRequest",
    "TokenizeRequest",
    "parse_completion",
    "parse_chat",
    "parse_tokenize",
    "sampling_params",
]

UINT32_MAX = F.UINT32_MAX
OVMS_DEFAULT_TOP_K = 40  # OVMS: sampling with no top_k given
Prompt = str | tuple[int, ...]  # text or token ids
_TOKEN_ID = re.compile(F.TOKEN_ID_PATTERN)
MESSAGE_STRINGS = ("name", "tool_call_id")  # message fields passed to the chat template besides role/content
Parser = Callable[[Any, Limits, dict], Any]  # a custom field's check: (value, limits, fields read so far) -> value


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
    logprobs: int | None = None  # None: off; k: chosen token + k alternatives
    n: int = 1
    timeout: float | None = None  # seconds; past it the request is cancelled and answered 429
    unknown: tuple[str, ...] = ()
    best_of: int | None = None  # > 1: beam search with best_of beams, the n best returned
    # structured output (response_format, Cerebras grammar_root); chat's tool_choice required / named makes its own
    grammar: Grammar | None = None
    # Friendli / Cerebras parameters (docs/serving.md "Parameters of other APIs"); SamplingParams says what each is
    bad_words: tuple[str, ...] = ()
    bad_word_tokens: tuple[tuple[int, ...], ...] = ()
    no_repeat_ngram: int | None = None
    stop_token_sequences: tuple[tuple[int, ...], ...] = ()
    max_total_tokens: int | None = None
    min_total_tokens: int | None = None
    min_tokens_to_limit: bool = False  # Cerebras min_tokens: -1
    early_stopping: bool | None = None
    seeds: tuple[int, ...] | None = None  # Friendli: one seed per choice (len n)
    return_raw_tokens: bool = False  # Cerebras: each choice also carries its token ids (`tokens`)
    # speculative decoding (OVMS's names) and OpenAI's Predicted Outputs (`prediction.content`); SamplingParams
    num_assistant_tokens: int | None = None
    assistant_confidence_threshold: float | None = None
    max_ngram_size: int | None = None
    prediction: str | None = None


@dataclass(frozen=True)
class CompletionRequest:
    gen: GenerationRequest
    prompts: tuple[Prompt, ...]
    echo: bool = False


ToolChoice = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ChatRequest:
    gen: GenerationRequest
    messages: tuple[dict, ...]
    # each {"type": "function", "function": {"name", "description"?, "parameters"?: JSON schema, "strict"?}}
    tools: tuple[dict, ...] = ()
    tool_choice: ToolChoice = "auto"  # "auto" when tools are given and tool_choice is not
    tool_name: str | None = None  # tool_choice "named": the function that must be called
    parallel_tool_calls: bool = True


@dataclass(frozen=True)
class TokenizeRequest:
    model: str
    prompts: tuple[str, ...]
    batched: bool  # prompt was a list: answer a list of lists


# ---------------------------------------------------------------- field readers


@dataclass
class _Body:
    """A JSON object; null reads as absent; remembers which fields were read (the rest are `unknown`)."""

    data: dict
    seen: set = field(default_factory=set)

    def raw(self, name: str) -> Any:
        self.seen.add(name)
        return self.data.get(name)

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
                    raise invalid(
                        f"{name} contains a string that is not valid Unicode (a lone surrogate)", name
                    ) from None
            elif isinstance(item, (dict, list)):
                if depth > max_depth:
                    raise invalid(f"{name} nests objects and arrays deeper than {max_depth} levels", name)
                if isinstance(item, dict):
                    stack.extend((k, depth + 1) for k in item)
                    stack.extend((v, depth + 1) for v in item.values())
                else:
                    stack.extend((v, depth + 1) for v in item)


# ---------------------------------------------------------------- the table walk


def _read(b: _Body, table: tuple[F.Field, ...], limits: Limits, parsers: dict[str, Parser]) -> dict[str, Any]:
    """Every field of `table`, in its order, checked alone (custom ones by `parsers`): name -> value (None: not
    set)."""
    out: dict[str, Any] = {}
    for f in table:
        value = b.raw(f.name)
        if value is None:
            if f.required:
                raise invalid(f.required, f.name)
            out[f.name] = None
        elif f.kind == "custom":
            out[f.name] = parsers[f.name](value, limits, out)
        else:
            out[f.name] = _scalar(f, value, limits)
    return out


def _scalar(f: F.Field, value: Any, limits: Limits) -> Any:
    """A boolean, string, integer or number field's value, checked against its type and bounds in their order."""
    if f.kind == "any":
        return value
    if f.kind == "number":
        value = _finite(value)
        ok = value is not None
    else:
        ok = (
            isinstance(value, bool)
            if f.kind == "boolean"
            else isinstance(value, str)
            if f.kind == "string"
            else _is_int(value)
        )
    if not ok:
        raise invalid(f.text(f.message, limits), f.name)
    if value in f.also:  # top_k: -1
        return value
    for bound in f.bounds:
        edge = bound.resolve(limits)
        if edge is None:
            continue
        outside = value < edge if bound.side == "min" else value > edge
        if outside or (bound.exclusive and value == edge):
            raise invalid(f.text(bound.message or f.message, limits), f.name)
    return value


# ---------------------------------------------------------------- shared rules

_PLAIN = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "length_penalty",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "timeout",
    "num_assistant_tokens",
    "assistant_confidence_threshold",
    "max_ngram_size",
    "prediction",
)  # read fields passed on as they are


def _generation(values: dict[str, Any], *, max_tokens: int | None) -> dict:
    """GenerationRequest's keyword arguments from the fields read, once the rules across fields hold (the
    endpoint-specific ones are checked by callers)."""
    stream = bool(values["stream"])
    if values["include_stop_str_in_output"] is False and stream:
        raise invalid(
            "include_stop_str_in_output cannot be set to false if streaming is used", "include_stop_str_in_output"
        )
    best_of, beams = values["best_of"], "best_of"
    if values.get("num_beams") is not None:  # Friendli's name of best_of
        if best_of is not None:
            raise invalid(
                "num_beams and best_of cannot both be set (num_beams is another name of best_of)", "num_beams"
            )
        best_of, beams = values["num_beams"], "num_beams"
    if best_of is not None and stream:
        raise invalid(f"{beams} cannot be used in streaming mode", beams)
    n = 1 if values["n"] is None else values["n"]
    if best_of is not None and n > best_of:
        raise invalid(f"n value cannot be greater than {beams}", "n")
    beam = best_of is not None and best_of > 1
    grammar, grammar_param = values.get("response_format"), "response_format"
    if values.get("grammar_root") is not None:
        if grammar is not None:
            raise invalid("grammar_root and response_format cannot both constrain the output: send one", "grammar_root")
        grammar, grammar_param = values["grammar_root"], "grammar_root"
    if grammar is not None and beam:
        raise invalid(
            f"structured output ({grammar_param}) cannot be combined with beam search ({beams} {best_of}): "
            "use n for several choices",
            grammar_param,
        )
    if values["num_assistant_tokens"] is not None and values["assistant_confidence_threshold"] is not None:
        raise invalid(  # OVMS: one sets how many tokens to draft, the other when to stop drafting
            "num_assistant_tokens and assistant_confidence_threshold are mutually exclusive and cannot both be set.",
            "assistant_confidence_threshold",
        )
    if values.get("early_stopping") and not beam:
        raise invalid("early_stopping needs beam search (num_beams or best_of above 1)", "early_stopping")
    min_tokens = values["min_tokens"]
    return {
        "model": values["model"],
        "stream": stream,
        "include_usage": bool(values["stream_options"]),
        "max_tokens": max_tokens,
        "stop": values["stop"] or (),
        "stop_token_ids": values["stop_token_ids"] or (),
        "logit_bias": values["logit_bias"] or (),
        "n": n,
        "best_of": best_of,
        "grammar": grammar,
        "early_stopping": values.get("early_stopping"),
        **{name: values[name] for name in _PLAIN},
        "min_tokens": None if min_tokens == -1 else min_tokens,
        "min_tokens_to_limit": min_tokens == -1,  # Cerebras: up to max_tokens (or the context's end)
    }


def _stream_options(options: Any, limits: Limits, read: dict) -> bool:
    """include_usage; stream_options is only for streams (OVMS checks that first)."""
    if not read["stream"]:
        raise invalid("stream_options provided, but stream not set to true", "stream_options")
    if not isinstance(options, dict):
        raise invalid("stream_options is not an object", "stream_options")
    if set(options) - {"include_usage"}:
        raise invalid(
            "Found unexpected stream options. Properties accepted in stream_options: include_usage", "stream_options"
        )
    usage = options.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise invalid("stream_options.include_usage is not a boolean", "stream_options")
    return bool(usage)


def _stop_token_ids(stop_ids: Any, limits: Limits, read: dict) -> tuple[int, ...]:
    if not isinstance(stop_ids, list) or not all(_is_int(t) and 0 <= t <= UINT32_MAX for t in stop_ids):
        raise invalid("stop_token_ids is not an array of token ids", "stop_token_ids")
    if len(stop_ids) > limits.stop_token_ids:  # each id is checked against the vocabulary engine-side
        raise invalid(f"stop_token_ids must have no more than {limits.stop_token_ids} token ids", "stop_token_ids")
    return tuple(dict.fromkeys(stop_ids))


def _stop(value: Any, limits: Limits, read: dict) -> tuple[str, ...]:
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
    return tuple(s for s in values if s)  # an empty stop string would match everywhere: it means nothing


def _logit_bias(value: Any, limits: Limits, read: dict) -> tuple[tuple[int, float], ...]:
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


# ---------------------------------------------------------------- endpoints


def _check_queue(prompts: int, gen: dict, limits: Limits) -> None:
    """n x prompts against the engine's queue before anything is built for them (choices here, sequences there):
    a request that can never fit is a 400 (a 429 would tell clients to retry what can never succeed; the engine
    answers 429 to one that fits the queue but not its current room). Called once every other rule passed."""
    beam = gen["best_of"] is not None and gen["best_of"] > 1
    places = prompts * (1 if beam else gen["n"])  # a beam search queues one sequence per prompt
    if limits.max_queued is not None and places > limits.max_queued:
        raise invalid(
            f"this request needs {places} queue places (prompts x n), more than the {limits.max_queued} "
            "the server has; send fewer prompts or a smaller n",
            "n",
        )


def parse_completion(body: Any, limits: Limits = Limits()) -> CompletionRequest:
    b = _object(body, limits)
    values = _read(b, F.COMPLETION, limits, {**PARSERS, **COMPLETION_PARSERS})
    seed = values["seed"]
    values["seed"] = seed if isinstance(seed, int) else None
    gen = _generation(values, max_tokens=values["max_tokens"])
    prompts, echo = values["prompt"], bool(values["echo"])
    if values["tokens"] is not None:
        if prompts is not None:
            raise invalid("prompt and tokens cannot both be set (tokens is the prompt as token ids)", "tokens")
        prompts = (values["tokens"],)
    if prompts is None:
        raise invalid("prompt is missing", "prompt")
    if gen["max_tokens"] == 0 and not echo:
        raise invalid("max_tokens value should be greater than 0 unless echo is set", "max_tokens")
    if isinstance(seed, tuple):
        if len(seed) != gen["n"]:
            raise invalid(f"a seed list needs one seed per choice: n is {gen['n']}, the list has {len(seed)}", "seed")
        gen["seeds"] = seed
    gen.update(_friendli(values, gen, limits))
    gen["logprobs"] = values["logprobs"]
    if gen["logprobs"] is None and values["include_output_logprobs"]:
        gen["logprobs"] = 0  # Friendli: the chosen tokens' logprobs
    gen["return_raw_tokens"] = bool(values["return_raw_tokens"])
    _check_queue(len(prompts), gen, limits)  # last: an invalid request is a 400 whatever its size
    return CompletionRequest(GenerationRequest(**gen, unknown=b.unknown()), prompts, echo)


def _friendli(values: dict[str, Any], gen: dict, limits: Limits) -> dict:
    """Friendli's completions fields -> GenerationRequest's keyword arguments, once the rules across them hold."""
    total, least = values["max_total_tokens"], values["min_total_tokens"]
    if total is not None and gen["max_tokens"] is not None:
        raise invalid("max_tokens and max_total_tokens cannot both be set", "max_total_tokens")
    if total is not None and least is not None and least > total:
        raise invalid("min_total_tokens cannot be greater than max_total_tokens", "min_total_tokens")
    words, word_tokens = values["bad_words"] or (), values["bad_word_tokens"] or ()
    if len(words) + len(word_tokens) > limits.bad_words:
        raise invalid(
            f"bad_words and bad_word_tokens must have no more than {limits.bad_words} entries together",
            "bad_words",
        )
    stops = values["stop_tokens"] or ()
    singles = tuple(ids[0] for ids in stops if len(ids) == 1)
    return {
        "stop_token_ids": tuple(dict.fromkeys((*gen["stop_token_ids"], *singles))),
        "stop_token_sequences": tuple(ids for ids in stops if len(ids) > 1),
        "bad_words": words,
        "bad_word_tokens": word_tokens,
        "no_repeat_ngram": values["no_repeat_ngram"],
        "max_total_tokens": total,
        "min_total_tokens": least,
    }


def _prompts(value: Any, limits: Limits, read: dict) -> tuple[Prompt, ...]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids (at most limits.prompts)."""
    if isinstance(value, str):
        items: list = [value]
    elif isinstance(value, list) and value and all(_is_int(t) for t in value):
        items = [value]
    elif isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        items = value
    elif isinstance(value, list) and not value:
        raise invalid("prompt is empty", "prompt")
    else:
        raise invalid(
            "prompt is not a string, an array of strings, an array of token ids or an array of arrays of token ids",
            "prompt",
        )
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
    values = _read(b, F.CHAT, limits, PARSERS)
    # OpenAI renamed max_tokens to max_completion_tokens for chat; the newer name wins when both are given (both
    # are checked: an invalid value is an error even where the other one wins).
    newer = values["max_completion_tokens"]
    gen = _generation(values, max_tokens=values["max_tokens"] if newer is None else newer)
    logprobs, top = values["logprobs"], values["top_logprobs"]
    if top is not None and not logprobs:
        raise invalid("top_logprobs requires logprobs to be true", "top_logprobs")
    gen["logprobs"] = (top or 0) if logprobs else None
    tools = values["tools"] or ()
    choice: ToolChoice
    choice, name = values["tool_choice"] or ("auto", None)
    if values["tool_choice"] is not None and not tools:
        raise invalid("tool_choice is only allowed when tools are specified", "tool_choice")
    if name is not None and name not in {t["function"]["name"] for t in tools}:
        raise invalid(f"tool_choice names function {name!r}, which is not one of tools", "tool_choice")
    if gen["grammar"] is not None and choice in ("required", "named"):
        raise invalid(
            f"response_format cannot constrain the output together with tool_choice {choice!r} (which constrains "
            "it to tool calls): send one",
            "response_format",
        )
    _check_queue(1, gen, limits)
    return ChatRequest(
        GenerationRequest(**gen, unknown=b.unknown()),
        values["messages"],
        tools=tools,
        tool_choice=choice,
        tool_name=name,
        parallel_tool_calls=values["parallel_tool_calls"] is not False,
    )


def _messages(value: Any, limits: Limits, read: dict) -> tuple[dict, ...]:
    """Each message: an object with a string role; content a string, null or a list of text parts (joined).
    Only what a chat template may use goes on: role, content, name and tool_call_id (strings), tool_calls (an
    array of objects); other fields are dropped, so nothing unbounded reaches the template or the pickler."""
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
        kept: dict[str, Any] = {"role": role, "content": content if content is not None else ""}
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
    values = _read(_object(body, limits), F.TOKENIZE, limits, {"prompt": _tokenize_prompt})
    prompts, batched = values["prompt"]
    return TokenizeRequest(values["model"], prompts, batched=batched)


def _tokenize_prompt(prompt: Any, limits: Limits, read: dict) -> tuple[tuple[str, ...], bool]:
    """(prompts, batched): a string, or a list of strings (answered as a list of lists)."""
    if isinstance(prompt, str):
        return (prompt,), False
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        if len(prompt) > limits.prompts:
            raise invalid(f"prompt array must have no more than {limits.prompts} prompts", "prompt")
        return tuple(prompt), True
    raise invalid("prompt is not a string or array of strings", "prompt")


# custom fields (fields.py) -> their parser (completions and /tokenize add their own "prompt")
PARSERS: dict[str, Parser] = {
    "stream_options": _stream_options,
    "stop": _stop,
    "stop_token_ids": _stop_token_ids,
    "logit_bias": _logit_bias,
    "messages": _messages,
    "response_format": P.response_format,
    "tools": P.tools,
    "tool_choice": P.tool_choice,
    "prediction": P.prediction,
}
COMPLETION_PARSERS: dict[str, Parser] = {
    "prompt": _prompts,
    "seed": P.seeds,
    "tokens": P.tokens,
    "grammar_root": P.grammar_root,
    "stop_tokens": P.token_lists("stop_tokens", "stop_token_ids"),
    "bad_word_tokens": P.token_lists("bad_word_tokens", "bad_words"),
    "bad_words": P.bad_words,
}


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
    if top_k is None or top_k == 0:  # HF writes top_k 0 for "disabled"
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
        include_stop_str_in_output=gen.stream
        if gen.include_stop_str_in_output is None
        else gen.include_stop_str_in_output,
        ignore_eos=bool(gen.ignore_eos),
        min_tokens=int(pick(gen.min_tokens, "min_new_tokens", 0)),
        logprobs=gen.logprobs,
        skip_special_tokens=True if gen.skip_special_tokens is None else gen.skip_special_tokens,
        n=gen.n if beam else 1,  # sampling: the n choices are submitted together (Engine.submit_prompts)
        best_of=gen.best_of if beam else None,  # beam search: one search returns the n best of best_of beams
        length_penalty=float(pick(gen.length_penalty, "length_penalty", 1.0)),
        grammar=gen.grammar,
        bad_words=list(gen.bad_words),
        bad_word_tokens=[list(ids) for ids in gen.bad_word_tokens],
        no_repeat_ngram=gen.no_repeat_ngram if gen.no_repeat_ngram and gen.no_repeat_ngram > 1 else 0,
        stop_token_sequences=[list(ids) for ids in gen.stop_token_sequences],
        max_total_tokens=gen.max_total_tokens,
        min_total_tokens=gen.min_total_tokens,
        min_tokens_to_limit=gen.min_tokens_to_limit,
        early_stopping=bool(gen.early_stopping),
        num_assistant_tokens=gen.num_assistant_tokens,
        assistant_confidence_threshold=gen.assistant_confidence_threshold,
        max_ngram_size=gen.max_ngram_size,
        prediction=gen.prediction,
    )
