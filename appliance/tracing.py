"""OpenTelemetry traces, off unless configured: whether they are on, where they go, and the one TracerProvider of
a process. Shared by the HTTP workers (appliance/http/tracing.py: a span per request) and the engine process
(appliance/server/tracing.py: a request's queue, prefill, decode and stream spans, written when it ends).

On when `--otlp-endpoint URL` is given (APPLIANCE_OTLP_ENDPOINT), or when the standard variables name a collector
(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT); off with OTEL_SDK_DISABLED=true or
OTEL_TRACES_EXPORTER=none, whatever else is set. Everything else the SDK reads itself: the service name
(OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES; "appliance" when neither names one), the sampler
(OTEL_TRACES_SAMPLER / _ARG, parent-based always-on by default), the batch processor (OTEL_BSP_*), the exporter's
headers, timeout, compression and certificates (OTEL_EXPORTER_OTLP_[TRACES_]*), the propagators of incoming
requests (OTEL_PROPAGATORS). The exporter is OTLP over HTTP with protobuf (`opentelemetry-exporter-otlp-proto-http`):
a gRPC protocol or another exporter is refused at start-up (one line, exit 78), not silently ignored.

Off costs nothing: nothing here imports OpenTelemetry at module level, `provider()` is the only import of the
SDK, and a process with tracing off never calls it (tests/server/test_tracing.py checks no `opentelemetry` module is
loaded). Each process builds its own provider after it started (a gunicorn worker after its fork: the batch
processor's export thread does not survive a fork), and exports from that thread, never on a request's path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from appliance import __version__
from appliance.settings import ConfigError

TRACES_PATH = "/v1/traces"
SERVICE_NAME = "appliance"
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
PROTOCOL = "http/protobuf"

# The trace context a job carries from its HTTP worker to the engine process (protocol.Job.trace): W3C
# trace-context headers, whatever the incoming requests' propagators are.
TRACEPARENT, TRACESTATE = "traceparent", "tracestate"


def traces_url(endpoint: str) -> str:
    """--otlp-endpoint's URL as the exporter posts to: a collector's base URL (http://host:4318, as
    OTEL_EXPORTER_OTLP_ENDPOINT) gets /v1/traces; one that already ends with it is kept."""
    url = endpoint.strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"--otlp-endpoint {endpoint!r}: give the collector's http:// or https:// URL")
    return url if parts.path.rstrip("/").endswith(TRACES_PATH) else url.rstrip("/") + TRACES_PATH


def endpoint(flag: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """None: tracing is off. Else the URL spans are posted to ("" when the exporter takes it from the OTEL_*
    variables itself). ConfigError for a setting that asks for something this exporter cannot do."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return None
    if not flag and not any(env.get(name, "").strip() for name in ENDPOINT_VARIABLES):
        return None
    if exporter not in ("", "otlp"):
        raise ConfigError(f"OTEL_TRACES_EXPORTER={exporter}: the appliance exports traces with otlp only (or none)")
    protocol = next((env[name].strip().lower() for name in PROTOCOL_VARIABLES if env.get(name, "").strip()), PROTOCOL)
    if protocol != PROTOCOL:
        raise ConfigError(f"OTLP protocol {protocol}: the appliance exports traces over {PROTOCOL} only")
    return traces_url(flag) if flag else ""


def provider(role: str, url: str) -> Any:
    """This process's TracerProvider (`role`: http-worker or engine, a resource attribute), exporting in batches
    from its own thread to `url` ("" : where the OTEL_* variables say). Imports the SDK: call it only when
    `endpoint()` said tracing is on."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.version": __version__, "appliance.process": role})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):  # neither variable named it
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    tracer_provider = TracerProvider(resource=resource)  # the sampler from OTEL_TRACES_SAMPLER
    tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url or None)))
    return tracer_provider


def sampled(carrier: Mapping[str, str] | None) -> bool:
    """A W3C carrier whose traceparent has the sampled flag (version-traceid-spanid-flags)."""
    parent = (carrier or {}).get(TRACEPARENT, "")
    try:
        return len(parent) >= 55 and int(parent[53:55], 16) & 1 == 1
    except ValueError:
        return False
