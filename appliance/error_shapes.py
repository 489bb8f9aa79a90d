"""Each client API's error body, in one place: the Flask side (the APIs' error handlers) and the HTTP edge (the
worker's own answers written before Flask sees a request: 431, the per-key 429, a full worker's 503) both render
through here, so an error a client reads has its API's shape whichever layer answered it.

Why a root module: the edge runs in the worker's event loop and imports neither Flask nor the API packages, and
the APIs import no part of the edge. The shapes:

* OpenAI (and OVMS's routes): `{"error": {"message", "type", "param", "code"}}`;
* Anthropic (`/v1/messages...`): `{"type": "error", "error": {"type", "message"}}` with Anthropic's type names
  (`rate_limit_error`, `overloaded_error`, ...), which its SDK and its users read;
* Ollama (`/api/...`): `{"error": message}`.
"""

from __future__ import annotations

import json

OPENAI, ANTHROPIC, OLLAMA = "openai", "anthropic", "ollama"

# Anthropic's error types by status (its API reference, "Errors")
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def api_of(path: str) -> str:
    """Which API a request path belongs to (its error shape): Anthropic's, Ollama's, else OpenAI's/OVMS's."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return ANTHROPIC
    if path.startswith("/api/"):
        return OLLAMA
    return OPENAI


def openai(message: str, type: str | None, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def anthropic(status: int, message: str) -> dict:
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def ollama(message: str) -> dict:
    return {"error": message}


def body(api: str, status: int, message: str, type: str, code: str | None = None) -> bytes:
    """The JSON bytes of an error in `api`'s shape (`type` and `code` are OpenAI's; Anthropic's type follows the
    status)."""
    if api == ANTHROPIC:
        shape = anthropic(status, message)
    elif api == OLLAMA:
        shape = ollama(message)
    else:
        shape = openai(message, type, None, code)
    return json.dumps(shape).encode()
