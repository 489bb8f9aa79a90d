"""The Flask app each gunicorn worker runs (`appliance.wsgi.app:create_app()`, appliance/http/gunicorn_conf.py):
one route context (appliance/api/context.py) and every client API's routes over it, the guards every request
passes, the request record and `X-Request-Id` of every answer, and the error shape of routes no API claims
(OpenAI's). The only module that knows every API: a new one is a package beside them and a line here.
"""

from __future__ import annotations

import time
from typing import cast

from flask import Flask, Response, g, request
from flask.json.provider import DefaultJSONProvider

from appliance import web
from appliance.anthropic_api.routes import blueprint as anthropic_blueprint
from appliance.api.context import AppApi, error_handlers
from appliance.http.client import EngineClient
from appliance.ollama_api.routes import blueprint as ollama_blueprint
from appliance.openai_api.routes import error_response
from appliance.openai_api.routes import register as register_openai
from appliance.protocol import HttpRecord
from appliance.settings import ServeSettings


def create_app(settings: ServeSettings | None = None, client: EngineClient | None = None) -> Flask:
    """Gunicorn calls this in each worker (`appliance.wsgi.app:create_app()`): settings come from the runtime
    directory `appliance serve` made."""
    settings = settings or ServeSettings.load()
    client = client or EngineClient(settings.socket_path, settings.authkey())
    api = AppApi(settings, client, public=web.is_public)  # the web page's static files: no data in them

    app = Flask("appliance")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    cast(DefaultJSONProvider, app.json).sort_keys = False

    register_openai(app, api)  # OVMS's and OpenAI's: /v3, /v1, /v3/v1, health, config, metrics
    app.register_blueprint(anthropic_blueprint(api))  # Anthropic's Messages API: /v1/messages
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

    error_handlers(app, error_response, settings.max_body_bytes)
    return app
