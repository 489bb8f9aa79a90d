"""What every client API's routes share: what they use of the app (appliance/openai_api/app.py's `Api`: its
settings, engine client, request bounds, body reader and readiness check), and one mapping of failures to errors
that each API writes in its own shape. A Protocol, not an import of app.py: the app imports each API's
routes to register them, so the routes naming the app would be an import cycle (tests/test_architecture.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from flask import Blueprint, Flask, Response, g, request
from werkzeug.exceptions import HTTPException

from appliance.http.client import EngineClient, EngineUnavailable
from appliance.limits import Limits
from appliance.openai_api.errors import ApiError
from appliance.openai_api.streaming import ClientGone
from appliance.protocol import EngineStatus
from appliance.settings import ServeSettings

log = logging.getLogger("appliance.http")


class AppApi(Protocol):
    settings: ServeSettings
    client: EngineClient
    limits: Limits

    def json_body(self) -> Any: ...
    def ready_status(self, model: str, fresh: bool = True) -> EngineStatus: ...


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
