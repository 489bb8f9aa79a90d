"""The HTTP edge's per-client rules as plain functions (appliance/http/edge_policy.py) and the bounded label sets
of the HTTP metrics (appliance/server/metrics.py). The same rules on a real server: test_edge_limits.py."""

from __future__ import annotations

import logging

import pytest

from appliance.http import edge_policy as ep
from appliance.protocol import DROPPED_ROUTE
from appliance.server.metrics import ServerMetrics
from appliance.testing.loopback import parse_metrics


def test_the_largest_unfinished_requests_are_shed_the_oldest_among_equals():
    sizes = {"old-big": 4_000_000, "probe": 120, "mid": 1_000_000, "new-big": 4_000_000}
    assert ep.pick_victims(sizes, 0) == []
    assert ep.pick_victims(sizes, 1) == ["old-big"]  # never the small newcomer
    assert ep.pick_victims(sizes, 4_000_001) == ["old-big", "new-big"]
    assert ep.pick_victims(sizes, 10**9) == ["old-big", "new-big", "mid", "probe"]  # all: still not enough


def test_a_client_share_is_a_quarter_of_the_budget_and_at_least_two_bodies():
    assert ep.client_budget(64 << 20, 4 << 20) == 16 << 20
    assert ep.client_budget(64 << 20, 20 << 20) == 40 << 20


def test_peer_counts_refuse_past_the_cap_on_any_key():
    counts = ep.PeerCounts(2)
    assert counts.acquire("a", "k") and counts.acquire("b", "k")
    assert not counts.acquire("c", "k")  # the key is at its cap
    assert counts["c"] == 0  # nothing counted for a refused one
    counts.release("a", "k")
    assert counts.acquire("c", "k")
    assert counts.acquire("a", None) and counts.acquire("a") and not counts.acquire("a")  # None: no such key
    unlimited = ep.PeerCounts(0)
    assert all(unlimited.acquire("x") for _ in range(1000))


def test_peer_and_key_identities():
    assert ep.peer_of(("10.0.0.7", 51234)) == "10.0.0.7"
    assert ep.peer_of("") == "local"
    assert ep.key_of(b"") == b"" and ep.key_of(b"  ") == b""
    assert ep.key_of(b" Bearer abc") == ep.key_of(b"Bearer abc") != ep.key_of(b"Bearer abd")
    assert b"abc" not in ep.key_of(b"Bearer abc")
    # the key as the key checks read it: any case of the scheme, spaces around the token
    assert ep.key_of(b"bearer abc") == ep.key_of(b"BEARER  abc ") == ep.key_of(b"Bearer abc")
    assert ep.key_of(b"Bearer") == b""  # a scheme without a token: no key


def test_drops_are_counted_all_and_logged_once_a_second_per_reason(caplog):
    now = [100.0]
    drops = ep.Drops(clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="appliance.edge"):
        for _ in range(5):
            drops.note("budget_shed", "10.0.0.1", held=10)
        drops.note("send_timeout", "10.0.0.2")
        now[0] += 1.5
        drops.note("budget_shed", "10.0.0.1")
    records = [r for r in caplog.records if r.name == "appliance.edge"]
    assert [(r.reason, r.unlogged) for r in records] == [("budget_shed", 0), ("send_timeout", 0), ("budget_shed", 4)]
    assert all(r.levelno == logging.WARNING and r.event == "edge_drop" for r in records)
    assert drops.take() == {"budget_shed": 6, "send_timeout": 1}
    assert drops.take() == {}


class FakeSocket:
    def __init__(self):
        self.timeouts: list[float] = []

    def settimeout(self, value: float) -> None:
        self.timeouts.append(value)


def test_a_paced_body_gives_each_write_what_is_left_of_the_response_budget(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(ep.time, "monotonic", lambda: clock[0])
    sock = FakeSocket()
    closed = []

    class Body:
        def __iter__(self):
            yield b"a" * 1000
            yield b"b" * 1000
            clock[0] += 10.0  # the generation's own pace: not time spent waiting on the client
            yield b"c" * 1000

        def close(self):
            closed.append(True)

    paced = ep.PacedBody(Body(), sock, send_timeout=3.0, min_rate=1000)
    items = iter(paced)
    next(items)
    clock[0] += 2.0  # the server's write of the first item waited 2 s on the client
    next(items)
    clock[0] += 2.5
    next(items)
    paced.close()
    # 3 s + 1 s per 1000 bytes sent (the item's own included), minus what the writes waited (2 s, then 4.5 s)
    assert sock.timeouts == pytest.approx([4.0, 3.0, 1.5])
    assert closed == [True]
    exhausted = ep.PacedBody([b"x"], FakeSocket(), send_timeout=1.0, min_rate=1000)
    exhausted.waited = 50.0
    list(exhausted)
    assert exhausted.sock.timeouts == [0.001]  # past the budget: the next write must not wait


def test_paced_wraps_responses_with_a_socket_only():
    def app(environ, start_response):
        return [b"ok"]

    wrapped = ep.paced(app, 3.0)
    assert wrapped({}, None) == [b"ok"]
    assert isinstance(wrapped({"gunicorn.socket": FakeSocket()}, None), ep.PacedBody)


def test_http_metric_labels_come_from_fixed_sets():
    metrics = ServerMetrics()
    for i in range(50):
        metrics.record_http("unmatched", f"ZQX{i:02d}", 401, "invalid_request_error")
        metrics.record_http(f"/made/up/{i}", "GET", 404, "invalid_request_error")
    metrics.record_http("/v3/chat/completions", "POST", 200, None)
    metrics.record_http(DROPPED_ROUTE, "budget_shed", 7, None)
    metrics.record_http(DROPPED_ROUTE, "invented", 2, None)
    text = metrics.render({})
    assert "ZQX" not in text and "/made/up" not in text
    values = parse_metrics(text)
    series = {k: v for k, v in values.items() if k.startswith("appliance_http_requests_total{")}
    assert series == {
        'appliance_http_requests_total{method="POST",route="/v3/chat/completions",status="200"}': 1,
        'appliance_http_requests_total{method="GET",route="unmatched",status="404"}': 50,
        'appliance_http_requests_total{method="other",route="unmatched",status="401"}': 50,
    }
    dropped = {k: v for k, v in values.items() if k.startswith("appliance_http_dropped_total{")}
    assert dropped == {
        'appliance_http_dropped_total{reason="budget_shed"}': 7,
        'appliance_http_dropped_total{reason="other"}': 2,
    }


def test_every_route_of_the_app_is_a_known_metric_route(tmp_path):
    from appliance.openai_api.app import create_app
    from appliance.server.metrics import ROUTES
    from appliance.settings import ServeSettings

    settings = ServeSettings(model_dir="m", served_model_name="m", model_created=0, runtime_dir=str(tmp_path))
    app = create_app(settings, client=object())  # type: ignore[arg-type]
    rules = {rule.rule for rule in app.url_map.iter_rules() if rule.endpoint != "static"}
    assert rules <= ROUTES, rules - ROUTES


def test_probe_and_401_records_go_to_the_engine_in_one_batch(monkeypatch):
    """EngineClient.record_http: a probe or a 401 costs the request no engine round trip; they are sent together,
    later, in one call. Other responses are still sent at once (posted: written before the response's first byte,
    their reply not waited for)."""
    import time

    from appliance import protocol as p
    from appliance.http import client as c

    # the 150 records below must all be made before the first flush: ~1 ms, but a loaded 2-core box can pause this
    # thread for tens of ms (0.05 s here was a flake waiting to happen)
    monkeypatch.setattr(c, "DEFER_SECONDS", 1.0)
    engine = c.EngineClient("/nonexistent", b"k")
    calls: list = []
    monkeypatch.setattr(engine, "call", lambda op, *args, **kw: calls.append((op, args)))
    monkeypatch.setattr(engine, "post", lambda op, *args: calls.append((op, args)))  # sent, its reply not awaited
    for _ in range(100):
        engine.record_http(p.HttpRecord("/v2/health/live", "GET", 200, 0.001))
    for _ in range(50):
        engine.record_http(p.HttpRecord("unmatched", "other", 401, 0.001, "invalid_request_error"))
    assert calls == []
    deadline = time.monotonic() + 10
    while sum(len(args) for _, args in calls) < 150 and time.monotonic() < deadline:
        time.sleep(0.01)
    records = [r for op, args in calls for r in args if op == p.RECORD_HTTP]
    assert len(records) == 150 and len(calls) <= 2  # one batch (two if a flush fell between the loops above)
    assert {(r.route, r.status) for r in records} == {("/v2/health/live", 200), ("unmatched", 401)}
    engine.record_http(p.HttpRecord("/v3/completions", "POST", 200, 0.1))
    assert calls[-1][1][0].route == "/v3/completions"  # at once
