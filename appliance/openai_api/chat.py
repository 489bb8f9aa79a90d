"""`/v3/chat/completions`: the job a chat request makes (messages -> the model's chat template, engine-side),
and how its choices and chunks are spelled."""

from __future__ import annotations

from appliance.openai_api.streaming import Choice
from appliance.openai_api.validation import ChatRequest
from appliance.outputs import TokenLogprob
from appliance.params import SamplingParams
from appliance.server.protocol import Job, PromptSpec


def chat_job(req: ChatRequest, params: SamplingParams, request_id: str) -> Job:
    return Job(request_id, [PromptSpec(messages=[dict(m) for m in req.messages])], params, n=req.gen.n)


def _entry(token: str, logprob: float | None) -> dict:  # None only for a first prompt token
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def logprobs_object(entries: list[TokenLogprob]) -> dict:
    return {
        "content": [
            {**_entry(e.token, e.logprob), "top_logprobs": [_entry(t, lp) for _, t, lp in e.top]} for e in entries
        ]
    }


class ChatShape:
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def choice(self, c: Choice, logprobs: bool) -> dict:
        return {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "finish_reason": c.finish_reason,
            "logprobs": logprobs_object(c.logprobs) if logprobs else None,
        }

    def opening(self, c: Choice) -> dict:
        """OVMS 2026.1+: the first chunk, right after prefill, only names the role."""
        return {
            "index": c.index,
            "delta": {"role": "assistant", "content": None},
            "finish_reason": None,
            "logprobs": None,
        }

    def delta(self, c: Choice, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None) -> dict:
        return {
            "index": c.index,
            "delta": {"content": text} if text else {},
            "finish_reason": finish_reason,
            "logprobs": logprobs_object(logprobs) if logprobs is not None else None,
        }
