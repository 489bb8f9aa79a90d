"""One generation seen from an HTTP worker: engine events -> choices -> a unary body or streamed events.

Every client API starts its generations with `start()` and sends a streamed answer with `respond()`: one request
id for the body's id, `X-Request-Id`, the engine job and its logs; the key's tenant on the job; one
`system_fingerprint`; the client's socket watched. The APIs differ only in their `Shape` (how a choice / delta is
spelled) and in how they write the answer (`unary()` / `sse()` here, or their own events over `deltas()`).
The response starts only after the engine accepted the job and produced its first chunk (prefill done), so
queue-full, timeout and prompt errors are still proper HTTP statuses, also for streaming requests.
"""

from __future__ import annotations

import errno
import json
import select
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Protocol

from flask import Response, g, request

from appliance import __version__
from appliance import protocol as p
from appliance.api.errors import ApiError
from appliance.api.sampling import to_sampling_params
from appliance.http.client import EngineClient, EngineUnavailable, JobStream
from appliance.outputs import Timing, TokenLogprob
from appliance.params import SamplingParams

# How often a waiting worker looks at its client's socket (and the request's deadline) between engine events.
CLIENT_CHECK_SECONDS = 0.5
# Kernel send buffer of a streaming response (Linux doubles it): what a client that stopped reading can leave unread
# before the worker's send timeout starts counting (appliance/http/worker.py).
STREAM_SEND_BUFFER = 16 * 1024


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


POLLRDHUP = getattr(select, "POLLRDHUP", 0x2000)  # Linux: the peer shut down its writing side


def socket_closed(sock: socket.socket | None) -> bool:
    """True when the peer closed (its FIN, or a reset). Pipelined request bytes mean it is alive, unless it closed
    behind them.

    `poll`, not `select` (which cannot take an fd >= 1024), and only then a peek at the raw socket (TLS too): on a
    socket with a timeout (`--send-timeout`) Python waits for readability before a `recv`, even with MSG_DONTWAIT.
    The peer's FIN is also seen behind bytes it sent before it (POLLRDHUP): a TLS client's close_notify alert, or
    anything unread, would otherwise hide it from the peek for as long as the request runs (a client that closes
    this way left its generation running to the end). An error we do not expect means "alive": cancelling a live
    client's generation is worse than noticing a gone one late."""
    if sock is None:
        return False
    try:
        fd = sock.fileno()
        if fd < 0:
            return True
        poller = select.poll()
        poller.register(fd, select.POLLIN | POLLRDHUP)
        events = poller.poll(0)
        if not events:
            return False
        if events[0][1] & (POLLRDHUP | select.POLLHUP):
            return True
        # the kernel's bytes, not the TLS layer's (an SSLSocket refuses MSG_PEEK): FIN reads as b"" either way
        return socket.socket.recv(sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError, TimeoutError):
        return False
    except (ConnectionError, OSError) as exc:
        return isinstance(exc, ConnectionError) or exc.errno in (errno.ENOTCONN, errno.EBADF)
    except Exception:
        return False


def bound_send_buffer(sock: socket.socket | None) -> None:
    """A small kernel send buffer for a streaming response, so a client that stopped reading blocks our writes (and
    meets the worker's send timeout) after STREAM_SEND_BUFFER bytes or so, not after megabytes of autotuned buffer
    while its generation goes on. Token events are small: this costs a reading client nothing."""
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SEND_BUFFER)
        except OSError:
            pass


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


# ---------------------------------------------------------------- the one start and answer of every client API


def fingerprint(status: p.EngineStatus) -> str:
    """`system_fingerprint`: what decides the tokens besides the request (version, backend, weights, device)."""
    return f"appliance-{__version__}-{status.backend}-{status.weight_format}-{status.device}".lower()


def start(
    client: EngineClient,
    status: p.EngineStatus,
    sampling: dict[str, Any],
    make_job: Callable[[SamplingParams, str], p.Job],
    shape: Shape,
    *,
    request_id: str,
    model: str,
    timeout: float | None = None,
    include_usage: bool = False,
    generation: type[Generation] = Generation,
) -> Generation:
    """A started generation of the job `make_job` builds from the request's `sampling` (with the model's defaults)
    under `request_id`: that one id is the request's (`X-Request-Id`, logs, set before the job is built so that a
    refusal while building it carries it too), the body's (`Meta.id`) and the engine job's. The job runs for the
    request's key (its tenant: its own prefix-cache namespace) and is cancelled when the client's socket closes.
    `generation`: a subclass that spells the answer its API's way (Ollama's)."""
    g.request_id = request_id
    job = make_job(to_sampling_params(sampling, status.generation_defaults), request_id)
    job.model = model
    job.tenant = g.get("tenant", "")
    sock = request.environ.get("gunicorn.socket")
    meta = Meta(request_id, int(time.time()), model, fingerprint(status))
    return generation(
        client,
        job,
        shape,
        meta,
        include_usage=include_usage,
        timeout=timeout,
        client_gone=lambda: socket_closed(sock),
    ).start()


def respond(body: Iterable[str] | Iterable[bytes], mimetype: str) -> Response:
    """A streamed answer (SSE or NDJSON lines): a small send buffer (a client that stops reading meets the worker's
    send timeout soon), and neither a cache nor a proxy (nginx's `X-Accel-Buffering`) holding events back."""
    bound_send_buffer(request.environ.get("gunicorn.socket"))
    return Response(body, mimetype=mimetype, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def prompt_tokens(client: EngineClient, job: p.Job) -> int:
    """The prompt's token count of a max_tokens 0 job (the engine answers Accepted, one finished chunk, End),
    within the engine call's deadline (`protocol.CALL_SECONDS`, a 503 past it: nothing was generated)."""
    stream = client.open_job(job)
    deadline = time.monotonic() + p.CALL_SECONDS
    tokens = None
    try:
        while not stream.ended:
            left = deadline - time.monotonic()
            event = stream.next(left) if left > 0 else None
            if event is None:
                raise ApiError(503, f"the engine did not count the tokens within {p.CALL_SECONDS:g} s")
            if isinstance(event, p.Failed):
                raise ApiError(event.status, event.message, param=event.param, code=event.code)
            if isinstance(event, p.Accepted):
                tokens = sum(event.prompt_tokens)
    except EngineUnavailable as exc:
        raise ApiError(503, str(exc), code="engine_unavailable") from None
    finally:
        stream.close()
    if tokens is None:
        raise ApiError(500, "engine protocol error: expected Accepted")
    return tokens
