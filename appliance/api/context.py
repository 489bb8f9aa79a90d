"""What every client API's routes share: what they use of the app (appliance/openai_api/app.py's `Api`: its
settings, engine client, request bounds, body reader and readiness check), and one mapping of failures to errors
that each API writes in its own shape. A Protocol, not an import of app.py: the app imports each API's
routes to register them, so the routes naming the app would be an import cycle (tests/test_architecture.py)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, Protocol

from flask import Blueprint, Flask, Response, g, request
from werkzeug.exceptions import HTTPException

from appliance.api.errors import ApiError
from appliance.api.generation import ClientGone
from appliance.http.client import EngineClient, EngineUnavailable
from appliance.limits import Limits
from appliance.protocol import EngineStatus
from appliance.settings import ServeSettings

log = logging.getLogger("appliance.http")


class AppApi(Protocol):
    settings: ServeSettings
    client: EngineClient
    limits: Limits

    def json_body(self) -> Any: ...  # adapter.json_body(): the OpenAI routes' rule
    def ready_status(self, model: str, fresh: bool = True) -> EngineStatus: ...


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def json_body(any_content_type: bool = False) -> Any:
    """The request's body as JSON (413 past the app's MAX_CONTENT_LENGTH; not JSON, NaN and Infinity included: a
    400 in the API's error shape).

    The OpenAI and Anthropic routes want `Content-Type: application/json` (415 otherwise), as their clients send
    it. `any_content_type`: the body is JSON whatever the header says, as Ollama decodes it (litellm's Ollama
    providers send no Content-Type, Ollama's documented `curl -d` a form type). A web page's request with such a
    type is still refused (403): browsers send it cross-site without asking first (no CORS preflight), so it is
    how a page the user visits could spend this server's compute, which the 415 prevents on the other routes; a
    page's JSON request needs a preflight, which this server never answers."""
    if request.mimetype != "application/json":
        if not any_content_type:
            raise ApiError(415, "Content-Type must be application/json")
        if request.headers.get("Origin") is not None:
            raise ApiError(403, "a web page's request needs Content-Type: application/json")
    data = request.get_data(cache=False)  # 413 past MAX_CONTENT_LENGTH
    try:
        return json.loads(data, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        raise ApiError(400, "Request body is not valid JSON") from None


def error_handlers(target: Flask | Blueprint, render: Callable[[ApiError], Response], max_body_bytes: int) -> None:
    """Every failure a request can meet, as an `ApiError` that `render` writes in the API's own error shape: the
    same statuses and messages on every client API (a 401 names its scheme, RFC 9110; a 405 names the allowed
    methods), a vanished client is logged as 499 and nothing is sent, anything unexpected is logged with its
    traceback and answered 500 without details."""

    @target.errorhandler(ApiError)
    def _api_error(exc: ApiError):
        response = render(exc)
        if exc.status == 401:  # RFC 6750's bearer token (x-api-key carries the same key)
            response.headers["WWW-Authenticate"] = 'Bearer realm="appliance"'
        return response

    @target.errorhandler(EngineUnavailable)
    def _engine_gone(exc: EngineUnavailable):
        return render(ApiError(503, "The inference engine is not reachable", code="engine_unavailable"))

    @target.errorhandler(ClientGone)
    def _client_gone(exc: ClientGone):
        g.error_type = "client_closed_request"
        return Response(status=499)  # nginx's convention; nobody reads it

    @target.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        if exc.code == 404:
            return render(ApiError(404, f"Route {request.method} {request.path} does not exist"))
        if exc.code == 405:
            response = render(ApiError(405, f"Method {request.method} is not allowed on {request.path}"))
            response.headers["Allow"] = ", ".join(sorted(getattr(exc, "valid_methods", None) or ()))
            return response
        if exc.code == 413:
            return render(ApiError(413, f"Request body too large: the limit is {max_body_bytes} bytes"))
        return render(ApiError(exc.code or 500, exc.description or exc.name))

    @target.errorhandler(Exception)
    def _unexpected(exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.path)
        return render(ApiError(500, "Internal server error"))
