"""OpenAI's rules across the fields of a generation request (completions and chat share them; fields.py declares
the fields themselves and appliance/api/table.py walks them): n and best_of, grammar_root and response_format,
speculation, min_tokens -1, the stop-string default of each `Dialect`, and the queue check. Rules and messages
follow OVMS (see docs/serving.md); where the appliance goes further (logprobs 0..20 and in streaming, prompt lists
and token ids, n > 1) the messages keep OVMS's style. A generation request comes out as `EdgeOptions`' keyword
arguments (what the app reads) and `sampling`, the set values by `SamplingParams` attribute;
appliance/api/sampling.py adds the model's defaults and builds the `SamplingParams`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from appliance.api.errors import invalid
from appliance.api.table import Field, read_body, sampling_values
from appliance.limits import Limits
from appliance.openai_api import fields as F

__all__ = [
    "Limits",
    "Dialect",
    "OVMS",
    "OPENAI",
    "TokenizeRequest",
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
class TokenizeRequest:
    model: str
    prompts: tuple[str, ...]
    batched: bool  # prompt was a list: answer a list of lists


# ---------------------------------------------------------------- field readers
# ---------------------------------------------------------------- shared rules


def generation(values: dict[str, Any], table: tuple[Field, ...], dialect: Dialect = OVMS) -> tuple[dict, dict]:
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
    sampling = sampling_values(values, table)
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
