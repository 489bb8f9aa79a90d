"""The latency histograms of /metrics (appliance/server/metrics.py) move with real requests: time to first token,
inter-token latency and request duration, read from a real server (tiny Llama, no speculation) before and
after a few requests run one at a time.

What is checked: the exposition is a Prometheus histogram (bounds increasing up to +Inf, cumulative counts, the
+Inf bucket equal to _count); the counts grow by what the requests imply (one first token and one duration per
request, one inter-token gap per further token: every chunk carries one token here); every new observation lies
in a bucket no higher than the request's duration as the client timed it, and no observation is negative; the
buckets agree with _sum; and the three series describe the same requests: a request's duration is its time to
first token plus its inter-token gaps, all taken from the same clock readings."""

from __future__ import annotations

import json
import math
import time

import pytest
import requests

from tests.helpers import Server, wait_idle

HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "request_duration_seconds")
TOKENS = 8  # per request (ignore_eos: exactly this many)
REQUESTS = 4  # half streamed, half unary


@pytest.fixture(scope="module")
def srv(exported, tmp_path_factory):
    export = exported("llama", "openvino", "fp32")[0]
    with Server(export, tmp_path_factory.mktemp("histograms") / "serve.log", "--workers", "1") as s:
        yield s


def histogram(metrics: dict[str, float], name: str) -> tuple[list[tuple[float, float]], float, float]:
    """(upper bound, cumulative count) per bucket in exposition order, _sum and _count of appliance_<name>."""
    prefix = f'appliance_{name}_bucket{{le="'
    buckets = [(float(k[len(prefix) : -2]), v) for k, v in metrics.items() if k.startswith(prefix)]
    return buckets, metrics[f"appliance_{name}_sum"], metrics[f"appliance_{name}_count"]


def well_formed(metrics: dict[str, float], name: str) -> None:
    buckets, total, count = histogram(metrics, name)
    bounds, counts = [b for b, _ in buckets], [c for _, c in buckets]
    assert len(bounds) >= 2 and bounds[-1] == math.inf and bounds == sorted(set(bounds)), (name, bounds)
    assert counts == sorted(counts) and counts[-1] == count, (name, counts, count)  # cumulative, +Inf is _count
    assert total >= 0


def run(srv: Server, model: str, stream: bool) -> float:
    """One completion of TOKENS tokens; the seconds the client waited for all of it."""
    body = {"model": model, "prompt": "The appliance serves", "max_tokens": TOKENS, "ignore_eos": True}
    start = time.monotonic()
    if stream:
        with requests.post(srv.base + "/v3/completions", json={**body, "stream": True}, stream=True, timeout=60) as r:
            lines = [line for line in r.iter_lines(decode_unicode=True) if line]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]", lines
        assert json.loads(lines[-2][len("data: ") :])["choices"][0]["finish_reason"] == "length"
    else:
        r = requests.post(srv.base + "/v3/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == TOKENS, r.text
    return time.monotonic() - start


def test_histograms_count_and_time_the_requests(srv):
    model = srv.model_id()
    run(srv, model, stream=False)  # warm: the first request on a fresh engine compiles its shapes
    wait_idle(srv)
    before = srv.metrics()
    durations = [run(srv, model, stream=i % 2 == 0) for i in range(REQUESTS)]
    wait_idle(srv)
    after = srv.metrics()

    expected = {  # observations per request
        "time_to_first_token_seconds": 1,
        "inter_token_latency_seconds": TOKENS - 1,
        "request_duration_seconds": 1,
    }
    sums = {}
    for name in HISTOGRAMS:
        well_formed(before, name)
        well_formed(after, name)
        (old, old_sum, old_count), (new, new_sum, new_count) = histogram(before, name), histogram(after, name)
        assert [b for b, _ in old] == [b for b, _ in new]
        assert new_count - old_count == REQUESTS * expected[name], (name, old_count, new_count)
        # the new observations per bucket (not cumulative)
        cumulative = [n - o for (_, o), (_, n) in zip(old, new)]
        added = [c - p for c, p in zip(cumulative, [0.0, *cumulative[:-1]])]
        assert min(added) >= 0 and sum(added) == new_count - old_count, (name, added)
        # none is longer than the longest request as the client timed it: all sit at or below its bucket
        top = next(i for i, (bound, _) in enumerate(new) if bound >= max(durations))
        assert sum(added[: top + 1]) == new_count - old_count, (name, max(durations), added)
        # _sum agrees with the buckets: each observation between its bucket's bounds
        lower = [0.0, *(b for b, _ in new[:-1])]
        low = sum(n * lo for n, lo in zip(added, lower))
        high = sum(n * b for n, (b, _) in zip(added, new) if n)
        sums[name] = new_sum - old_sum
        assert low - 1e-9 <= sums[name] <= high + 1e-9, (name, low, sums[name], high, added)
        assert 0 < sums[name] <= sum(durations), (name, sums[name], durations)
    # each request's duration is its first token's time plus its inter-token gaps (the same clock readings)
    first, gaps, whole = (sums[name] for name in HISTOGRAMS)
    assert whole == pytest.approx(first + gaps, rel=1e-6, abs=1e-6), (first, gaps, whole)
