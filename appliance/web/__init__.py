"""The built-in web page at `/`: the box's status, live plots of its own metrics, and a chat playground, served by
the HTTP workers as static files from this package (no build step, nothing fetched from anywhere but the box).

What is served and why:
* `/` (index.html), `/ui/<file>` (app.js, style.css, favicon.svg) and `/favicon.ico` are static and public:
  they carry no data (no model name, no key, no metric), so they need no API key; the Host allow-list still
  applies. Everything the page shows comes from the API it calls with the user's key: `/metrics` (Prometheus
  text, parsed in the browser), `/v1/status` (below), and `/v3/chat/completions` for the playground. A key is
  asked for once, when a call answers 401, kept in the tab's `sessionStorage` and sent as `Authorization: Bearer`
  (never in a URL); a refused key is said so in the dialog.
* Every page response carries a Content-Security-Policy that allows only this origin (`default-src 'self'`, no
  inline script or style, no framing, no form posts elsewhere), plus nosniff and no-referrer. URLs in the page
  are relative, so it works under TLS and behind a proxy's path prefix alike.
* `/v1/status` (keyed, like every API route): what /v1/config and /v1/models do not say, from what the worker
  already holds: the version, the server's start time (the engine socket's key file, which `appliance serve`
  writes once at start), the CPU's vector ISA (appliance/cpu_isa.py, read once per worker), and each model's
  state, backend (export), weight format (precision), device and context. It costs one MODELS call to the engine
  process, the status of a ready model being the worker's kept one (EngineClient.serving_status): no round trip
  per model.
* The plots are drawn on a canvas by app.js (about 100 lines): a plotting library would be a vendored file of
  tens of KB to pin and audit for five line charts.
* Polling cost: the page asks for /metrics every 2 s and /v1/status every 10 s, only while the tab is visible;
  bench/web_page.py measures tokens/s with the page open against closed (docs/performance.md).
"""

from __future__ import annotations

import os
from functools import cache
from importlib import resources
from pathlib import Path

from flask import Blueprint, Response

from appliance import __version__, cpu_isa
from appliance.api.context import AppApi
from appliance.api.errors import ApiError
from appliance.settings import AUTHKEY_FILE

# The files of the page: name -> mimetype. A fixed table, so no request path ever reaches the file system.
ASSETS = {
    "app.js": "text/javascript",
    "style.css": "text/css",
    "favicon.svg": "image/svg+xml",
}
INDEX = "index.html"
# no key needed (no data in them); /favicon.ico: what a browser asks for on its own (else a 401 in its console)
PUBLIC_PATHS = frozenset({"/", "/favicon.ico", *(f"/ui/{name}" for name in ASSETS)})

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidated each load: an upgrade's new page is never mixed with an old script
}


def is_public(path: str) -> bool:
    """The page's own files: served without an API key (appliance/api/context.py `AppApi.authorize`)."""
    return path in PUBLIC_PATHS


@cache
def asset(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


@cache
def isa() -> dict:
    found = cpu_isa.detect()
    return {"name": found.name, "flags": list(found.flags)}


def _page(body: bytes, mimetype: str) -> Response:
    return Response(body, mimetype=mimetype, headers=PAGE_HEADERS)


def blueprints(api: AppApi) -> tuple[Blueprint, Blueprint]:
    """The page's files ("web") and /v1/status ("status", an API route: docs/openapi.json documents it), on the
    app's `Api` (its auth runs before each: the public paths above skip the key)."""
    bp = Blueprint("web", __name__)
    api_bp = Blueprint("status", __name__)
    started = None  # when `appliance serve` started: it writes the socket's key once, first (a reload rewrites
    if api.settings.runtime_dir:  # the settings file, never the key)
        try:
            started = os.stat(Path(api.settings.runtime_dir) / AUTHKEY_FILE).st_mtime
        except OSError:
            pass

    @bp.get("/")
    def index() -> Response:
        return _page(asset(INDEX), "text/html")

    @bp.get("/favicon.ico")
    def favicon() -> Response:
        return _page(asset("favicon.svg"), ASSETS["favicon.svg"])

    @bp.get("/ui/<name>")
    def ui(name: str) -> Response:
        if name not in ASSETS:
            raise ApiError(404, f"Route GET /ui/{name} does not exist")
        return _page(asset(name), ASSETS[name])

    @api_bp.get("/v1/status")
    def status() -> dict:
        models = []
        for info in api.client.models():
            entry: dict = {"name": info.name, "state": info.state}
            if info.state == "ready":
                s = api.client.serving_status(info.name)
                entry |= {
                    "backend": s.backend,
                    "weight_format": s.weight_format,
                    "device": s.device,
                    "max_context": s.max_context,
                    "tool_parser": s.tool_parser,
                    "reasoning_parser": s.reasoning_parser,
                }
            elif info.error:
                entry["error"] = info.error
            models.append(entry)
        return {"version": __version__, "started": started, "cpu_isa": isa(), "models": models}

    return bp, api_bp
