"""`/v3/completions`: the job a completion request makes, and how its choices and chunks are spelled."""
from __future__ import annotations

from appliance.openai_api.streaming import Choice
from appliance.openai_api.validation import CompletionRequest
from appliance.outputs import TokenLogprob
from appliance.params import SamplingParams
from appliance.server.protocol import Job, PromptSpec


def completion_job(req: CompletionRequest, params: SamplingParams, request_id: str) -> Job:
    prompts = [PromptSpec(text=p) if isinstance(p, str) else PromptSpec(token_ids=list(p)) for p in req.prompts]
    return Job(request_id, prompts, params, n=req.gen.n, echo=req.echo)


def logprobs_object(entries: list[TokenLogprob], offset: int) -> dict:
    """OpenAI's legacy completions form; text_offset counts characters from the start of the choice's text."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for e in entries:
        tokens.append(e.token)
        token_logprobs.append(e.logprob)
        top.append({text: lp for _, text, lp in e.top})
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


class CompletionShape:
    object = "text_completion"
    chunk_object = "text_completion.chunk"
    id_prefix = "cmpl-"

    def choice(self, c: Choice, logprobs: bool) -> dict:
        return {"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                "logprobs": logprobs_object(c.logprobs, c.offset) if logprobs else None}

    def opening(self, c: Choice) -> dict:
        """OVMS 2026.1+: a first chunk right after prefill, with no generated text (the echo, if asked)."""
        return {"index": c.index, "text": c.prefix, "finish_reason": None, "logprobs": None}

    def delta(self, c: Choice, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None) -> dict:
        return {"index": c.index, "text": text, "finish_reason": finish_reason,
                "logprobs": logprobs_object(logprobs, c.offset) if logprobs is not None else None}
