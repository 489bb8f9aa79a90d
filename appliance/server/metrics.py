"""Prometheus metrics, kept in the engine process so they are global across HTTP workers.

Workers report each HTTP request over the engine socket; the engine service records token counts and
latencies as chunks pass through it; queue/running/KV gauges are read from `Engine.stats()` at scrape time.
With several models each engine gauge has one series per model (label `model`) besides the unlabelled one, which
stays the whole server's: the sum over the models (`ready`: 1 when every model is ready; the usage ratio: of
the summed blocks). So dashboards written for one model keep working; `sum()` over the labelled series only.
Token counters and latency histograms are the server's (all models).

Why prometheus_client: the exposition used to be hand-written (counter, histogram and gauge classes, label
escaping, number formatting), which duplicated what the reference library does and had to be kept right by hand.
Now the counters and histograms are prometheus_client's, on one `CollectorRegistry` per `ServerMetrics` (never the
global default: tests and the supervisor make several), and the engine gauges come from a collector that turns
the `Engine.stats()` snapshots the engine service hands to `render` into metric families at scrape time; nothing
waits on the engine thread. The HTTP workers never import it: they send records to the engine process.
What the library changes in the text (same names, types, labels, help and buckets; Prometheus reads both alike):
values are written as floats (`1.0`, not `1`; `le="1.0"`), a series' labels are sorted by name
(`{method,route,status}`), and the `_created` samples it adds to counters and histograms are switched off with
`disable_created_metrics()` (0.26 has no per-registry switch; process-wide is right here, the engine process
holds no other prometheus_client metrics).
Cost, measured (timeit, best of 5, interleaved with the hand-written version on the same loaded 2-core box): a
scrape of 4 models, 114 HTTP series and the 3 histograms filled (256 samples, ~21 kB) takes 4.7-5.5 ms against
1.1-1.4 ms hand-written (the library validates and escapes every name and label per sample); a histogram observe
(per chunk: inter-token latency) 1.7-2.7 us against 0.65-1.0 us, a counter inc 1.0-1.3 us against 0.6-1.0 us. Both
stay far below what they serve: a scrape every 15-30 s runs on its connection's thread, and a real server's
`GET /metrics` round trip did not move (median 7.2 ms now, 8.3 ms before, 300 scrapes, one worker).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from appliance.protocol import DROP_REASONS, DROPPED_ROUTE

disable_created_metrics()

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
LOAD_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
PREFIX = "appliance_"

# Label values of the HTTP series come from fixed sets, so clients cannot add series (every response is recorded,
# 401s included, and gunicorn accepts any token as a method): other methods are "other", other routes "unmatched".
METHODS = frozenset({"GET", "POST", "HEAD", "OPTIONS", "PUT", "PATCH", "DELETE"})
_API_ROUTES = (
    "/completions",
    "/chat/completions",
    "/tokenize",
    "/models",
    "/models/<path:model_id>",
    "/responses",
    "/responses/<response_id>",
    "/responses/<response_id>/input_items",
    "/embeddings",
    "/rerank",
)
# Ollama's API (appliance/ollama_api/routes.py)
_OLLAMA_ROUTES = (
    "/api/chat",
    "/api/generate",
    "/api/tags",
    "/api/show",
    "/api/ps",
    "/api/version",
    "/api/embed",
    "/api/embeddings",
    "/api/pull",
    "/api/delete",
    "/api/<path:rest>",
)
ROUTES = frozenset(
    {f"{prefix}{route}" for prefix in ("/v3", "/v1", "/v3/v1") for route in _API_ROUTES}
    | set(_OLLAMA_ROUTES)
    | {
        "/v2/health/live",
        "/v2/health/ready",
        "/v2/models/<path:name>/ready",
        "/v1/config",
        "/v1/config/reload",
        "/metrics",
        "/v1/messages",  # Anthropic's Messages API (appliance/anthropic_api)
        "/v1/messages/count_tokens",
        "/",  # the web page (appliance/web/): its files and its status route
        "/ui/<name>",
        "/favicon.ico",
        "/v1/status",
    }
)
UNMATCHED = "unmatched"

Models = Mapping[str, tuple[bool, dict | None]]  # name -> (ready, Engine.stats() or None while it loads)


KV_DISK_COUNTERS = (
    ("kv_disk_hit_tokens_total", "Prompt tokens whose KV was loaded from the disk tier.", "kv_disk_hit_tokens"),
    ("kv_disk_read_bytes_total", "Bytes of KV blocks read from the disk tier.", "kv_disk_read_bytes"),
    ("kv_disk_written_bytes_total", "Bytes of KV blocks written to the disk tier.", "kv_disk_written_bytes"),
    ("kv_disk_load_seconds_total", "Time spent loading KV blocks from the disk tier.", "kv_disk_load_seconds"),
    (
        "kv_disk_corrupt_blocks_total",
        "Disk tier block files found torn or corrupt (deleted).",
        "kv_disk_corrupt_blocks",
    ),
    (
        "kv_disk_dropped_writes_total",
        "Disk tier writes dropped (writer queue full, or writes paused after a failed one).",
        "kv_disk_dropped_writes",
    ),
    (
        "kv_disk_write_errors_total",
        "Disk tier writes that failed (a full disk, a file-size limit, an I/O error): nothing published.",
        "kv_disk_write_errors",
    ),
    ("kv_disk_expired_blocks_total", "Disk tier blocks deleted by the age limit.", "kv_disk_expired_blocks"),
)

IMAGE_COUNTERS = (
    ("image_encodes_total", "Images run through the vision encoder.", "image_encodes"),
    (
        "image_cache_hits_total",
        "Images found in the vision feature cache (their decode and encode skipped).",
        "image_cache_hits",
    ),
)


def _family(name: str, help: str, total: float, per_model: Mapping[str, float], counter: bool = False) -> Metric:
    """The server-wide series, then one per model (label `model`)."""
    family = (CounterMetricFamily if counter else GaugeMetricFamily)(PREFIX + name, help, labels=("model",))
    family.add_metric((), total)
    for model, value in per_model.items():
        family.add_metric((model,), value)
    return family


def _speculation(drafted: dict[str, float], accepted: dict[str, float]) -> list[Metric]:
    """Speculative decoding (Engine.stats() draft_tokens / accepted_draft_tokens): draft tokens verified and
    accepted, and the acceptance ratio of all drafts so far (0 before any). A ratio near 0 means speculation only
    costs: the engine backs off per sequence, and an operator may drop --prompt-lookup / --draft-model."""
    all_drafted, all_accepted = sum(drafted.values()), sum(accepted.values())
    return [
        _family(
            "speculative_draft_tokens_total",
            "Draft tokens (prompt lookup, predictions, a draft model) the model verified.",
            all_drafted,
            drafted,
            counter=True,
        ),
        _family(
            "speculative_accepted_tokens_total",
            "Draft tokens the model accepted (each a decode step saved).",
            all_accepted,
            accepted,
            counter=True,
        ),
        _family(
            "speculative_acceptance_ratio",
            "Accepted / verified draft tokens so far (0 before any draft).",
            all_accepted / all_drafted if all_drafted else 0,
            {name: accepted[name] / drafted[name] if drafted[name] else 0 for name in drafted},
        ),
    ]


class EngineGauges:
    """A collector: the engine series of the snapshot `ServerMetrics.render` holds for its scrape (none outside
    one), built from the stats the engine service already read, so a scrape never calls into the engine."""

    def __init__(self) -> None:
        self.models: Models | None = None

    def collect(self) -> Iterator[Metric]:
        if self.models is None:
            return
        stats = {name: s or {} for name, (_, s) in self.models.items()}

        def each(key: str) -> dict[str, float]:
            return {name: s.get(key, 0) for name, s in stats.items()}

        def ratio(s: dict) -> float:
            return s.get("kv_blocks_used", 0) / s["kv_blocks_total"] if s.get("kv_blocks_total") else 0

        ready = {name: 1 if r else 0 for name, (r, _) in self.models.items()}
        used, total = sum(each("kv_blocks_used").values()), sum(each("kv_blocks_total").values())
        yield _family(
            "ready",
            "1 when the model is loaded and warmed up (unlabelled: every model).",
            min(ready.values(), default=1),
            ready,
        )
        kernels = GaugeMetricFamily(
            PREFIX + "model_kernels",
            "1 for the kernels running a loaded model's low-bit MatMuls: openvino, or appliance-<isa> for ours "
            "(appliance-<isa>/one-token: ours in single-token steps alone).",
            labels=("model", "kernels"),
        )
        for name, s in stats.items():
            if isinstance(s.get("kernels"), str):
                kernels.add_metric((name, s["kernels"]), 1)
        yield kernels
        for name, help, key in (
            ("queue_depth", "Sequences waiting for a sequence slot or KV blocks.", "queued"),
            ("running_sequences", "Sequences being decoded.", "running"),
            ("kv_cache_blocks_used", "KV cache blocks in use.", "kv_blocks_used"),
            ("kv_cache_blocks_total", "KV cache blocks allocated at load.", "kv_blocks_total"),
        ):
            values = each(key)
            yield _family(name, help, sum(values.values()), values)
        yield _family(
            "kv_cache_usage_ratio",
            "Fraction of KV cache blocks in use.",
            used / total if total else 0,
            {name: ratio(s) for name, s in stats.items()},
        )
        preemptions = each("preemptions")
        yield _family(
            "preemptions_total",
            "Sequences preempted (KV freed, recomputed later).",
            sum(preemptions.values()),
            preemptions,
            counter=True,
        )
        yield from _speculation(each("draft_tokens"), each("accepted_draft_tokens"))
        for name, help, key in KV_DISK_COUNTERS:  # the prefix cache's disk tier (runtime/kv_disk.py), when on
            values = each(key)
            yield _family(name, help, sum(values.values()), values, counter=True)
        disk = each("kv_disk_bytes")
        yield _family("kv_disk_bytes", "Bytes of KV blocks in the disk tier.", sum(disk.values()), disk)
        for name, help, key in IMAGE_COUNTERS:  # vision-language models (runtime/vision/)
            values = each(key)
            yield _family(name, help, sum(values.values()), values, counter=True)
        held = each("image_cache_bytes")
        yield _family(
            "image_cache_bytes", "Bytes of encoded images in the vision feature cache.", sum(held.values()), held
        )


class ServerMetrics:
    """Everything /metrics shows. Thread-safe; one instance in the engine process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._engine = EngineGauges()
        self.registry.register(self._engine)  # first: the engine gauges lead the page, as they always did
        self._scrape = threading.Lock()  # one scrape at a time owns the engine snapshot

        def counter(name: str, help: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, help, labels, registry=self.registry)

        def histogram(name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(PREFIX + name, help, buckets=buckets, registry=self.registry)

        self.http_requests = counter(
            "http_requests_total", "HTTP requests by route, method and status.", ("route", "method", "status")
        )
        self.http_errors = counter(
            "http_errors_total", "HTTP error responses by OpenAI error type.", ("status", "type")
        )
        self.http_dropped = counter(
            "http_dropped_total",
            "Connections the HTTP edge closed or refused (shed, timeouts, per-client caps), by reason.",
            ("reason",),
        )
        self.sequences = counter(
            "sequences_finished_total",
            "Sequences (choices) finished, by finish reason (abort = cancelled or failed).",
            ("reason",),
        )
        self.cancelled = counter(
            "sequences_cancelled_total", "Sequences cancelled because the client went away or timed out."
        )
        self.rejected = counter("requests_rejected_total", "Generation requests refused before running.", ("reason",))
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens of finished sequences.")
        self.generated_tokens = counter("generation_tokens_total", "Generated tokens.")
        self.ttft = histogram("time_to_first_token_seconds", "Request arrival to first generated token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive generated tokens.")
        self.e2e = histogram(
            "request_duration_seconds", "Sequence arrival to its last token.", LATENCY_BUCKETS + (60.0, 120.0, 300.0)
        )
        # load on demand (appliance/server/residency.py): loads by why (start-up, on demand, reload) and outcome,
        # unloads by why (idle past keep_alive, room for another model under the budget, keep_alive 0 asked)
        self.model_loads = counter("model_loads_total", "Model loads, by reason and result.", ("reason", "result"))
        self.model_unloads = counter("model_unloads_total", "Model unloads, by reason.", ("reason",))
        self.model_load_seconds = histogram(
            "model_load_seconds", "Seconds a model load (compile and warm-up) took.", LOAD_BUCKETS
        )

        # embeddings and rerank (appliance/server/encoders/embeddings.py): requests by task and outcome, their
        # tokens, and per forward of an encoder its batch (inputs, padded tokens) and duration
        self.encode_requests = counter(
            "encoder_requests_total",
            "Embeddings and rerank requests by task (embed, rerank) and outcome (ok, invalid, failed, cancelled).",
            ("task", "outcome"),
        )
        self.encode_tokens = counter(
            "encoder_tokens_total", "Tokens of answered embeddings / rerank requests.", ("task",)
        )
        self.encode_duration = histogram(
            "encoder_request_duration_seconds", "An embeddings / rerank request's queueing to its last forward."
        )
        self.encoder_batch_inputs = histogram(
            "encoder_batch_inputs", "Inputs per encoder forward.", (1, 2, 4, 8, 16, 32, 64, 128, 256)
        )
        self.encoder_batch_tokens = histogram(
            "encoder_batch_tokens",
            "Padded tokens (longest input x inputs) per encoder forward.",
            (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
        )
        self.encoder_forward = histogram("encoder_forward_seconds", "Duration of one encoder forward (a batch).")

    def observe_encoder_batch(self, inputs: int, padded_tokens: int, seconds: float) -> None:
        self.encoder_batch_inputs.observe(inputs)
        self.encoder_batch_tokens.observe(padded_tokens)
        self.encoder_forward.observe(seconds)

    def record_http(self, route: str, method: str, status: int, error_type: str | None) -> None:
        if route == DROPPED_ROUTE:
            self.http_dropped.labels(method if method in DROP_REASONS else "other").inc(max(0, int(status)))
            return
        route = route if route in ROUTES else UNMATCHED
        method = method if method in METHODS else "other"
        status = status if 100 <= status <= 599 else 0
        self.http_requests.labels(route, method, str(status)).inc()
        if status >= 400:
            self.http_errors.labels(str(status), error_type if isinstance(error_type, str) else "unknown").inc()

    def render(self, models: Models) -> str:
        """The Prometheus text (format 0.0.4). `models`: name -> (ready, Engine.stats() or None while it loads),
        in config order."""
        with self._scrape:
            self._engine.models = models
            try:
                return generate_latest(self.registry).decode()
            finally:
                self._engine.models = None
