"""The /metrics page as ServerMetrics renders it (appliance/server/metrics.py), read back with prometheus_client's own
text parser: every family dashboards and the autoscalers use, with its type and labels (the names are public: the
docs, deploy/ and OVMS-style dashboards name them); no `_created` samples; the engine gauges (one unlabelled series
for the server, one per model) only from the snapshot a scrape hands in; and each ServerMetrics counts alone (its
own registry: the tests and the supervisor make several in one process). The same page from a real server:
test_metrics_histograms.py, test_server_e2e.py."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from appliance.protocol import DROPPED_ROUTE
from appliance.server.metrics import ServerMetrics

# name (as exposed, a counter's with _total) -> (type, label names of its series besides `le` and `model`)
FAMILIES = {
    "appliance_ready": ("gauge", set()),
    "appliance_model_kernels": ("gauge", {"kernels"}),
    "appliance_queue_depth": ("gauge", set()),
    "appliance_running_sequences": ("gauge", set()),
    "appliance_kv_cache_blocks_used": ("gauge", set()),
    "appliance_kv_cache_blocks_total": ("gauge", set()),
    "appliance_kv_cache_usage_ratio": ("gauge", set()),
    "appliance_preemptions_total": ("counter", set()),
    "appliance_speculative_draft_tokens_total": ("counter", set()),
    "appliance_speculative_accepted_tokens_total": ("counter", set()),
    "appliance_speculative_acceptance_ratio": ("gauge", set()),
    "appliance_kv_disk_hit_tokens_total": ("counter", set()),
    "appliance_kv_disk_read_bytes_total": ("counter", set()),
    "appliance_kv_disk_written_bytes_total": ("counter", set()),
    "appliance_kv_disk_load_seconds_total": ("counter", set()),
    "appliance_kv_disk_corrupt_blocks_total": ("counter", set()),
    "appliance_kv_disk_dropped_writes_total": ("counter", set()),
    "appliance_kv_disk_write_errors_total": ("counter", set()),
    "appliance_kv_disk_expired_blocks_total": ("counter", set()),
    "appliance_kv_disk_bytes": ("gauge", set()),
    "appliance_image_encodes_total": ("counter", set()),
    "appliance_image_cache_hits_total": ("counter", set()),
    "appliance_image_cache_bytes": ("gauge", set()),
    "appliance_http_requests_total": ("counter", {"route", "method", "status"}),
    "appliance_http_errors_total": ("counter", {"status", "type"}),
    "appliance_http_dropped_total": ("counter", {"reason"}),
    "appliance_sequences_finished_total": ("counter", {"reason"}),
    "appliance_sequences_cancelled_total": ("counter", set()),
    "appliance_requests_rejected_total": ("counter", {"reason"}),
    "appliance_prompt_tokens_total": ("counter", set()),
    "appliance_generation_tokens_total": ("counter", set()),
    "appliance_time_to_first_token_seconds": ("histogram", set()),
    "appliance_inter_token_latency_seconds": ("histogram", set()),
    "appliance_request_duration_seconds": ("histogram", set()),
    "appliance_model_loads_total": ("counter", {"reason", "result"}),
    "appliance_model_unloads_total": ("counter", {"reason"}),
    "appliance_model_load_seconds": ("histogram", set()),
    # embeddings and rerank (appliance/server/encoders/embeddings.py)
    "appliance_encoder_requests_total": ("counter", {"task", "outcome"}),
    "appliance_encoder_tokens_total": ("counter", {"task"}),
    "appliance_encoder_request_duration_seconds": ("histogram", set()),
    "appliance_encoder_batch_inputs": ("histogram", set()),
    "appliance_encoder_batch_tokens": ("histogram", set()),
    "appliance_encoder_forward_seconds": ("histogram", set()),
}
STATS = {
    "queued": 2,
    "running": 3,
    "kv_blocks_used": 10,
    "kv_blocks_total": 40,
    "preemptions": 1,
    "kernels": "openvino",
}


def filled() -> ServerMetrics:
    """Every family with a sample: as the engine service and the job runner record them."""
    m = ServerMetrics()
    m.record_http("/v3/completions", "POST", 200, None)
    m.record_http("/v3/completions", "POST", 429, "rate_limit_error")
    m.record_http(DROPPED_ROUTE, "budget_shed", 2, None)
    m.sequences.labels("stop").inc()
    m.rejected.labels("queue_full").inc()
    m.cancelled.inc()
    m.prompt_tokens.inc(5)
    m.generated_tokens.inc(3)
    for histogram in (m.ttft, m.itl, m.e2e):
        histogram.observe(0.02)
    m.model_loads.labels("demand", "ok").inc()
    m.model_unloads.labels("keep_alive").inc()
    m.model_load_seconds.observe(3.0)
    m.encode_requests.labels("embed", "ok").inc()
    m.encode_tokens.labels("embed").inc(12)
    m.encode_duration.observe(0.05)
    m.observe_encoder_batch(4, 128, 0.04)
    return m


def parsed(text: str) -> dict:
    """{exposed name: (type, samples)}; the parser names a counter's family without `_total`."""
    return {
        f.name + ("_total" if f.type == "counter" else ""): (f.type, f.samples)
        for f in text_string_to_metric_families(text)
    }


def test_every_family_with_its_type_and_labels_and_no_created_samples():
    text = filled().render({"a": (True, STATS), "b": (False, None)})
    families = parsed(text)
    assert set(families) == set(FAMILIES)
    for name, (kind, samples) in families.items():
        assert kind == FAMILIES[name][0], name
        labels = {k for s in samples for k in s.labels} - {"le", "model"}
        assert labels == FAMILIES[name][1], (name, labels)
        assert not [s.name for s in samples if s.name.endswith("_created")], name
    assert "_created" not in text
    assert "# HELP appliance_http_dropped_total Connections the HTTP edge closed or refused" in text


def test_engine_gauges_come_from_the_scraped_snapshot_per_model_and_summed():
    m = ServerMetrics()
    c = {**STATS, "kv_blocks_used": 30, "kernels": "appliance-avx2"}
    text = m.render({"a": (True, STATS), "b": (False, None), "c": (True, c)})
    values = {(s.name, s.labels.get("model")): s.value for _, samples in parsed(text).values() for s in samples}
    # which kernels run each loaded model's low-bit MatMuls, as a label (none for a model still loading)
    kernels = {s.labels["model"]: s.labels["kernels"] for s in parsed(text)["appliance_model_kernels"][1]}
    assert kernels == {"a": "openvino", "c": "appliance-avx2"}
    assert values[("appliance_ready", None)] == 0  # not every model is ready
    assert (values[("appliance_ready", "a")], values[("appliance_ready", "b")]) == (1, 0)
    assert values[("appliance_queue_depth", None)] == 4 and values[("appliance_queue_depth", "b")] == 0
    assert values[("appliance_kv_cache_usage_ratio", None)] == 40 / 80  # of the summed blocks
    assert values[("appliance_kv_cache_usage_ratio", "c")] == 30 / 40
    assert values[("appliance_preemptions_total", None)] == 2
    # outside a scrape the registry holds no engine snapshot: no stale gauges
    assert "appliance_ready" not in {f.name for f in m.registry.collect()}


def test_each_instance_counts_alone():
    one, two = filled(), ServerMetrics()
    two.record_http("/metrics", "GET", 200, None)
    a, b = (parsed(m.render({}))["appliance_http_requests_total"][1] for m in (one, two))
    assert {s.labels["route"] for s in a} == {"/v3/completions"}
    assert [(s.labels, s.value) for s in b] == [({"route": "/metrics", "method": "GET", "status": "200"}, 1)]
