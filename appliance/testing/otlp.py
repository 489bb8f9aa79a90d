"""A loopback OTLP/HTTP trace receiver for tests and bench: a real endpoint (POST /v1/traces, protobuf
ExportTraceServiceRequest, as a collector takes it) on 127.0.0.1 that records what it gets, raw and decoded with
`opentelemetry-proto`'s classes.

`with OtlpReceiver() as receiver:` serves from a thread; `receiver.base` is what --otlp-endpoint takes,
`receiver.spans()` the spans received so far (flattened, with their resource's attributes), `receiver.raw` every
request body as received (after gzip / deflate, when the exporter compressed).
"""

from __future__ import annotations

import gzip
import threading
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY = 64 << 20


@dataclass
class Span:
    """One received span, its ids as hex and its attributes as Python values."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind: 1 internal, 2 server
    start: int  # unix ns
    end: int
    attributes: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str
    resource: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return (self.end - self.start) / 1e9


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class OtlpReceiver:
    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.raw: list[bytes] = []
        self.requests: list[Any] = []
        self.paths: list[str] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(min(length, MAX_BODY))
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                with receiver._lock:
                    receiver.paths.append(self.path)
                    receiver.raw.append(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                request = ExportTraceServiceRequest()
                try:
                    request.ParseFromString(body)
                except Exception:
                    self.send_error(400)
                    return
                with receiver._lock:
                    receiver.requests.append(request)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def spans(self) -> list[Span]:
        with self._lock:
            requests = list(self.requests)
        found = []
        for request in requests:
            for resource_spans in request.resource_spans:
                resource = _attributes(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    for s in scope_spans.spans:
                        found.append(
                            Span(
                                s.name,
                                s.trace_id.hex(),
                                s.span_id.hex(),
                                s.parent_span_id.hex(),
                                s.kind,
                                s.start_time_unix_nano,
                                s.end_time_unix_nano,
                                _attributes(s.attributes),
                                s.status.code,
                                s.status.message,
                                resource,
                            )
                        )
        return found

    def raw_bytes(self) -> bytes:
        with self._lock:
            return b"".join(self.raw)
