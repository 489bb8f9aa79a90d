"""`/v3/completions`, the adapter of OpenAI's (and OVMS's) legacy completions API: its body -> a `CompletionRequest`
(the rules across its fields, Friendli's and Cerebras's included; the fields themselves are fields.COMPLETION), the
job it makes, and how its choices and chunks are spelled."""

from __future__ import annotations

from typing import Any

from appliance.api.errors import invalid
from appliance.api.generation import Choice
from appliance.api.request import CompletionRequest, EdgeOptions
from appliance.api.table import read_body
from appliance.limits import Limits
from appliance.openai_api import fields as F
from appliance.openai_api.validation import OVMS, Dialect, check_queue, generation
from appliance.outputs import TokenLogprob


def parse_completion(body: Any, limits: Limits = Limits(), dialect: Dialect = OVMS) -> CompletionRequest:
    values, unknown = read_body(body, F.COMPLETION, limits)
    edge, sampling = generation(values, F.COMPLETION, dialect)
    prompts, echo = values["prompt"], bool(values["echo"])
    if values["tokens"] is not None:
        if prompts is not None:
            raise invalid("prompt and tokens cannot both be set (tokens is the prompt as token ids)", "tokens")
        prompts = (values["tokens"],)
    if prompts is None:
        raise invalid("prompt is missing", "prompt")
    if sampling.get("max_tokens") == 0 and not echo:
        raise invalid("max_tokens value should be greater than 0 unless echo is set", "max_tokens")
    seed = values["seed"]
    if isinstance(seed, tuple):  # Friendli: one seed per choice
        if len(seed) != edge["n"]:
            raise invalid(f"a seed list needs one seed per choice: n is {edge['n']}, the list has {len(seed)}", "seed")
        edge["seeds"] = seed
        del sampling["seed"]
    _friendli(values, sampling, limits)
    if values["logprobs"] is None and values["include_output_logprobs"]:
        sampling["logprobs"] = 0  # Friendli: the chosen tokens' logprobs
    edge["return_raw_tokens"] = bool(values["return_raw_tokens"])
    check_queue(len(prompts), edge["n"], sampling, limits)  # last: an invalid request is a 400 whatever its size
    return CompletionRequest(EdgeOptions(**edge, unknown=unknown), sampling, prompts, echo)


def _friendli(values: dict[str, Any], sampling: dict, limits: Limits) -> None:
    """The rules across Friendli's completions fields; their values into `sampling`."""
    total, least = values["max_total_tokens"], values["min_total_tokens"]
    if total is not None and sampling.get("max_tokens") is not None:
        raise invalid("max_tokens and max_total_tokens cannot both be set", "max_total_tokens")
    if total is not None and least is not None and least > total:
        raise invalid("min_total_tokens cannot be greater than max_total_tokens", "min_total_tokens")
    words, word_tokens = values["bad_words"] or (), values["bad_word_tokens"] or ()
    if len(words) + len(word_tokens) > limits.bad_words:
        raise invalid(
            f"bad_words and bad_word_tokens must have no more than {limits.bad_words} entries together",
            "bad_words",
        )
    stops = sampling.pop("stop_token_sequences", ())  # one id: a stop token; several: a sequence
    sampling["stop_token_ids"] = tuple(
        dict.fromkeys((*sampling.get("stop_token_ids", ()), *(ids[0] for ids in stops if len(ids) == 1)))
    )
    sampling["stop_token_sequences"] = tuple(ids for ids in stops if len(ids) > 1)
    if sampling.get("no_repeat_ngram", 0) <= 1:  # 0 and 1: off
        sampling.pop("no_repeat_ngram", None)


def logprobs_object(entries: list[TokenLogprob], offset: int, prompt: list[TokenLogprob] | None = None) -> dict:
    """OpenAI's legacy completions form; text_offset counts characters from the start of the choice's text.
    `prompt`: the echoed prompt's entries, first (offsets from 0; the first token's logprob is null)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    prompt_offset = 0
    for e in prompt or ():
        tokens.append(e.token)
        token_logprobs.append(e.logprob)
        top.append({text: lp for _, text, lp in e.top} if e.logprob is not None else None)
        offsets.append(prompt_offset)
        prompt_offset += len(e.token)
    for e in entries:
        tokens.append(e.token)
        token_logprobs.append(e.logprob)
        top.append({text: lp for _, text, lp in e.top})
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


class CompletionShape:
    """Stream chunks are `text_completion` objects too, as OpenAI, vLLM and the Cerebras contract send them (OVMS
    says `text_completion.chunk`): aiperf 0.13 drops chunks of any other object and recorded every streamed
    completion as an error; with this string, 32 of 32 requests succeeded at concurrency 8."""

    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, raw_tokens: bool = False):
        self.raw_tokens = raw_tokens  # Cerebras return_raw_tokens: each choice / delta carries its token ids

    def _tokens(self, ids: list[int]) -> dict:
        return {"tokens": list(ids)} if self.raw_tokens else {}

    def choice(self, c: Choice, logprobs: bool) -> dict:
        return {
            "index": c.index,
            "text": c.text,
            "finish_reason": c.finish_reason,
            "logprobs": logprobs_object(c.logprobs, c.offset, c.prompt_logprobs) if logprobs else None,
            **self._tokens(c.token_ids),
        }

    def opening(self, c: Choice) -> dict:
        """OVMS 2026.1+: a first chunk right after prefill, with no generated text (the echo, if asked, with its
        logprobs when those were asked too)."""
        return {
            "index": c.index,
            "text": c.prefix,
            "finish_reason": None,
            "logprobs": logprobs_object([], 0, c.prompt_logprobs) if c.prompt_logprobs is not None else None,
            **self._tokens([]),
        }

    def delta(self, c: Choice, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None) -> dict:
        return {
            "index": c.index,
            "text": text,
            "finish_reason": finish_reason,
            "logprobs": logprobs_object(logprobs, c.offset) if logprobs is not None else None,
            **self._tokens(self._unsent(c)),
        }

    @staticmethod
    def _unsent(c: Choice) -> list[int]:
        ids = c.token_ids[c.sent_token_ids :]
        c.sent_token_ids = len(c.token_ids)
        return ids
