"""OpenTelemetry traces (appliance/tracing.py, appliance/http/tracing.py, appliance/server/tracing.py) against a
real OTLP/HTTP endpoint: appliance/testing/otlp.py's receiver on 127.0.0.1 takes what the exporters post
(protobuf ExportTraceServiceRequest, decoded with opentelemetry-proto's classes), and a real `appliance serve`
(one worker) sends it the spans of real requests.

What a trace must show: the caller's span (W3C traceparent) -> the worker's SERVER span -> the engine's job ->
queue, prefill, decode, stream, in that order and nested, with the engine's own timestamps (equal to the response's
time_info) and the metrics' (the time-to-first-token and inter-token histograms measure the same stretches), the
token counts and finish reason as attributes, and never the prompt. Off, nothing is exported and no OpenTelemetry
module is loaded.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from appliance import tracing
from appliance.settings import ConfigError
from appliance.testing.otlp import OtlpReceiver, Span
from tests.helpers import Server, sse_events

ROOT = Path(__file__).resolve().parents[2]
SERVER_KIND, INTERNAL_KIND, ERROR = 2, 1, 2  # OTLP's SpanKind and StatusCode numbers
ENGINE_SPANS = ("queue", "prefill", "decode", "stream")
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # ms between batches (5 s by default)
UPB = "google/_upb/_message"  # protobuf's C extension: the exporter's encoder loads it, nothing else in a worker


# ---------------------------------------------------------------- when tracing is on (no server)


def test_endpoint_is_off_unless_configured():
    assert tracing.endpoint(None, {}) is None
    assert tracing.endpoint("http://collector:4318", {}) == "http://collector:4318/v1/traces"
    assert tracing.endpoint("https://c.example/otlp/", {}) == "https://c.example/otlp/v1/traces"
    assert tracing.endpoint("http://c:4318/v1/traces", {}) == "http://c:4318/v1/traces"
    # the standard variables: the exporter reads them itself
    assert tracing.endpoint(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == ""
    assert tracing.endpoint(None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}) == ""
    assert tracing.endpoint(None, {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) is None  # no collector named
    # the SDK's switches turn it off, the flag included
    assert tracing.endpoint("http://c:4318", {"OTEL_SDK_DISABLED": "true"}) is None
    assert tracing.endpoint(None, {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}) is None
    assert tracing.endpoint("http://c", {"OTEL_TRACES_EXPORTER": "otlp"}) == "http://c/v1/traces"


@pytest.mark.parametrize(
    "flag, env, words",
    [
        ("collector:4318", {}, "http:// or https://"),
        ("http://c:4318", {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "grpc"),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, "grpc"),
        ("http://c:4318", {"OTEL_TRACES_EXPORTER": "zipkin"}, "otlp only"),
    ],
)
def test_what_the_exporter_cannot_do_is_refused(flag, env, words):
    with pytest.raises(ConfigError, match=words):
        tracing.endpoint(flag, env)


def test_serve_refuses_a_bad_endpoint_in_one_line(model_dir):
    result = subprocess.run(
        [sys.executable, "-m", "appliance.cli", "serve", "--model", str(model_dir), "--otlp-endpoint", "c:4318"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
    )
    assert result.returncode == 78, result.stderr
    assert "--otlp-endpoint" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("sampler", ["parentbased_always_on", "always_off"])
def test_the_provider_takes_the_standard_variables(monkeypatch, sampler):
    """Tracing on through OTEL_EXPORTER_OTLP_TRACES_ENDPOINT alone: the exporter posts there, the service name is
    OTEL_SERVICE_NAME's, OTEL_RESOURCE_ATTRIBUTES are kept, and OTEL_TRACES_SAMPLER decides what is recorded."""
    with OtlpReceiver() as receiver:
        for name, value in {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.base + "/v1/traces",
            "OTEL_SERVICE_NAME": "edge-7",
            "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=lab",
            "OTEL_TRACES_SAMPLER": sampler,
        }.items():
            monkeypatch.setenv(name, value)
        url = tracing.endpoint(None)
        assert url == ""
        provider = tracing.provider("engine", url)
        provider.get_tracer("t").start_span("probe").end()
        assert provider.force_flush(10_000)
        provider.shutdown()
        spans = receiver.spans()
    if sampler == "always_off":
        assert spans == []
        return
    (span,) = spans
    assert span.name == "probe"
    assert span.resource["service.name"] == "edge-7" and span.resource["deployment.environment"] == "lab"
    assert span.resource["appliance.process"] == "engine"


SETUP = """
import json, sys
from appliance.settings import ServeSettings
from appliance.http import tracing as http_tracing, worker  # what a worker imports
from appliance.server import tracing as server_tracing
settings = ServeSettings(model_dir="m", served_model_name="m", model_created=0, otlp_endpoint={flag!r})
print(json.dumps([http_tracing.setup(settings) is not None, worker.EdgeWorker is not None,
                  server_tracing.setup(settings), server_tracing._tracing is not None,
                  sorted(m for m in sys.modules if m.startswith("opentelemetry"))]))
"""


@pytest.mark.parametrize("flag", [None, "http://127.0.0.1:9/"])
def test_off_loads_no_opentelemetry_module(flag):
    """A worker's and the engine's set-up in a fresh interpreter, with no OTEL_* variable: off, nothing of
    OpenTelemetry is imported; on, the SDK is (so this test sees an import when there is one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    result = subprocess.run(
        [sys.executable, "-c", SETUP.format(flag=flag)], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
    )
    assert result.returncode == 0, result.stderr
    worker_on, _, _, engine_on, loaded = json.loads(result.stdout)
    assert (worker_on, engine_on) == (flag is not None, flag is not None)
    if flag is None:
        assert loaded == []
    else:
        assert {"opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter"} <= set(loaded)


# ---------------------------------------------------------------- a traced server


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def traced(model_dir, receiver, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        for name, value in FAST_EXPORT.items():
            mp.setenv(name, value)
        srv = Server(
            model_dir,
            tmp_path_factory.mktemp("traced") / "serve.log",
            "--workers",
            "1",
            "--otlp-endpoint",
            receiver.base,
        )
    with srv:
        yield srv


@pytest.fixture(scope="module")
def model(traced) -> str:
    return traced.model_id()


def caller() -> tuple[str, str, dict]:
    """A caller's trace and span ids and the traceparent header naming them (sampled)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, {"traceparent": f"00-{trace_id}-{span_id}-01", "tracestate": "vendor=x"}


def spans_of(receiver: OtlpReceiver, trace_id: str, names: tuple[str, ...], timeout: float = 60) -> list[Span]:
    """The trace's spans once every name in `names` has arrived (the exporters send in batches)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [s for s in receiver.spans() if s.trace_id == trace_id]
        if all(any(s.name == n for s in found) for n in names) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def one(spans: list[Span], name: str) -> Span:
    matching = [s for s in spans if s.name == name]
    assert len(matching) == 1, [(s.name, s.span_id) for s in spans]
    return matching[0]


def marker() -> str:
    return "zq" + secrets.token_hex(12)


def check_trace(spans: list[Span], span_id: str, route: str, api: str, model: str, usage: dict, finish: str):
    """The shape every traced generation has: caller -> worker -> engine job -> queue, prefill, decode, stream."""
    worker = one(spans, f"POST {route}")
    job, queue, prefill, decode, stream = (one(spans, n) for n in ("engine job", *ENGINE_SPANS))
    # parents: the caller's span, then nested
    assert worker.parent_span_id == span_id and worker.kind == SERVER_KIND
    assert job.parent_span_id == worker.span_id and job.kind == INTERNAL_KIND
    assert {s.parent_span_id for s in (queue, prefill, decode, stream)} == {job.span_id}
    assert worker.resource["appliance.process"] == "http-worker" and job.resource["appliance.process"] == "engine"
    assert worker.resource["service.name"] == "appliance"
    # in order, back to back (the engine's own timestamps), inside the job, inside the request
    assert worker.start <= job.start <= queue.start <= queue.end == prefill.start <= prefill.end == decode.start
    assert decode.start <= stream.start <= stream.end <= job.end <= worker.end
    assert decode.end <= job.end and decode.start < decode.end
    # attributes
    assert worker.attributes["http.route"] == route and worker.attributes["http.method"] == "POST"
    assert worker.attributes["http.status_code"] == 200 and worker.attributes["appliance.api"] == api
    assert worker.attributes["gen_ai.request.model"] == model == job.attributes["gen_ai.request.model"]
    assert worker.status_code != ERROR and job.status_code != ERROR
    assert (
        prefill.attributes["gen_ai.usage.input_tokens"]
        == usage["prompt"]
        == job.attributes["gen_ai.usage.input_tokens"]
    )
    assert decode.attributes["gen_ai.usage.output_tokens"] == usage["completion"]
    assert job.attributes["gen_ai.usage.output_tokens"] == usage["completion"]
    assert prefill.attributes["gen_ai.usage.cache_read.input_tokens"] == usage.get("cached", 0)
    assert (
        decode.attributes["gen_ai.response.finish_reasons"]
        == [finish]
        == job.attributes["gen_ai.response.finish_reasons"]
    )
    return worker, job, queue, prefill, decode, stream


def histogram(metrics: dict, name: str) -> tuple[float, float]:
    return metrics[f"appliance_{name}_seconds_sum"], metrics[f"appliance_{name}_seconds_count"]


def test_a_unary_chat_is_one_trace_with_the_engine_timings(traced, receiver, model):
    trace_id, span_id, headers = caller()
    secret = marker()
    before = traced.metrics()
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Repeat {secret} forever"}],
        "max_tokens": 24,
        "ignore_eos": True,
    }
    r = requests.post(traced.base + "/v3/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    after = traced.metrics()
    answer = r.json()
    usage = answer["usage"]
    spans = spans_of(receiver, trace_id, ("POST /v3/chat/completions", "engine job", *ENGINE_SPANS))
    worker, job, queue, prefill, decode, stream = check_trace(
        spans,
        span_id,
        "/v3/chat/completions",
        "openai",
        model,
        {"prompt": usage["prompt_tokens"], "completion": 24},
        "length",
    )
    # the engine's timestamps are the response's time_info (one sequence: its own)
    info = answer["time_info"]
    for span, seconds in (
        (queue, info["queue_time"]),
        (prefill, info["prompt_time"]),
        (decode, info["completion_time"]),
    ):
        assert span.seconds == pytest.approx(seconds, abs=2e-6), span.name
    # ... and the metrics measure the same stretches: arrival to first chunk (time to first token), first chunk to
    # last (the 23 inter-token gaps), from the job runner's clock (a little after the engine's)
    ttft, ttft_count = (
        a - b for a, b in zip(histogram(after, "time_to_first_token"), histogram(before, "time_to_first_token"))
    )
    itl, itl_count = (
        a - b for a, b in zip(histogram(after, "inter_token_latency"), histogram(before, "inter_token_latency"))
    )
    assert (ttft_count, itl_count) == (1, 23)
    assert ttft == pytest.approx((stream.start - queue.start) / 1e9, abs=0.05)
    assert itl == pytest.approx(stream.seconds, abs=0.05)
    assert itl == pytest.approx(decode.seconds, abs=0.05 + 0.1 * decode.seconds)
    assert decode.seconds / 23 > 1e-4  # 23 decode steps of a real model: not a zero-length span
    assert stream.attributes["appliance.chunks"] == 24
    assert secret.encode() not in receiver.raw_bytes()
    # the worker's span ends after the body is written; the engine's job span after its End went out
    assert worker.seconds >= prefill.seconds + decode.seconds


def test_a_stream_is_traced_to_its_last_event(traced, receiver, model):
    trace_id, span_id, headers = caller()
    secret = marker()
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Say {secret}"}],
        "max_tokens": 16,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = requests.post(traced.base + "/v3/chat/completions", json=body, headers=headers, stream=True, timeout=120)
    assert r.status_code == 200
    events = sse_events(r)
    usage = events[-2]["usage"]
    spans = spans_of(receiver, trace_id, ("POST /v3/chat/completions", "engine job", *ENGINE_SPANS))
    worker, job, *_, stream = check_trace(
        spans,
        span_id,
        "/v3/chat/completions",
        "openai",
        model,
        {"prompt": usage["prompt_tokens"], "completion": 16},
        "length",
    )
    assert stream.attributes["appliance.chunks"] == 16
    assert secret.encode() not in receiver.raw_bytes()


@pytest.mark.parametrize(
    "route, api, request_body, counts",
    [
        (
            "/v1/messages",
            "anthropic",
            lambda model, text: {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": text}]},
            lambda r: (r["usage"]["input_tokens"], r["usage"]["output_tokens"]),
        ),
        (
            "/api/chat",
            "ollama",
            lambda model, text: {
                "model": model,
                "stream": False,
                "options": {"num_predict": 8},
                "messages": [{"role": "user", "content": text}],
            },
            lambda r: (r["prompt_eval_count"], r["eval_count"]),
        ),
        (
            "/v1/responses",
            "responses",
            lambda model, text: {"model": model, "input": text, "max_output_tokens": 8, "store": False},
            lambda r: (r["usage"]["input_tokens"], r["usage"]["output_tokens"]),
        ),
    ],
)
def test_every_api_is_traced(traced, receiver, model, route, api, request_body, counts):
    trace_id, span_id, headers = caller()
    secret = marker()
    r = requests.post(traced.base + route, json=request_body(model, f"Hi {secret}"), headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    prompt, completion = counts(r.json())
    spans = spans_of(receiver, trace_id, (f"POST {route}", "engine job", *ENGINE_SPANS))
    worker, job, *_ = check_trace(
        spans, span_id, route, api, model, {"prompt": prompt, "completion": completion}, job_finish(spans)
    )
    assert secret.encode() not in receiver.raw_bytes()


def job_finish(spans: list[Span]) -> str:
    reasons = one(spans, "decode").attributes["gen_ai.response.finish_reasons"]
    assert reasons[0] in ("stop", "length")
    return reasons[0]


def test_a_refused_request_has_an_error_span(traced, receiver, model):
    trace_id, span_id, headers = caller()
    r = requests.post(
        traced.base + "/v3/chat/completions", json={"model": model, "messages": "no"}, headers=headers, timeout=60
    )
    assert r.status_code == 400
    worker = one(spans_of(receiver, trace_id, ("POST /v3/chat/completions",)), "POST /v3/chat/completions")
    assert worker.parent_span_id == span_id
    assert worker.status_code == ERROR and worker.attributes["http.status_code"] == 400
    assert worker.attributes["error.type"] == "invalid_request_error"


def test_a_job_the_engine_refuses_has_an_error_span(traced, receiver, model):
    trace_id, span_id, headers = caller()
    body = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}
    r = requests.post(traced.base + "/v3/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 400, r.text
    spans = spans_of(receiver, trace_id, ("POST /v3/chat/completions", "engine job"))
    worker, job = one(spans, "POST /v3/chat/completions"), one(spans, "engine job")
    assert job.parent_span_id == worker.span_id and job.status_code == ERROR and job.status_message.startswith("400")
    assert worker.status_code == ERROR
    assert not [s for s in spans if s.name in ENGINE_SPANS]  # nothing ran


def test_without_a_caller_the_request_starts_the_trace(traced, receiver, model):
    secret = marker()
    body = {"model": model, "messages": [{"role": "user", "content": secret}], "max_tokens": 2}
    r = requests.post(traced.base + "/v3/chat/completions", json=body, timeout=60)
    assert r.status_code == 200
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        roots = [s for s in receiver.spans() if s.name == "POST /v3/chat/completions" and not s.parent_span_id]
        jobs = {s.parent_span_id for s in receiver.spans() if s.name == "engine job"}
        if [s for s in roots if s.span_id in jobs]:
            break
        time.sleep(0.05)
    else:
        pytest.fail("no root request span with its engine job")


def test_a_caller_that_does_not_sample_is_not_traced(traced, receiver, model):
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    headers = {"traceparent": f"00-{trace_id}-{span_id}-00"}
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert (
        requests.post(traced.base + "/v3/chat/completions", json=body, headers=headers, timeout=60).status_code == 200
    )
    _, sampled_span, sampled = caller()  # a sampled request after it: once its spans are in, the other's would be
    assert (
        requests.post(traced.base + "/v3/chat/completions", json=body, headers=sampled, timeout=60).status_code == 200
    )
    spans_of(receiver, sampled["traceparent"][3:35], ("POST /v3/chat/completions", "engine job", *ENGINE_SPANS))
    assert [s for s in receiver.spans() if s.trace_id == trace_id] == []


def test_probes_are_not_traced(traced, receiver, model):
    """Absence needs a barrier, not a pause: a sampled request sent after the probes goes out through the same
    exporters, so once its spans are in, any probe span would be too."""
    trace_id, _, headers = caller()
    for path in ("/v2/health/ready", "/v2/health/live", "/metrics"):
        assert requests.get(traced.base + path, headers=headers, timeout=30).status_code == 200
    _, _, sampled = caller()
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert (
        requests.post(traced.base + "/v3/chat/completions", json=body, headers=sampled, timeout=60).status_code == 200
    )
    spans_of(receiver, sampled["traceparent"][3:35], ("POST /v3/chat/completions", "engine job", *ENGINE_SPANS))
    assert [s for s in receiver.spans() if s.trace_id == trace_id] == []


def maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_the_traced_worker_loaded_the_exporter(traced, model):
    """The counterpart of the tracing-off check below: the /proc view sees the exporter's protobuf when it is there."""
    (worker,) = traced.workers()
    assert UPB in maps(worker)


def test_off_exports_nothing_and_loads_no_exporter(model_dir, tmp_path):
    """OTEL_SDK_DISABLED beats a configured collector: the requests export nothing, and neither the worker nor the
    engine process mapped the exporter's protobuf extension (/proc/PID/maps)."""
    with OtlpReceiver() as receiver, pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.base)
        mp.setenv("OTEL_SDK_DISABLED", "true")
        for name, value in FAST_EXPORT.items():
            mp.setenv(name, value)
        with Server(model_dir, tmp_path / "serve.log", "--workers", "1") as srv:
            model = srv.model_id()
            _, _, headers = caller()
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            assert requests.post(srv.base + "/v3/chat/completions", json=body, headers=headers, timeout=60).ok
            body["stream"] = True
            assert requests.post(srv.base + "/v3/chat/completions", json=body, headers=headers, timeout=60).ok
            time.sleep(0.5)
            (worker,) = srv.workers()
            assert UPB not in maps(worker) and UPB not in maps(srv.pid)
        assert receiver.raw == []


def test_a_stream_the_client_leaves_is_marked(traced, receiver, model):
    """A client that reads a few events and hangs up: the engine's job says it was cancelled, and what was streamed
    until then is there. (The worker notices the client gone and ends the stream itself: its span ends then.)"""
    trace_id, span_id, headers = caller()
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Count to one thousand"}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with requests.post(traced.base + "/v3/chat/completions", json=body, headers=headers, stream=True, timeout=60) as r:
        lines = r.iter_lines()
        assert sum(1 for line in (next(lines), next(lines), next(lines)) if line.startswith(b"data: ")) >= 1
    spans = spans_of(receiver, trace_id, ("POST /v3/chat/completions", "engine job", "stream"))
    worker, job, stream = (one(spans, n) for n in ("POST /v3/chat/completions", "engine job", "stream"))
    assert worker.parent_span_id == span_id and job.parent_span_id == worker.span_id
    assert job.attributes["appliance.cancelled"] is True and job.status_code != ERROR
    assert 1 <= stream.attributes["appliance.chunks"] < 400
    # the engine's job ends once its sequences are cancelled, which may be after the worker's request ended
    assert worker.start <= job.start <= stream.start <= stream.end <= job.end
