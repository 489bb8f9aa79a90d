"""Prometheus metrics, kept in the engine process so they are global across HTTP workers.

Workers report each HTTP request over the engine socket; the engine service records token counts and
latencies as chunks pass through it; queue/running/KV gauges are read from `Engine.stats()` at scrape time.
With several models each engine gauge has one series per model (label `model`) besides the unlabelled one, which
stays the whole server's: the sum over the models (`ready`: 1 when every model is ready; the usage ratio: of
the summed blocks). So dashboards written for one model keep working; `sum()` over the labelled series only.
Token counters and latency histograms are the server's (all models).
Hand-written text exposition (format 0.0.4): a dependency for five metric types is not worth it.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import defaultdict
from collections.abc import Mapping

from appliance.protocol import DROP_REASONS, DROPPED_ROUTE

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
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
)
ROUTES = frozenset(
    {f"{prefix}{route}" for prefix in ("/v3", "/v1", "/v3/v1") for route in _API_ROUTES}
    | {
        "/v2/health/live",
        "/v2/health/ready",
        "/v2/models/<path:name>/ready",
        "/v1/config",
        "/v1/config/reload",
        "/metrics",
    }
)
UNMATCHED = "unmatched"


def _labels(names: tuple[str, ...], values: tuple) -> str:
    if not names:
        return ""
    escaped = (str(v).replace("\\", r"\\").replace('"', r'\"').replace("\n", r"\n") for v in values)
    return "{" + ",".join(f'{n}="{v}"' for n, v in zip(names, escaped)) + "}"


def _num(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return repr(float(value)) if isinstance(value, float) and not float(value).is_integer() else str(int(value))


class Counter:
    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()):
        self.name, self.help, self.labels = PREFIX + name, help, labels
        self._values: dict[tuple, float] = defaultdict(float)
        self._lock = threading.Lock()

    def inc(self, *labels, amount: float = 1.0) -> None:
        with self._lock:
            self._values[labels] += amount

    def value(self, *labels) -> float:
        return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        with self._lock:
            items = sorted(self._values.items()) or ([((), 0.0)] if not self.labels else [])
        lines += [f"{self.name}{_labels(self.labels, k)} {_num(v)}" for k, v in items]
        return lines


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.help, self.buckets = PREFIX + name, help, buckets
        self._counts = [0] * (len(buckets) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum += value

    @property
    def count(self) -> int:
        return sum(self._counts)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative = 0
        for bound, c in zip((*self.buckets, math.inf), counts):
            cumulative += c
            lines.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {cumulative}')
        lines += [f"{self.name}_sum {_num(total)}", f"{self.name}_count {cumulative}"]
        return lines


def _gauge(name: str, help: str, value: float, per_model: Mapping[str, float], kind: str = "gauge") -> list[str]:
    """The server-wide series, then one per model (label `model`)."""
    lines = [f"# HELP {PREFIX}{name} {help}", f"# TYPE {PREFIX}{name} {kind}", f"{PREFIX}{name} {_num(value)}"]
    return lines + [f"{PREFIX}{name}{_labels(('model',), (m,))} {_num(v)}" for m, v in per_model.items()]


def _speculation(drafted: dict[str, float], accepted: dict[str, float]) -> list[str]:
    """Speculative decoding (Engine.stats() draft_tokens / accepted_draft_tokens): draft tokens verified and
    accepted, and the acceptance ratio of all drafts so far (0 before any). A ratio near 0 means speculation only
    costs: the engine backs off per sequence, and an operator may drop --prompt-lookup / --draft-model."""
    lines = _gauge(
        "speculative_draft_tokens_total",
        "Draft tokens (prompt lookup, predictions, a draft model) the model verified.",
        sum(drafted.values()),
        drafted,
        "counter",
    )
    lines += _gauge(
        "speculative_accepted_tokens_total",
        "Draft tokens the model accepted (each a decode step saved).",
        sum(accepted.values()),
        accepted,
        "counter",
    )
    return lines + _gauge(
        "speculative_acceptance_ratio",
        "Accepted / verified draft tokens so far (0 before any draft).",
        sum(accepted.values()) / sum(drafted.values()) if sum(drafted.values()) else 0,
        {name: accepted[name] / drafted[name] if drafted[name] else 0 for name in drafted},
    )


class ServerMetrics:
    """Everything /metrics shows. Thread-safe; one instance in the engine process."""

    def __init__(self):
        self.http_requests = Counter(
            "http_requests_total", "HTTP requests by route, method and status.", ("route", "method", "status")
        )
        self.http_errors = Counter(
            "http_errors_total", "HTTP error responses by OpenAI error type.", ("status", "type")
        )
        self.http_dropped = Counter(
            "http_dropped_total",
            "Connections the HTTP edge closed or refused (shed, timeouts, per-client caps), by reason.",
            ("reason",),
        )
        self.sequences = Counter(
            "sequences_finished_total",
            "Sequences (choices) finished, by finish reason (abort = cancelled or failed).",
            ("reason",),
        )
        self.cancelled = Counter(
            "sequences_cancelled_total", "Sequences cancelled because the client went away or timed out."
        )
        self.rejected = Counter("requests_rejected_total", "Generation requests refused before running.", ("reason",))
        self.prompt_tokens = Counter("prompt_tokens_total", "Prompt tokens of finished sequences.")
        self.generated_tokens = Counter("generation_tokens_total", "Generated tokens.")
        self.ttft = Histogram("time_to_first_token_seconds", "Request arrival to first generated token.")
        self.itl = Histogram("inter_token_latency_seconds", "Time between consecutive generated tokens.")
        self.e2e = Histogram(
            "request_duration_seconds", "Sequence arrival to its last token.", LATENCY_BUCKETS + (60.0, 120.0, 300.0)
        )

    def record_http(self, route: str, method: str, status: int, error_type: str | None) -> None:
        if route == DROPPED_ROUTE:
            self.http_dropped.inc(method if method in DROP_REASONS else "other", amount=max(0, int(status)))
            return
        route = route if route in ROUTES else UNMATCHED
        method = method if method in METHODS else "other"
        status = status if 100 <= status <= 599 else 0
        self.http_requests.inc(route, method, str(status))
        if status >= 400:
            self.http_errors.inc(str(status), error_type if isinstance(error_type, str) else "unknown")

    def render(self, models: dict[str, tuple[bool, dict | None]]) -> str:
        """`models`: name -> (ready, Engine.stats() or None while it loads), in config order."""
        stats = {name: s or {} for name, (_, s) in models.items()}

        def each(key: str) -> dict[str, float]:
            return {name: s.get(key, 0) for name, s in stats.items()}

        def ratio(s: dict) -> float:
            return s.get("kv_blocks_used", 0) / s["kv_blocks_total"] if s.get("kv_blocks_total") else 0

        ready = {name: 1 if r else 0 for name, (r, _) in models.items()}
        used, total = each("kv_blocks_used"), each("kv_blocks_total")
        lines = _gauge(
            "ready",
            "1 when the model is loaded and warmed up (unlabelled: every model).",
            min(ready.values(), default=1),
            ready,
        )
        for name, help, key in (
            ("queue_depth", "Sequences waiting for a sequence slot or KV blocks.", "queued"),
            ("running_sequences", "Sequences being decoded.", "running"),
            ("kv_cache_blocks_used", "KV cache blocks in use.", "kv_blocks_used"),
            ("kv_cache_blocks_total", "KV cache blocks allocated at load.", "kv_blocks_total"),
        ):
            values = each(key)
            lines += _gauge(name, help, sum(values.values()), values)
        lines += _gauge(
            "kv_cache_usage_ratio",
            "Fraction of KV cache blocks in use.",
            sum(used.values()) / sum(total.values()) if sum(total.values()) else 0,
            {name: ratio(s) for name, s in stats.items()},
        )
        preemptions = each("preemptions")
        lines += _gauge(
            "preemptions_total",
            "Sequences preempted (KV freed, recomputed later).",
            sum(preemptions.values()),
            preemptions,
            "counter",
        )
        lines += _speculation(each("draft_tokens"), each("accepted_draft_tokens"))
        for metric in (
            self.http_requests,
            self.http_errors,
            self.http_dropped,
            self.sequences,
            self.cancelled,
            self.rejected,
            self.prompt_tokens,
            self.generated_tokens,
            self.ttft,
            self.itl,
            self.e2e,
        ):
            lines += metric.render()
        return "\n".join(lines) + "\n"
