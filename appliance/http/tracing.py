"""A worker's OpenTelemetry spans (appliance/tracing.py says when tracing is on): one SERVER span per request,
from the WSGI call to the end of the response body (a stream's last event written), child of the caller's span
when the request carries a W3C `traceparent` (or what OTEL_PROPAGATORS reads); its trace context goes with the
request's job to the engine process (protocol.Job.trace), whose spans of the job are its children.

Attributes: `http.request.method` / `http.method`, `http.route` (the Flask rule, as /metrics labels it),
`http.response.status_code` / `http.status_code`, `gen_ai.request.model` (a job's model), `appliance.api`
(openai, anthropic, ollama, responses), `error.type` (the error's OpenAI type); status Error for a 4xx or 5xx
answer and for a response whose writing failed half-way (a send timeout, a reset). A client the app sees leave
(streaming.ClientGone) ends its stream early but normally: the engine's job span says it was cancelled. Never a
header, the body or a prompt. Health probes and /metrics get no span (edge.is_probe): they are polled, not served.

Installed in `EdgeWorker.init_process` (after the fork) and `load_wsgi` only when tracing is on; off, the worker
runs without this module's code on a request's path (the engine client's `on_job` stays None).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from appliance import tracing
from appliance.http import edge
from appliance.http.client import EngineClient
from appliance.protocol import Job
from appliance.settings import ServeSettings

SPAN_NAME = "HTTP {method}"  # until the route is known; then "{method} {route}" (OpenTelemetry's HTTP convention)


def api_of(route: str) -> str | None:
    """Which client API a Flask rule belongs to."""
    if route.startswith("/api/"):
        return "ollama"
    if route.startswith("/v1/messages"):
        return "anthropic"
    if "/responses" in route:
        return "responses"
    if route.endswith(("/completions", "/tokenize", "/models", "/models/<path:model_id>")):
        return "openai"
    return None


class EnvironGetter:
    """OpenTelemetry's Getter over a WSGI environ: header `traceparent` is HTTP_TRACEPARENT."""

    @staticmethod
    def get(environ: dict, key: str) -> list[str] | None:
        value = environ.get("HTTP_" + key.upper().replace("-", "_"))
        return [value] if isinstance(value, str) else None

    @staticmethod
    def keys(environ: dict) -> list[str]:
        return [k[5:].lower().replace("_", "-") for k in environ if k.startswith("HTTP_")]


class HttpTracing:
    """The worker's tracer and the hooks that make and fill its request spans."""

    def __init__(self, tracer_provider: Any):
        from opentelemetry import context, propagate, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = tracer_provider
        self.tracer = tracer_provider.get_tracer("appliance.http")
        self._context, self._propagate, self._trace = context, propagate, trace
        self._w3c = TraceContextTextMapPropagator()
        self._getter = EnvironGetter()
        self._status = trace.Status, trace.StatusCode
        self._server = trace.SpanKind.SERVER

    # ---- the engine client: a job's trace context
    def on_job(self, job: Job) -> None:
        """Before a job is sent: its model on the request's span, and that span's context in the job (sampled
        spans only: the engine has nothing to add to a trace that is not kept)."""
        span = self._trace.get_current_span()
        if not span.is_recording():
            return
        if job.model:
            span.set_attribute("gen_ai.request.model", job.model)
        carrier: dict[str, str] = {}
        self._w3c.inject(carrier)
        job.trace = carrier or None

    # ---- the Flask app: what only it knows (the route, the error type)
    def after_request(self, response: Any) -> Any:
        from flask import g, request

        span = self._trace.get_current_span()
        if span.is_recording():
            if request.url_rule is not None:  # no route (a 404): the span keeps its name "HTTP {method}"
                route = request.url_rule.rule
                span.update_name(f"{request.method} {route}")
                span.set_attribute("http.route", route)
                api = api_of(route)
                if api:
                    span.set_attribute("appliance.api", api)
            error_type = g.get("error_type")
            if error_type:
                span.set_attribute("error.type", str(error_type))
        return response

    # ---- WSGI: the span around the app and its response body
    def wrap(self, app: Callable) -> Callable:
        def traced(environ: dict, start_response: Callable) -> Iterable:
            if edge.is_probe(environ.get("PATH_INFO", "")):
                return app(environ, start_response)
            method = environ.get("REQUEST_METHOD", "")
            parent = self._propagate.extract(environ, getter=self._getter)
            span = self.tracer.start_span(
                SPAN_NAME.format(method=method),
                context=parent,
                kind=self._server,
                attributes={"http.request.method": method, "http.method": method},
            )
            status = [0]

            def start(status_line: str, headers: list, exc_info: Any = None) -> Callable:
                status[0] = int(status_line.split(" ", 1)[0])
                return start_response(status_line, headers, exc_info)

            token = self._context.attach(self._trace.set_span_in_context(span, parent))
            try:
                body = app(environ, start)
            except BaseException as exc:
                self._finish(span, status[0], f"{type(exc).__name__} before the response")
                raise
            finally:
                self._context.detach(token)
            return TracedBody(body, lambda error: self._finish(span, status[0], error))

        return traced

    def _finish(self, span: Any, status: int, error: str | None) -> None:
        if status:
            span.set_attribute("http.response.status_code", status)
            span.set_attribute("http.status_code", status)
        Status, StatusCode = self._status
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        elif status >= 400:
            span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
        span.end()


class TracedBody:
    """A response body that ends its request's span when the server closes it: after the last item was written,
    or early (the response abandoned: `done` gets why)."""

    def __init__(self, body: Iterable, done: Callable[[str | None], None]):
        self.body = body
        self.done: Callable[[str | None], None] | None = done
        self.finished = False  # the body was iterated to its end
        self.error: str | None = None

    def __iter__(self) -> Iterator:
        try:
            yield from self.body
        except Exception as exc:
            self.error = f"{type(exc).__name__} while streaming the response"
            raise
        self.finished = True

    def close(self) -> None:
        try:
            close = getattr(self.body, "close", None)
            if close is not None:
                close()
        finally:
            done, self.done = self.done, None
            if done is not None:
                done(self.error or (None if self.finished else "response not completed"))


def setup(settings: ServeSettings) -> HttpTracing | None:
    """In a forked worker: its provider and hooks when tracing is on, else None (and nothing imported)."""
    url = tracing.endpoint(settings.otlp_endpoint)
    if url is None:
        return None
    hooks = HttpTracing(tracing.provider("http-worker", url))
    EngineClient.on_job = hooks.on_job
    return hooks
