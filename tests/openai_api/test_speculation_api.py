"""Speculative decoding at the HTTP edge (docs/serving.md "Speculative decoding"): the usage and /metrics fields, then
end to end through real servers and the real `openai` client.

Unit tests first (no server): `usage.completion_tokens_details` summed over choices from the engine's cumulative
chunk counts, unary and in the streamed usage chunk, parsed by the `openai` SDK's own types; the /metrics series.
Then a real `appliance serve --prompt-lookup` on the default model (f32 compute, so greedy runs are comparable):
a chat answer that repeats its `prediction` is the answer without speculation, with accepted draft tokens in the
usage and in /metrics; and a static-shape server (a tiny model) that refuses a speculation parameter with a 400
but takes a `prediction` (a hint that has no effect there).
"""

from __future__ import annotations

import json

import openai
import pytest
import requests

from appliance import protocol as p
from appliance.openai_api.completions import CompletionShape
from appliance.openai_api.streaming import Generation, Meta
from appliance.outputs import Chunk, Timing
from appliance.params import SamplingParams
from appliance.server.metrics import ServerMetrics
from appliance.testing.loopback import parse_metrics
from tests.helpers import NEAR_TIE_F32, Server, sse_events, wait_idle

# ---------------------------------------------------------------- usage, from the engine's chunks (no server)


class FakeStream:
    def __init__(self, events: list):
        self.events = list(events)

    def next(self, wait: float):
        return self.events.pop(0) if self.events else p.End()

    def close(self) -> None:
        pass


class FakeClient:
    """What Generation needs of an EngineClient: one job's events."""

    def __init__(self, events: list):
        self.events = events

    def open_job(self, job: p.Job) -> FakeStream:
        return FakeStream(self.events)


def generation(chunks: list[tuple[int, Chunk]], prediction: str | None = None, n: int = 2) -> Generation:
    job = p.Job("cmpl-1", [p.PromptSpec(text="hi")], SamplingParams(prediction=prediction), n=n)
    events = [p.Accepted(prompt_tokens=[3])]
    events += [p.ChoiceChunk(i, c, Timing(total_time=1.0) if c.finish_reason else None) for i, c in chunks]
    return Generation(FakeClient(events), job, CompletionShape(), Meta("cmpl-1", 0, "m", "fp"), include_usage=True)


# each chunk carries the sequence's counts so far; a choice's last chunk has its totals
CHUNKS = [
    (0, Chunk("a", [1], completion_tokens=1, accepted_prediction_tokens=0, rejected_prediction_tokens=0)),
    (1, Chunk("b", [2], completion_tokens=1)),
    (0, Chunk(" b c", [2, 3, 4], completion_tokens=4, accepted_prediction_tokens=2, rejected_prediction_tokens=1)),
    (
        1,
        Chunk(
            " d",
            [5, 6],
            finish_reason="length",
            completion_tokens=3,
            accepted_prediction_tokens=1,
            rejected_prediction_tokens=3,
        ),
    ),
    (
        0,
        Chunk(
            "",
            [],
            finish_reason="stop",
            completion_tokens=4,
            accepted_prediction_tokens=2,
            rejected_prediction_tokens=1,
        ),
    ),
]
DETAILS = {"accepted_prediction_tokens": 3, "rejected_prediction_tokens": 4}


def test_usage_sums_the_choices_accepted_and_rejected_draft_tokens():
    body = generation(CHUNKS).start().unary()
    assert body["usage"]["completion_tokens_details"] == DETAILS
    assert body["usage"]["completion_tokens"] == 7
    # the real SDK's type parses it
    usage = openai.types.CompletionUsage.model_validate(body["usage"])
    assert usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.accepted_prediction_tokens == 3
    assert usage.completion_tokens_details.rejected_prediction_tokens == 4
    assert openai.types.Completion.model_validate(body).usage == usage


def test_streamed_usage_chunk_has_the_details():
    events = [json.loads(e[len("data: ") :]) for e in generation(CHUNKS).start().sse() if e != "data: [DONE]\n\n"]
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens_details"] == DETAILS
    assert (
        openai.types.Completion.model_validate(events[-1]).usage.completion_tokens_details.rejected_prediction_tokens
        == 4
    )


def test_details_only_with_drafts_or_a_prediction():
    plain = [
        (0, Chunk("a", [1], finish_reason="stop", completion_tokens=1)),
        (1, Chunk("b", [2], finish_reason="stop", completion_tokens=1)),
    ]
    assert "completion_tokens_details" not in generation(plain).start().unary()["usage"]
    # a prediction that drafted nothing (a static-shape model: no effect) still says so, as OpenAI does
    usage = generation(plain, prediction="x").start().unary()["usage"]
    assert usage["completion_tokens_details"] == {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}


def test_metrics_series_from_engine_stats():
    text = ServerMetrics().render(
        {"a": (True, {"draft_tokens": 10, "accepted_draft_tokens": 6}), "b": (True, {}), "c": (False, None)}
    )
    m = parse_metrics(text)
    assert m["appliance_speculative_draft_tokens_total"] == 10
    assert m['appliance_speculative_draft_tokens_total{model="a"}'] == 10
    assert m['appliance_speculative_accepted_tokens_total{model="a"}'] == 6
    assert m['appliance_speculative_accepted_tokens_total{model="b"}'] == 0
    assert m["appliance_speculative_acceptance_ratio"] == 0.6
    assert m['appliance_speculative_acceptance_ratio{model="c"}'] == 0  # no drafts yet: 0, not a division error
    assert "# TYPE appliance_speculative_draft_tokens_total counter" in text
    assert "# TYPE appliance_speculative_acceptance_ratio gauge" in text


# ---------------------------------------------------------------- end to end: real servers, the real openai client

# An input-grounded task: the answer is the given text again, so prompt lookup and the prediction draft it.
TEXT = (
    "The quick brown fox jumps over the lazy dog. The dog does not move. The fox runs into the forest, "
    "and the forest is dark and quiet."
)
MESSAGES = [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{TEXT}"}]
PREDICTION = {"type": "content", "content": TEXT}


@pytest.fixture(scope="module")
def lookup_server(model_dir, tmp_path_factory):
    """--prompt-lookup on the default model, f32 compute: a verified step and a one-token step agree to ~1e-4."""
    log = tmp_path_factory.mktemp("speculation") / "serve.log"
    with Server(model_dir, log, "--prompt-lookup", "--precision", "f32", "--workers", "1") as srv:
        yield srv


@pytest.fixture(scope="module")
def lookup_client(lookup_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=lookup_server.base + "/v3", api_key="unused", max_retries=0, timeout=120)


def text_divergence(reference: list, text: str, margin: float) -> int:
    """greedy_divergence for a run known by its text only (the speculative run asks no logprobs, which could change
    its path): the reference's logprob entries are walked along `text`; where they part, the other run's token must
    be one of the reference's candidates within `margin` nats. Returns the number of reference tokens matched."""
    pos = 0
    for i, entry in enumerate(reference):
        if pos == len(text) and i == len(reference) - 1:
            return len(reference)  # the stop token (EOS), whose text the answer leaves out
        if text.startswith(entry.token, pos):
            pos += len(entry.token)
            continue
        alternatives = {alt.token: alt.logprob for alt in entry.top_logprobs}
        taken = [t for t in alternatives if t and text.startswith(t, pos)]
        assert taken, f"diverged at token {i}: {text[pos : pos + 20]!r} is none of {alternatives}"
        gap = entry.logprob - max(alternatives[t] for t in taken)
        assert gap <= margin, f"diverged at token {i} with a gap of {gap:.5f} nats, not a near-tie"
        return i
    assert pos == len(text), f"the run goes on past the reference: {text[pos:]!r}"
    return len(reference)


def test_prediction_speeds_nothing_but_the_tokens_and_reports_them(lookup_server, lookup_client, model_name):
    wait_idle(lookup_server)
    before = lookup_server.metrics()
    reference = lookup_client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=48,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"num_assistant_tokens": 0},  # no speculation for this request, on a --prompt-lookup server
    )
    assert reference.usage.completion_tokens_details is None  # no prediction, nothing drafted
    wait_idle(lookup_server)
    answer = lookup_client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=48,
        temperature=0,
        extra_body={"prediction": PREDICTION},
    )
    entries = reference.choices[0].logprobs.content
    matched = text_divergence(entries, answer.choices[0].message.content, NEAR_TIE_F32)
    if matched == len(entries):
        assert answer.choices[0].message.content == reference.choices[0].message.content
        assert answer.usage.completion_tokens == reference.usage.completion_tokens
    details = answer.usage.completion_tokens_details
    assert details is not None and details.accepted_prediction_tokens > 0, answer.usage
    # the answer repeats the text: most drafts are right
    assert details.accepted_prediction_tokens > details.rejected_prediction_tokens, details
    after = lookup_server.metrics()
    drafted = after["appliance_speculative_draft_tokens_total"] - before["appliance_speculative_draft_tokens_total"]
    accepted = (
        after["appliance_speculative_accepted_tokens_total"] - before["appliance_speculative_accepted_tokens_total"]
    )
    assert accepted >= details.accepted_prediction_tokens and drafted >= accepted + details.rejected_prediction_tokens
    assert (
        after[f'appliance_speculative_accepted_tokens_total{{model="{model_name}"}}']
        == after["appliance_speculative_accepted_tokens_total"]
    )
    assert 0 < after["appliance_speculative_acceptance_ratio"] <= 1


def test_streamed_usage_reports_the_drafts(lookup_server, model_name):
    body = {
        "model": model_name,
        "messages": MESSAGES,
        "max_tokens": 24,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_ngram_size": 2,  # prompt lookup tuned by the request
    }
    with requests.post(lookup_server.base + "/v3/chat/completions", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        events = sse_events(r)
    usage = events[-2]["usage"]
    assert usage["completion_tokens_details"]["accepted_prediction_tokens"] > 0, usage
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-2] if e["choices"])
    assert text.strip() and usage["completion_tokens"] > 0


def test_400s_name_the_field(lookup_server, lookup_client, model_name):
    with pytest.raises(openai.BadRequestError) as info:
        lookup_client.chat.completions.create(
            model=model_name,
            messages=MESSAGES,
            max_tokens=4,
            extra_body={"num_assistant_tokens": 3, "assistant_confidence_threshold": 0.5},
        )
    error = info.value.body
    assert error["param"] == "assistant_confidence_threshold" and "mutually exclusive" in error["message"]
    # a threshold needs a draft model (the engine's check, through the same 400 path)
    with pytest.raises(openai.BadRequestError) as info:
        lookup_client.chat.completions.create(
            model=model_name, messages=MESSAGES, max_tokens=4, extra_body={"assistant_confidence_threshold": 0.5}
        )
    assert "assistant_confidence_threshold" in info.value.body["message"]


def test_static_server_refuses_speculation_parameters_but_takes_a_prediction(exported, tmp_path):
    out, manifest = exported("llama", "openvino", "fp32")
    with Server(out, tmp_path / "serve.log", "--static", "--static-context", "128", "--workers", "1") as srv:
        url = f"{srv.base}/v3/completions"
        base = {"model": manifest.name, "prompt": "hello hello hello", "max_tokens": 4, "temperature": 0}
        for field, value in (("num_assistant_tokens", 3), ("max_ngram_size", 2)):
            refused = requests.post(url, json={**base, field: value}, timeout=60)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["type"] == "invalid_request_error"
        plain = requests.post(url, json=base, timeout=60)
        hinted = requests.post(url, json={**base, "prediction": {"type": "content", "content": "hello"}}, timeout=60)
        assert plain.status_code == hinted.status_code == 200, hinted.text
        assert hinted.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
        assert hinted.json()["usage"]["completion_tokens_details"] == {
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        }
