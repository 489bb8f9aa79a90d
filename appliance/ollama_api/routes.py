"""Ollama's routes, a Flask Blueprint on the OpenAI app's `Api` (its auth, body checks, engine client and limits):
`create_app` registers it, so the same port, keys and bounds serve both APIs. Errors are Ollama's
`{"error": "..."}` with the same statuses as the OpenAI side (400 / 404 / 413 / 429 / 500 / 503).

`keep_alive` sets how long a model stays loaded for every tenant, so it is the operator's, as loading models by a
reload is: it is honoured from whoever may reload the config (auth.reload_refusal: an admin key; on a loopback
server without keys, a request that is not from a web page). From anyone else a generation's keep_alive is ignored
(the model keeps the operator's --keep-alive; it does not change the output), and an explicit unload (a request
with nothing to say and keep_alive 0) is refused 403: one client key can neither unload a model under the others
nor pin one the operator lets go (docs/ollama.md)."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

from flask import Blueprint, Response, g, request

from appliance import auth, error_shapes
from appliance.api.context import AppApi, error_handlers
from appliance.api.errors import ApiError
from appliance.api.request import chat_job, completion_job
from appliance.api.start import respond, start
from appliance.ollama_api import embed as E
from appliance.ollama_api import models as M
from appliance.ollama_api import pull
from appliance.ollama_api.requests import OllamaRequest, body_json, parse_ollama_chat, parse_ollama_generate, with_model
from appliance.ollama_api.wire import NS, OllamaGeneration, Render
from appliance.openai_api.chat import ChatShape
from appliance.openai_api.completions import CompletionShape
from appliance.params import SamplingParams
from appliance.protocol import EngineStatus, Job

OLLAMA_VERSION = "0.13.0"  # the Ollama API this adapter follows (clients gate features on it)


def _error(status: int, message: str) -> Response:
    g.error_type = "ollama_error"
    return Response(json.dumps(error_shapes.ollama(message)), status=status, mimetype="application/json")


class OllamaRoutes:
    def __init__(self, api: AppApi):
        self.api = api

    def resolve(self, name: object) -> tuple[str, EngineStatus]:
        """The served model a client's `name` or `name:latest` means, and its status (404 / 503 otherwise)."""
        if not isinstance(name, str) or not name:
            raise ApiError(400, "model is required")
        for candidate in dict.fromkeys((name, M.untagged(name))):
            status = self.api.client.serving_status(candidate)
            if status.state != "unknown":
                return candidate, self.api.ready_status(candidate, fresh=False)
        raise ApiError(404, f"model '{name}' not found")

    def chat(self):
        return self._generate(parse_ollama_chat(body_json(), self.api.limits), chat=True)

    def generate(self):
        return self._generate(parse_ollama_generate(body_json(), self.api.limits), chat=False)

    def _generate(self, req: OllamaRequest, chat: bool):
        served, status = self.resolve(req.model)
        req = with_model(req, served)
        thinks = status.reasoning_parser == "think"
        if req.think and not thinks:
            raise ApiError(400, f'"{req.model}" does not support thinking')
        render = Render(req.model, chat, keep_thinking=req.think is not False)
        refusal = auth.reload_refusal(
            self.api.settings, g.get("admin", False), request.headers.get("Origin"), "Unloading a model"
        )
        if refusal is not None:  # not the operator's: the model's own keep_alive stays (module docstring)
            if req.load_only and req.keep_alive == 0:
                raise ApiError(refusal[0], refusal[1], code="admin_key_required")
            req = dataclasses.replace(req, keep_alive=None)
        if req.load_only:  # Ollama: a request with nothing to say loads the model (keep_alive 0: unloads it)
            return self._load(req, served, render)
        if req.chat is not None:
            chat_req = req.chat
            shape: ChatShape | CompletionShape = ChatShape.for_request(
                chat_req, status.tool_parser, status.reasoning_parser
            )
            sampling, timeout, prefix = chat_req.sampling, chat_req.edge.timeout, "chatcmpl-"

            def build(params: SamplingParams, request_id: str) -> Job:
                return chat_job(chat_req, params, request_id, status.tool_parser, self.api.limits)

        else:
            completion = req.completion
            assert completion is not None
            shape = CompletionShape(False)
            sampling, timeout, prefix = completion.sampling, completion.edge.timeout, "cmpl-"

            def build(params: SamplingParams, request_id: str) -> Job:
                return completion_job(completion, params, request_id)

        def make_job(params: SamplingParams, request_id: str) -> Job:
            job = build(params, request_id)
            job.keep_alive, job.context_window = req.keep_alive, req.num_ctx
            return job

        generation = start(
            self.api.client,
            status,
            sampling,
            make_job,
            shape,
            request_id=prefix + uuid.uuid4().hex,
            model=served,
            timeout=timeout,
            generation=OllamaGeneration,
        )
        assert isinstance(generation, OllamaGeneration)
        if not req.stream:
            return generation.ollama_unary(render)
        return respond(generation.ndjson(render), "application/x-ndjson")

    def _load(self, req: OllamaRequest, served: str, render: Render) -> dict:
        """Load (or, keep_alive 0, unload) the model and say so, as Ollama: done_reason "load" / "unload"."""
        began = time.monotonic()
        reply = self.api.client.load(served, req.keep_alive)
        if reply.error is not None:
            raise ApiError(reply.error.status, reply.error.message, code=reply.error.code)
        unload = req.keep_alive == 0
        seconds = 0.0 if unload else time.monotonic() - began
        return {
            **render.body(""),
            "done": True,
            "done_reason": "unload" if unload else "load",
            **({} if unload else {"total_duration": int(seconds * NS), "load_duration": int(seconds * NS)}),
        }

    def tags(self):
        settings = self.api.settings
        return {"models": [M.tag_entry(settings, info) for info in self.api.client.models()]}

    def ps(self):
        out = []
        for info in self.api.client.models():
            if info.state == "ready" and info.loaded:  # unloaded (keep_alive, memory budget): not running
                out.append(M.ps_entry(self.api.settings, info, self.api.client.serving_status(info.name)))
        return {"models": out}

    def show(self):
        body = body_json()
        if not isinstance(body, dict):
            raise ApiError(400, "Received json is not an object")
        name = body.get("model") or body.get("name")  # `name`: Ollama's older spelling
        served, status = self.resolve(name)
        info = next((m for m in self.api.client.models() if m.name == served), None)
        if info is None:
            raise ApiError(404, f"model '{name}' not found")
        return M.show_body(self.api.settings, info, status)

    @staticmethod
    def version():
        return {"version": OLLAMA_VERSION}


def _not_served(rest: str):
    raise ApiError(404, f"{request.method} {request.path} is not served here (docs/ollama.md)")


def blueprint(api: AppApi) -> Blueprint:
    routes = OllamaRoutes(api)
    bp = Blueprint("ollama", __name__, url_prefix="/api")
    bp.add_url_rule("/chat", view_func=routes.chat, methods=["POST"])
    bp.add_url_rule("/generate", view_func=routes.generate, methods=["POST"])
    bp.add_url_rule("/tags", view_func=routes.tags, methods=["GET"])
    bp.add_url_rule("/ps", view_func=routes.ps, methods=["GET"])
    bp.add_url_rule("/show", view_func=routes.show, methods=["POST"])
    bp.add_url_rule("/version", view_func=OllamaRoutes.version, methods=["GET"])
    pull.register(bp, api)  # /api/pull, /api/delete
    E.register(bp, api)  # /api/embed, /api/embeddings
    # everything else under /api (push, create, a wrong method, ...): Ollama's 404, in its error shape
    bp.add_url_rule("/<path:rest>", view_func=_not_served, methods=["GET", "POST", "PUT", "PATCH", "DELETE"])

    error_handlers(bp, lambda exc: _error(exc.status, exc.message), api.settings.max_body_bytes)
    return bp
