"""One generation seen from an HTTP worker: engine events -> choices -> a unary body or streamed events.

Every client API starts its generations with `api/start.py`'s `start()` and sends a streamed answer with its
`respond()`. The APIs differ only in their `Shape` (how a choice / delta is spelled) and in how they write the
answer (`unary()` / `sse()` here, or their own events over `deltas()`).
The response starts only after the engine accepted the job and produced its first chunk (prefill done), so
queue-full, timeout and prompt errors are still proper HTTP statuses, also for streaming requests.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import chain
from typing import Protocol

from appliance import protocol as p
from appliance.api.errors import ApiError
from appliance.http.client import EngineClient, EngineUnavailable, JobStream
from appliance.outputs import Timing, TokenLogprob

# How often a waiting worker looks at its client's socket (and the request's deadline) between engine events.
CLIENT_CHECK_SECONDS = 0.5


class ClientGone(Exception):
    """The HTTP client closed its connection; the job was cancelled."""


@dataclass
class Choice:
    index: int
    prefix: str = ""  # echoed prompt
    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    timing: Timing | None = None
    started: bool = False
    offset: int = 0  # text_offset of the next token (characters, echo included)
    prompt_logprobs: list[TokenLogprob] | None = None  # echo + logprobs: the echoed prompt's tokens
    token_ids: list[int] = field(default_factory=list)  # generated ids (Cerebras return_raw_tokens)
    sent_token_ids: int = 0  # how many of token_ids stream deltas carried (a chunk without text makes no delta)
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied (usage.prompt_tokens_details)
    # speculative decoding, so far (cumulative in every chunk): draft tokens accepted / rejected
    # (usage.completion_tokens_details)
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    @property
    def text(self) -> str:
        return self.prefix + "".join(self.parts)


class Shape(Protocol):
    """How one endpoint spells its objects (appliance/openai_api/completions.py, chat.py, anthropic_api/shape.py)."""

    object: str
    chunk_object: str
    id_prefix: str

    def choice(self, c: Choice, logprobs: bool) -> dict: ...
    def opening(self, c: Choice) -> dict: ...
    def delta(
        self, c: Choice, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None
    ) -> dict | list[dict]: ...  # a list: chat's parsers may make several deltas of one chunk, or none yet


@dataclass
class Meta:
    """What every body / chunk of this response repeats."""

    id: str
    created: int
    model: str
    system_fingerprint: str


class Generation:
    def __init__(
        self,
        client: EngineClient,
        job: p.Job,
        shape: Shape,
        meta: Meta,
        *,
        include_usage: bool = False,
        timeout: float | None = None,
        client_gone: Callable[[], bool] = lambda: False,
    ):
        self.client, self.job, self.shape, self.meta = client, job, shape, meta
        self.include_usage = include_usage
        self.want_logprobs = job.params.logprobs is not None
        self.streaming = False  # sse(): a chunk's logprobs go out in its delta and are not kept
        self.deadline = time.monotonic() + timeout if timeout else None
        self.client_gone = client_gone
        self.accepted: p.Accepted | None = None
        self.choices = [Choice(i) for i in range(len(job.prompts) * job.n)]
        self._stream: JobStream | None = None
        self._first: list[p.ChoiceChunk] = []

    # ---- phase 1: before any byte of the response
    def start(self) -> Generation:
        self._stream = self.client.open_job(self.job)
        try:
            self._events = self._receive()
            accepted = next(self._events)
            if not isinstance(accepted, p.Accepted):
                raise ApiError(500, "engine protocol error: expected Accepted")
            self.accepted = accepted
            for c in self.choices:
                c.prefix = accepted.echo_texts[c.index // self.job.n] if accepted.echo_texts else ""
                c.offset = len(c.prefix)
            self._first = [next(self._events)]
            first = self._first[0]  # the prefill's cache hit, for a usage() asked before the first delta
            self.choices[first.index].cached_tokens = first.chunk.cached_tokens
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Idempotent. Before the job's end this cancels it engine-side (frees the sequences' KV)."""
        if self._stream is not None:
            self._stream.close()

    def _receive(self) -> Iterator:
        stream = self._stream
        assert stream is not None, "start() opened it"
        next_check = time.monotonic() + CLIENT_CHECK_SECONDS
        while True:
            now = time.monotonic()
            if self.deadline is not None and now >= self.deadline:
                raise ApiError(
                    429, "request timeout exceeded: the request was cancelled", param="timeout", code="timeout"
                )
            if now >= next_check:  # also while tokens flow: a unary client may leave mid-generation
                if self.client_gone():
                    raise ClientGone()
                next_check = now + CLIENT_CHECK_SECONDS
            wait = next_check - now if self.deadline is None else min(next_check, self.deadline) - now
            try:
                event = stream.next(wait)
            except EngineUnavailable as exc:
                raise ApiError(503, str(exc), code="engine_unavailable") from None
            if event is None:
                continue
            if isinstance(event, p.Failed):
                raise ApiError(event.status, event.message, param=event.param, code=event.code)
            if isinstance(event, p.End):
                return
            yield event

    def _chunks(self) -> Iterator[p.ChoiceChunk]:
        return chain(self._first, self._events)

    def _apply(self, event: p.ChoiceChunk) -> list[dict]:
        """Folds one engine chunk into its choice; returns the stream deltas it makes."""
        c, chunk = self.choices[event.index], event.chunk
        if chunk.finish_reason == "abort":
            if chunk.error:
                raise ApiError(500, f"generation failed: {chunk.error}", code="generation_failed")
            raise ApiError(503, "generation was aborted (the server is shutting down)", code="aborted")
        if chunk.prompt_logprobs is not None and self.want_logprobs:
            c.prompt_logprobs = chunk.prompt_logprobs
        c.token_ids += chunk.token_ids
        c.cached_tokens = chunk.cached_tokens or c.cached_tokens
        c.accepted_prediction_tokens = max(c.accepted_prediction_tokens, chunk.accepted_prediction_tokens)
        c.rejected_prediction_tokens = max(c.rejected_prediction_tokens, chunk.rejected_prediction_tokens)
        deltas = []
        if not c.started:
            c.started = True
            deltas.append(self.shape.opening(c))
        logprobs = (chunk.logprobs or []) if self.want_logprobs else None
        if chunk.text or logprobs or chunk.finish_reason:
            made = self.shape.delta(c, chunk.text, logprobs, chunk.finish_reason)
            deltas.extend(made if isinstance(made, list) else [made])
        c.parts.append(chunk.text)
        if logprobs:
            if not self.streaming:  # a unary body needs them all (bounded: the limits table's generated_logprobs)
                c.logprobs += logprobs
            c.offset += sum(len(lp.token) for lp in logprobs)
        c.completion_tokens = chunk.completion_tokens or c.completion_tokens
        if chunk.finish_reason:
            c.finish_reason, c.timing = chunk.finish_reason, event.timing
        return deltas

    # ---- phase 2a: unary
    def unary(self) -> dict:
        try:
            for event in self._chunks():
                self._apply(event)
        finally:
            self.close()
        for c in self.choices:
            c.offset = len(c.prefix)  # shapes number text_offset from the start of the text
        choices = [self.shape.choice(c, self.want_logprobs) for c in self.choices]
        return {
            **self._head(self.shape.object),
            "choices": choices,
            "usage": self.usage(),
            "time_info": self.time_info(),
        }

    # ---- phase 2b: streaming (Server-Sent Events)
    def sse(self) -> Iterator[str]:
        """Closing this generator early (client gone) closes the job, which cancels it engine-side."""
        try:
            for choice in self.deltas():
                yield self._event(
                    {
                        **self._head(self.shape.chunk_object),
                        "choices": [choice],
                        **({"usage": None} if self.include_usage else {}),
                    }
                )
            if self.include_usage:
                yield self._event(
                    {
                        **self._head(self.shape.chunk_object),
                        "choices": [],
                        "usage": self.usage(),
                        "time_info": self.time_info(),
                    }
                )
        except ApiError as exc:  # headers are sent: report in-band, as OpenAI does
            yield self._event(exc.body())
        except ClientGone:
            return
        finally:
            self.close()
        yield "data: [DONE]\n\n"

    def deltas(self) -> Iterator[dict]:
        """The shape's stream deltas as the chunks come (sse() wraps them; an API that spells its own events, such
        as Anthropic's Messages or the Responses API, writes them itself); the job is closed at the end."""
        self.streaming = True
        try:
            for event in self._chunks():
                yield from self._apply(event)
        finally:
            self.close()

    @staticmethod
    def _event(data: dict) -> str:
        return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _head(self, obj: str) -> dict:
        m = self.meta
        return {
            "id": m.id,
            "object": obj,
            "created": m.created,
            "model": m.model,
            "system_fingerprint": m.system_fingerprint,
        }

    def usage(self) -> dict:
        prompt = sum(self.accepted.prompt_tokens) if self.accepted else 0
        completion = sum(c.completion_tokens for c in self.choices)
        # per prompt: what its first choice's last chunk said (its other choices share the same cached prompt)
        cached = sum(c.cached_tokens for c in self.choices[:: self.job.n])
        usage: dict = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        accepted = sum(c.accepted_prediction_tokens for c in self.choices)
        rejected = sum(c.rejected_prediction_tokens for c in self.choices)
        if accepted or rejected or self.job.params.prediction is not None:  # OpenAI: with a prediction only
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": accepted,
                "rejected_prediction_tokens": rejected,
            }
        return usage

    def time_info(self) -> dict:
        timings = [c.timing for c in self.choices if c.timing is not None]
        slowest = max(timings, key=lambda t: t.total_time, default=Timing(created=time.time()))
        return {
            "queue_time": slowest.queue_time,
            "prompt_time": slowest.prompt_time,
            "completion_time": slowest.completion_time,
            "total_time": slowest.total_time,
            "created": min(t.created for t in timings) if timings else slowest.created,
        }
