"""OVMS's and OpenAI's routes: completions and chat under /v3 (OVMS's defaults), /v1 (OpenAI's) and /v3/v1, tokenize,
the model list, and OVMS's health, config, reload and metrics endpoints; `register` adds them and the Responses and
embedding routes to the app (appliance/wsgi/app.py).

Data flows one way: HTTP body -> validation (typed request) -> Job -> engine process -> chunks -> Shape ->
JSON / SSE. No model, tokenizer or numpy in here: a worker is a thin translator, so N workers cost little.

Several models: the engine process serves every configured model; a request's `model` picks one (an unknown name
is 404 model_not_found), /v3/models and /v1/config list them all, as the engine reports them now (a reload may
have changed the set).
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import asdict

from flask import Flask, Response, g, request

from appliance import auth
from appliance.api.context import AppApi, not_serving
from appliance.api.errors import ApiError
from appliance.api.request import ChatRequest, CompletionRequest, chat_job, completion_job
from appliance.api.start import respond, start
from appliance.openai_api.chat import ChatShape, parse_chat
from appliance.openai_api.completions import CompletionShape, parse_completion
from appliance.openai_api.embeddings import register as register_embeddings
from appliance.openai_api.responses_routes import register as register_responses
from appliance.openai_api.validation import OPENAI, OVMS, Dialect, parse_tokenize
from appliance.protocol import ModelInfo

log = logging.getLogger("appliance.http")

# each API prefix and whose defaults its completions and chat requests get (validation.Dialect): /v3 is OVMS's API
# (/v3/v1/... its deprecated spelling), /v1 OpenAI's, where OpenAI's clients and frameworks point
PREFIXES = {"/v3": OVMS, "/v1": OPENAI, "/v3/v1": OVMS}


class OpenAIRoutes:
    """OVMS's and OpenAI's routes over the shared route context (appliance/api/context.py)."""

    def __init__(self, api: AppApi):
        self.api = api
        self.settings, self.client, self.limits = api.settings, api.client, api.limits

    # ---- generation endpoints
    def completions(self, dialect: Dialect):
        req = parse_completion(self.api.json_body(), self.limits, dialect)
        return self.generate(
            req, lambda params, rid: completion_job(req, params, rid), CompletionShape(req.edge.return_raw_tokens)
        )

    def chat(self, dialect: Dialect):
        req = parse_chat(self.api.json_body(), self.limits, dialect)
        # its parsers: how this model writes tool calls and reasoning
        status = self.api.ready_status(req.edge.model, fresh=False)
        req = self.api.with_images(req)  # remote image URLs, once the model is known to serve
        shape = ChatShape.for_request(req, status.tool_parser, status.reasoning_parser)
        return self.generate(
            req, lambda params, rid: chat_job(req, params, rid, status.tool_parser, self.limits), shape
        )

    def generate(self, req: CompletionRequest | ChatRequest, make_job, shape):
        gen = req.edge
        status = self.api.ready_status(gen.model, fresh=False)
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
        req = parse_tokenize(self.api.json_body(), self.limits)
        self.api.ready_status(req.model, fresh=False)
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
            not_serving(model_id, "unknown", None)
        return self.model_object(info)

    def live(self):
        return {}

    def ready(self):
        """OVMS: the server is ready when every configured model is. Open to all: no error details (ready_status)."""
        for info in self.client.models():
            if info.state != "ready":
                not_serving(info.name, info.state, None)
        return {}

    def model_ready(self, name: str):
        self.api.ready_status(name)
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


def error_response(exc: ApiError) -> Response:
    """OpenAI's error shape: the app's own, for every route no other API claims."""
    g.error_type = exc.type
    return Response(json.dumps(exc.body()), status=exc.status, mimetype="application/json")


def register(app: Flask, api: AppApi) -> None:
    """OpenAI's and OVMS's routes under each prefix (PREFIXES: whose defaults each gets), the Responses and
    embedding routes, and OVMS's health, config, reload and metrics endpoints."""
    routes = OpenAIRoutes(api)
    for prefix, dialect in PREFIXES.items():
        for name, path, view in (
            ("completions", "completions", routes.completions),
            ("chat", "chat/completions", routes.chat),
        ):
            # `defaults`: the generation view's argument, its request's dialect
            app.add_url_rule(f"{prefix}/{path}", name + prefix, view, methods=["POST"], defaults={"dialect": dialect})
        app.add_url_rule(
            f"{prefix}/tokenize", view_func=routes.tokenize, methods=["POST"], endpoint=f"tokenize{prefix}"
        )
        app.add_url_rule(f"{prefix}/models", view_func=routes.models, methods=["GET"], endpoint=f"models{prefix}")
        app.add_url_rule(
            f"{prefix}/models/<path:model_id>", view_func=routes.model, methods=["GET"], endpoint=f"model{prefix}"
        )
    register_responses(app, api, tuple(PREFIXES))
    register_embeddings(app, api, tuple(PREFIXES))  # /v3/embeddings, /v3/rerank
    app.add_url_rule("/v2/health/live", view_func=routes.live, methods=["GET"])
    app.add_url_rule("/v2/health/ready", view_func=routes.ready, methods=["GET"])
    app.add_url_rule("/v2/models/<path:name>/ready", view_func=routes.model_ready, methods=["GET"])
    app.add_url_rule("/v1/config", view_func=routes.config, methods=["GET"])
    app.add_url_rule("/v1/config/reload", view_func=routes.reload, methods=["POST"])
    app.add_url_rule("/metrics", view_func=routes.metrics, methods=["GET"])
