"""The one start and answer of every client API's generations.

`start()`: one request id for the body's id, `X-Request-Id`, the engine job and its logs; the key's tenant on the
job; one `system_fingerprint`; the client's socket watched. `respond()`: a streamed answer's headers and send
buffer. `prompt_tokens()`: a prompt's token count (Anthropic's count_tokens) within the engine call's deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from flask import Response, g, request

from appliance import __version__
from appliance import protocol as p
from appliance.api.client_socket import bound_send_buffer, socket_closed
from appliance.api.errors import ApiError
from appliance.api.generation import Generation, Meta, Shape
from appliance.api.sampling import to_sampling_params
from appliance.http.client import EngineClient, EngineUnavailable
from appliance.params import SamplingParams


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
