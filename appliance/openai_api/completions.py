"""`/v3/completions`: the job a completion request makes, and how its choices and chunks are spelled."""

from __future__ import annotations

from dataclasses import replace

from appliance.openai_api.streaming import Choice
from appliance.openai_api.validation import CompletionRequest
from appliance.outputs import TokenLogprob
from appliance.params import SamplingParams
from appliance.protocol import Job, PromptSpec


def completion_job(req: CompletionRequest, params: SamplingParams, request_id: str) -> Job:
    prompts = [PromptSpec(text=p) if isinstance(p, str) else PromptSpec(token_ids=list(p)) for p in req.prompts]
    if req.echo and params.logprobs is not None:  # echo + logprobs: the echoed prompt's tokens get logprobs too
        params = replace(params, prompt_logprobs=params.logprobs)
    seeds = list(req.edge.seeds) if req.edge.seeds is not None else None  # Friendli: choice j's seed
    return Job(request_id, prompts, params, n=req.edge.n, echo=req.echo, seeds=seeds)


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
