"""What every client API's embedding route shares: OpenAI's four `input` forms read into texts or token id lists
(`embedding_inputs`; Ollama's /api/embed takes the same), the `EncodeJob` run through the engine process
(`run_encode`: the engine batches it with every other client's, appliance/server/embeddings.py), its float32 bytes
read without numpy (`floats`: HTTP workers hold none) and the answer encoded by orjson (`json_response`). The
routes themselves are each API's: appliance/openai_api/embeddings.py (/v3/embeddings, /v3/rerank) and
appliance/ollama_api/embed.py (/api/embed, /api/embeddings).
"""

from __future__ import annotations

import sys
from array import array
from typing import Any

import orjson
from flask import Response, g, request

from appliance.api.client_socket import socket_closed
from appliance.api.context import AppApi
from appliance.api.errors import ApiError, invalid
from appliance.api.generation import ClientGone
from appliance.api.parsers import is_int
from appliance.limits import Limits
from appliance.protocol import Encoded, EncodeJob, EngineStatus, Failed

ENCODE_TIMEOUT = 600.0  # seconds a request waits for its answer (the largest allowed one takes ~20 s on 1 core)


def embedding_inputs(
    value: Any, limits: Limits, name: str = "input"
) -> tuple[list[str] | None, list[list[int]] | None]:
    """OpenAI's four `input` forms -> (texts, None) or (None, token id lists), bounded by `embedding_inputs`."""
    if value is None:
        raise invalid(f"{name} field is required", name)
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise invalid(f"{name} must be a non-empty string, list of strings, token ids or lists of token ids", name)
    if all(is_int(t) for t in value):  # one input of token ids
        value = [value]
    if len(value) > limits.embedding_inputs:
        raise invalid(f"{name} holds {len(value)} inputs, more than the limit of {limits.embedding_inputs}", name)
    if all(isinstance(t, str) for t in value):
        if any(not t for t in value):
            raise invalid(f"{name} cannot contain an empty string", name)
        return value, None
    if all(isinstance(t, list) and t and all(is_int(i) and i >= 0 for i in t) for t in value):
        return None, value
    raise invalid(f"{name} must be a non-empty string, list of strings, token ids or lists of token ids", name)


def floats(vector: bytes) -> list[float]:
    """float32 little-endian bytes -> Python floats."""
    values = array("f", vector)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def run_encode(api: AppApi, job: EncodeJob) -> tuple[Encoded, EngineStatus]:
    """The job's answer from the engine process (ApiError for its refusal, ClientGone when the client left)."""
    status = api.ready_status(job.model, fresh=False)
    g.request_id = job.request_id
    sock = request.environ.get("gunicorn.socket")
    reply = api.client.encode(job, ENCODE_TIMEOUT, lambda: socket_closed(sock))
    if reply is None:
        if socket_closed(sock):
            raise ClientGone()
        raise ApiError(503, "the request did not finish in time", code="timeout")
    if isinstance(reply, Failed):
        raise ApiError(reply.status, reply.message, param=reply.param, code=reply.code)
    return reply, status


def json_response(body: dict) -> Response:
    """`body` as Flask's JSON response would be (compact, a trailing newline), encoded by orjson: a 384-float
    vector took the standard library's encoder 0.24 ms (Python's shortest round-trip repr per float) against
    0.017 ms, the same numbers (orjson writes each float's shortest round-trip form too)."""
    return Response(orjson.dumps(body) + b"\n", mimetype="application/json")
