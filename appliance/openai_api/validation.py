"""Request bodies -> typed, validated requests, once, at the edge. Nothing downstream re-checks them.

Rules and messages follow OVMS (see docs/serving.md); where the appliance goes further (logprobs 0..20 and in
streaming, prompt lists and token ids, n > 1) the messages keep OVMS's style. A JSON null means "not set" for
every optional field. Unknown fields are accepted and reported in `unknown` (the app logs them at debug).

Every bound comes from `appliance.limits.Limits`, and every bad input is a 400 here, never an exception further
down: one walk over the parsed body refuses strings that are not valid Unicode (a lone surrogate would fail in the
tokenizer, engine-side) and nesting deeper than `Limits.depth`; numbers too large for a float are refused as
numbers; chat messages keep only the fields a chat template may use, each of a known type.

Which fields there are, their types, bounds, messages, parsers and the `SamplingParams` attribute each sets are
declared in appliance/openai_api/fields.py (which also writes docs/openapi.json's request schemas); this module walks
those tables (`read_body`) and keeps the rules across fields that completions and chat share (`generation`,
`check_queue`); each API's adapter (completions.py, chat.py) adds its own and builds its request, so adding an API
is adding a module. A generation request comes out as `EdgeOptions` (what the app reads) and `sampling`, the set
values by `SamplingParams` attribute; appliance/openai_api/sampling.py adds the model's defaults and builds the
`SamplingParams`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from appliance.limits import Limits
from appliance.openai_api import fields as F
from appliance.openai_api.errors import invalid
from appliance.openai_api.parsers import finite, is_int

__all__ = [
    "Limits",
    "Dialect",
    "OVMS",
    "OPENAI",
    "EdgeOptions",
    "TokenizeRequest",
    "read_body",
    "generation",
    "check_queue",
    "parse_tokenize",
]


@dataclass(frozen=True)
class Dialect:
    """Whose defaults a request gets where OVMS (the reference of `/v3`) and OpenAI (of `/v1`) differ: the app's
    route table gives each prefix one, and the request is built with it.

    `stream_keeps_stop`: the default of `include_stop_str_in_output` in a stream (unary answers leave the stop
    string out on both). OVMS streams it; OpenAI never returns a stop string, so clients written for OpenAI (the
    `openai` SDK under LangChain's `ChatOpenAI.stream(stop=...)`, ...) would show it."""

    name: str
    stream_keeps_stop: bool


OVMS = Dialect("ovms", stream_keeps_stop=True)
OPENAI = Dialect("openai", stream_keeps_stop=False)


@dataclass(frozen=True)
class EdgeOptions:
    """What the app itself reads of a generation request (the rest is `sampling`, for the engine)."""

    model: str
    stream: bool = False
    include_usage: bool = False
    timeout: float | None = None  # seconds; past it the request is cancelled and answered 429
    n: int = 1  # choices per prompt (sampling: n sequences; beam search: SamplingParams.n of one search)
    seeds: tuple[int, ...] | None = None  # Friendli: one seed per choice (len n)
    return_raw_tokens: bool = False  # Cerebras: each choice also carries its token ids (`tokens`)
    unknown: tuple[str, ...] = ()


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


def _read(b: _Body, table: tuple[F.Field, ...], limits: Limits) -> dict[str, Any]:
    """Every field of `table`, in its order, checked alone (custom ones by their parser): name -> value (None: not
    set)."""
    out: dict[str, Any] = {}
    for f in table:
        value = b.raw(f.name)
        if value is None:
            if f.required:
                raise invalid(f.required, f.name)
            out[f.name] = None
        elif f.parse is not None:
            out[f.name] = f.parse(value, limits, out)
        else:
            out[f.name] = _scalar(f, value, limits)
    return out


def _scalar(f: F.Field, value: Any, limits: Limits) -> Any:
    """A boolean, string, integer or number field's value, checked against its type and bounds in their order."""
    if f.kind == "any":
        return value
    if f.kind == "number":
        value = finite(value)
        ok = value is not None
    else:
        ok = (
            isinstance(value, bool)
            if f.kind == "boolean"
            else isinstance(value, str)
            if f.kind == "string"
            else is_int(value)
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


def read_body(body: Any, table: tuple[F.Field, ...], limits: Limits) -> tuple[dict[str, Any], tuple[str, ...]]:
    """A JSON body's fields of `table`, each checked alone (name -> value, None: not set), and the names of its
    other fields (`unknown`)."""
    b = _object(body, limits)
    values = _read(b, table, limits)
    return values, b.unknown()


# ---------------------------------------------------------------- shared rules


def _sampling(values: dict[str, Any], table: tuple[F.Field, ...]) -> dict[str, Any]:
    """The set values of the fields that set a SamplingParams attribute (`Field.param`), by attribute; where two
    fields set one attribute, the later in the table wins (chat's max_completion_tokens over max_tokens) unless a
    rule refused both."""
    return {f.param: values[f.name] for f in table if f.param is not None and values[f.name] is not None}


def generation(values: dict[str, Any], table: tuple[F.Field, ...], dialect: Dialect = OVMS) -> tuple[dict, dict]:
    """(EdgeOptions' keyword arguments, the sampling values) from the fields read, once the rules across fields
    hold (the endpoint-specific ones are checked by callers); unset fields whose default differs by API get
    `dialect`'s."""
    stream = bool(values["stream"])
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
    sampling = _sampling(values, table)
    if not beam:  # sampling: the n choices are n sequences (Engine.submit_prompts); beam search: one search's n best
        sampling.pop("n", None)
        sampling.pop("best_of", None)
    if values["min_tokens"] == -1:  # Cerebras: up to max_tokens (or the context's end)
        del sampling["min_tokens"]
        sampling["min_tokens_to_limit"] = True
    sampling.setdefault("include_stop_str_in_output", stream and dialect.stream_keeps_stop)
    edge = {
        "model": values["model"],
        "stream": stream,
        "include_usage": bool(values["stream_options"]),
        "timeout": values["timeout"],
        "n": n,
    }
    return edge, sampling


def check_queue(prompts: int, n: int, sampling: dict, limits: Limits) -> None:
    """n x prompts against the engine's queue before anything is built for them (choices here, sequences there):
    a request that can never fit is a 400 (a 429 would tell clients to retry what can never succeed; the engine
    answers 429 to one that fits the queue but not its current room). Called once every other rule passed."""
    places = prompts * (1 if "best_of" in sampling else n)  # a beam search queues one sequence per prompt
    if limits.max_queued is not None and places > limits.max_queued:
        raise invalid(
            f"this request needs {places} queue places (prompts x n), more than the {limits.max_queued} "
            "the server has; send fewer prompts or a smaller n",
            "n",
        )


def parse_tokenize(body: Any, limits: Limits = Limits()) -> TokenizeRequest:
    values, _ = read_body(body, F.TOKENIZE, limits)
    prompts, batched = values["prompt"]
    return TokenizeRequest(values["model"], prompts, batched=batched)
