"""The route context every client API's routes share: the server's settings, the engine client, the request
bounds, the guards every request passes (the Host allow-list and the API key, `authorize`), the body reader and the
model readiness check, and one mapping of failures to errors that each API writes in its own shape. One object per
worker, made by appliance/wsgi/app.py's `create_app` and handed to every API's routes."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NoReturn

from flask import Blueprint, Flask, Response, g, request
from werkzeug.exceptions import HTTPException

from appliance import auth
from appliance.api.errors import ApiError
from appliance.api.generation import ClientGone
from appliance.api.image_fetch import fetch_images, listed_hosts
from appliance.api.images import images_of
from appliance.api.request import ChatRequest
from appliance.http.client import EngineClient, EngineUnavailable
from appliance.protocol import EngineStatus
from appliance.settings import ConfigError, ServeSettings

log = logging.getLogger("appliance.http")


OPEN_PATHS = {"/v2/health/live", "/v2/health/ready"}  # probes work without the API key


class AppApi:
    """What a route handler uses of the server; instantiated per worker by `create_app`. `public`: the paths
    served without a key (the web page's static files: no data in them), told by the app that knows them."""

    def __init__(
        self, settings: ServeSettings, client: EngineClient, public: Callable[[str], bool] = lambda path: False
    ):
        self.settings, self.client, self.public = settings, client, public
        self.limits = replace(settings.limits, max_queued=settings.max_queued)  # the bounds every request keeps

    def authorize(self) -> None:
        """The Host allow-list, then the API key (appliance/auth.py); probes skip both (its docstring)."""
        if request.path in OPEN_PATHS:
            return
        if not auth.host_checked(request.headers.get("Host"), self.settings):
            raise ApiError(400, "Invalid Host header: this server does not answer for that name", code="invalid_host")
        if self.public(request.path):
            return
        try:  # read once per worker, at its first keyed request: the files may have changed since start-up
            keys = auth.api_keys(self.settings.api_key_file)
            admin_keys = auth.api_keys(self.settings.admin_key_file)
        except ConfigError as exc:  # an answer, not the worker's end; the next request reads the files again
            log.error("cannot read the API keys", extra={"error": str(exc)})
            message = "The server cannot read its API keys (see its log)"
            raise ApiError(500, message, code="api_keys_unreadable") from None
        header = auth.authorization(request.headers.get("Authorization"), request.headers.get("x-api-key"))
        g.admin = admin_keys is not None and admin_keys.accepts(header)  # an admin key is a client key too
        if keys is not None and not g.admin and not keys.accepts(header):
            raise ApiError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'")
        g.tenant = auth.tenant_id(header) if keys is not None or g.admin else ""  # the key's own namespace

    def with_images(self, req: ChatRequest) -> ChatRequest:
        """`req` with its remote image URLs fetched (image_fetch.py: listed hosts only, bounded in bytes and time);
        every route that builds a chat job calls it first (chat_job refuses an image still without its file)."""
        if not any(image.url is not None for image in images_of(req.messages)):
            return req
        hosts = listed_hosts(self.settings.image_url_hosts)
        fetched = fetch_images(req.messages, hosts, self.limits, self.settings.image_url_timeout)
        return replace(req, messages=fetched)

    @staticmethod
    def json_body() -> Any:
        """The OpenAI and Anthropic routes' rule (`json_body()`): Content-Type application/json."""
        return json_body()

    def ready_status(self, model: str, fresh: bool = True) -> EngineStatus:
        """Model `model`'s status if it can serve (ApiError otherwise: 404 for no such model, 503 not ready).
        Probes ask the engine now (fresh), and their answers leave out a failed model's error (exception text,
        paths): the readiness probe needs no key, and the error is in /v1/config and the log. Requests use the kept
        ready status (serving_status) and get the error."""
        status = self.client.status(model) if fresh else self.client.serving_status(model)
        if status.ready:
            return status
        not_serving(model, status.state, None if fresh else status.error)


def not_serving(model: str, state: str, error: str | None) -> NoReturn:
    """The ApiError for a model in `state` (not ready)."""
    if state == "unknown":
        raise ApiError(404, f"The model `{model}` does not exist", param="model", code="model_not_found")
    if state == "failed":  # load or engine; without `error` (a probe), where to read it
        why = f": {error}" if error else " (its error: GET /v1/config, or the server's log)"
        raise ApiError(503, f"The model `{model}` cannot serve{why}", code="model_failed")
    if state == "stopping":
        raise ApiError(503, "The server is shutting down", code="shutting_down")
    raise ApiError(
        503, f"The model `{model}` is loading; retry when /v2/health/ready answers 200", code="model_not_ready"
    )


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
