"""The Flask app each gunicorn worker runs: routes, auth, body checks, error rendering.

Data flows one way: HTTP body -> validation (typed request) -> Job -> engine process -> chunks -> Shape ->
JSON / SSE. No model, tokenizer or numpy in here: a worker is a thin translator, so N workers cost little.

Several models: the engine process serves every configured model; a request's `model` picks one (an unknown name
is 404 model_not_found), /v3/models and /v1/config list them all, as the engine reports them now (a reload may
have changed the set).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import asdict, replace
from typing import NoReturn, cast

from flask import Flask, Response, g, request
from flask.json.provider import DefaultJSONProvider

from appliance import auth, web
from appliance.anthropic_api.routes import blueprint as anthropic_blueprint
from appliance.api.context import error_handlers, json_body
from appliance.api.errors import ApiError
from appliance.api.generation import respond, start
from appliance.api.request import ChatRequest, CompletionRequest, chat_job, completion_job
from appliance.http.client import EngineClient
from appliance.ollama_api.routes import blueprint as ollama_blueprint
from appliance.openai_api.chat import ChatShape, parse_chat
from appliance.openai_api.completions import CompletionShape, parse_completion
from appliance.openai_api.embeddings import register as register_embeddings
from appliance.openai_api.responses_routes import register as register_responses
from appliance.openai_api.validation import OPENAI, OVMS, Dialect, parse_tokenize
from appliance.protocol import EngineStatus, HttpRecord, ModelInfo
from appliance.settings import ConfigError, ServeSettings

log = logging.getLogger("appliance.http")

OPEN_PATHS = {"/v2/health/live", "/v2/health/ready"}  # probes work without the API key
# each API prefix and whose defaults its completions and chat requests get (validation.Dialect): /v3 is OVMS's API
# (/v3/v1/... its deprecated spelling), /v1 OpenAI's, where OpenAI's clients and frameworks point
PREFIXES = {"/v3": OVMS, "/v1": OPENAI, "/v3/v1": OVMS}


class Api:
    """Route handlers over one engine client; instantiated per worker by `create_app`."""

    def __init__(self, settings: ServeSettings, client: EngineClient):
        self.settings, self.client = settings, client
        self.limits = replace(settings.limits, max_queued=settings.max_queued)  # the bounds every request keeps

    # ---- guards
    def authorize(self) -> None:
        """The Host allow-list, then the API key (appliance/auth.py); probes skip both (its docstring)."""
        if request.path in OPEN_PATHS:
            return
        if not auth.host_checked(request.headers.get("Host"), self.settings):
            raise ApiError(400, "Invalid Host header: this server does not answer for that name", code="invalid_host")
        if web.is_public(request.path):  # the web page's static files: no data in them (appliance/web/)
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

    @staticmethod
    def json_body():
        return json_body()

    def ready_status(self, model: str, fresh: bool = True) -> EngineStatus:
        """Model `model`'s status if it can serve (ApiError otherwise: 404 for no such model, 503 not ready).
        Probes ask the engine now (fresh), and their answers leave out a failed model's error (exception text,
        paths): the readiness probe needs no key, and the error is in /v1/config and the log. Requests use the kept
        ready status (serving_status) and get the error."""
        status = self.client.status(model) if fresh else self.client.serving_status(model)
        if status.ready:
            return status
        _not_serving(model, status.state, None if fresh else status.error)

    # ---- generation endpoints
    def completions(self, dialect: Dialect):
        req = parse_completion(self.json_body(), self.limits, dialect)
        return self.generate(
            req, lambda params, rid: completion_job(req, params, rid), CompletionShape(req.edge.return_raw_tokens)
        )

    def chat(self, dialect: Dialect):
        req = parse_chat(self.json_body(), self.limits, dialect)
        # its parsers: how this model writes tool calls and reasoning
        status = self.ready_status(req.edge.model, fresh=False)
        shape = ChatShape.for_request(req, status.tool_parser, status.reasoning_parser)
        return self.generate(
            req, lambda params, rid: chat_job(req, params, rid, status.tool_parser, self.limits), shape
        )

    def generate(self, req: CompletionRequest | ChatRequest, make_job, shape):
        gen = req.edge
        status = self.ready_status(gen.model, fresh=False)
        if gen.unknown:
            log.debug("ignored unknown request fields", extra={"fields": list(gen.unknown)})
        generation = start(
            self.client,
            status,
            req.sampling,
            make_job,
            shape,
            request_id=shape.id_prefix + uuid.uuid4().hex,
            model=gen.model,
            timeout=gen.timeout,
            include_usage=gen.include_usage,
        )
        if not gen.stream:
            return generation.unary()
        return respond(generation.sse(), "text/event-stream")

    def tokenize(self):
        req = parse_tokenize(self.json_body(), self.limits)
        self.ready_status(req.model, fresh=False)
        reply = self.client.tokenize(req.model, list(req.prompts))
        if reply.error is not None:
            raise ApiError(reply.error.status, reply.error.message, code=reply.error.code)
        return {"tokens": reply.value if req.batched else reply.value[0]}

    # ---- model listing, health, config, metrics
    @staticmethod
    def model_object(info: ModelInfo) -> dict:
        return {"id": info.name, "object": "model", "created": info.created, "owned_by": "OVMS"}

    def models(self):
        return {"object": "list", "data": [self.model_object(m) for m in self.client.models()]}

    def model(self, model_id: str):
        info = next((m for m in self.client.models() if m.name == model_id), None)
        if info is None:
            _not_serving(model_id, "unknown", None)
        return self.model_object(info)

    def live(self):
        return {}

    def ready(self):
        """OVMS: the server is ready when every configured model is. Open to all: no error details (ready_status)."""
        for info in self.client.models():
            if info.state != "ready":
                _not_serving(info.name, info.state, None)
        return {}

    def model_ready(self, name: str):
        self.ready_status(name)
        return {}

    def config_body(self, models: list[ModelInfo]) -> dict:
        """OVMS's /v1/config: each model's model_version_status (and, beside it, the effective limits)."""
        body = {}
        for info in models:
            state = {"ready": "AVAILABLE", "loading": "LOADING", "stopping": "UNLOADING"}.get(info.state, "END")
            code, message = ("OK", "OK") if info.error is None else ("UNKNOWN", info.error)
            if info.state == "failed":
                code, message = "UNKNOWN", info.error or "load failed"
            body[info.name] = {
                "model_version_status": [
                    {"version": "1", "state": state, "status": {"error_code": code, "error_message": message}}
                ],
                "limits": asdict(self.limits),
                # load on demand: an AVAILABLE model may be unloaded (idle past keep_alive, or the memory budget)
                "loaded": info.loaded,
            }  # beside OVMS's key: clients reading model_version_status are unaffected
        return body

    def config(self):
        return self.config_body(self.client.models())

    def reload(self):
        """OVMS's config reload: the config file read again, models added / changed / removed; the answer is
        /v1/config of the new set once their loads end: 201 when something changed, 200 when nothing did. A broken
        config is a 400 and changes nothing; a model that fails to load shows as END with its error. Only an admin
        key may ask (appliance/auth.py `reload_refusal`)."""
        refusal = auth.reload_refusal(self.settings, g.get("admin", False), request.headers.get("Origin"))
        if refusal is not None:
            raise ApiError(refusal[0], refusal[1], code="admin_key_required")
        reply = self.client.reload()
        if reply.error is not None:
            raise ApiError(reply.error.status, reply.error.message, code=reply.error.code)
        changed, models = reply.value
        return self.config_body(models), 201 if changed else 200

    def metrics(self):
        return Response(self.client.metrics(), mimetype="text/plain", content_type="text/plain; version=0.0.4")


def _not_serving(model: str, state: str, error: str | None) -> NoReturn:
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


def _error_response(exc: ApiError) -> Response:
    g.error_type = exc.type
    return Response(json.dumps(exc.body()), status=exc.status, mimetype="application/json")


def create_app(settings: ServeSettings | None = None, client: EngineClient | None = None) -> Flask:
    """Gunicorn calls this in each worker (`appliance.openai_api.app:create_app()`): settings come from the
    runtime directory `appliance serve` made."""
    settings = settings or ServeSettings.load()
    client = client or EngineClient(settings.socket_path, settings.authkey())
    api = Api(settings, client)

    app = Flask("appliance")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    cast(DefaultJSONProvider, app.json).sort_keys = False

    for prefix, dialect in PREFIXES.items():
        for name, path, view in (
            ("completions", "completions", api.completions),
            ("chat", "chat/completions", api.chat),
        ):
            # `defaults`: the generation view's argument, its request's dialect
            app.add_url_rule(f"{prefix}/{path}", name + prefix, view, methods=["POST"], defaults={"dialect": dialect})
        app.add_url_rule(f"{prefix}/tokenize", view_func=api.tokenize, methods=["POST"], endpoint=f"tokenize{prefix}")
        app.add_url_rule(f"{prefix}/models", view_func=api.models, methods=["GET"], endpoint=f"models{prefix}")
        app.add_url_rule(
            f"{prefix}/models/<path:model_id>", view_func=api.model, methods=["GET"], endpoint=f"model{prefix}"
        )
    app.register_blueprint(anthropic_blueprint(api))  # Anthropic's Messages API: /v1/messages
    register_responses(app, api, tuple(PREFIXES))
    register_embeddings(app, api, tuple(PREFIXES))  # /v3/embeddings, /v3/rerank
    app.add_url_rule("/v2/health/live", view_func=api.live, methods=["GET"])
    app.add_url_rule("/v2/health/ready", view_func=api.ready, methods=["GET"])
    app.add_url_rule("/v2/models/<path:name>/ready", view_func=api.model_ready, methods=["GET"])
    app.add_url_rule("/v1/config", view_func=api.config, methods=["GET"])
    app.add_url_rule("/v1/config/reload", view_func=api.reload, methods=["POST"])
    app.add_url_rule("/metrics", view_func=api.metrics, methods=["GET"])
    app.register_blueprint(ollama_blueprint(api))  # Ollama's API (appliance/ollama_api/)
    for blueprint in web.blueprints(api):  # the web page at / and its /v1/status (appliance/web/)
        app.register_blueprint(blueprint)

    @app.before_request
    def _start():
        g.started = time.monotonic()
        api.authorize()

    @app.after_request
    def _record(response: Response):
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        api.client.record_http(
            HttpRecord(
                rule,
                request.method,
                response.status_code,
                time.monotonic() - g.get("started", time.monotonic()),
                g.get("error_type"),
            )
        )
        if g.get("request_id"):
            response.headers["X-Request-Id"] = g.request_id
        return response

    error_handlers(app, _error_response, settings.max_body_bytes)
    return app
