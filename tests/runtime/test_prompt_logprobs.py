"""Prompt logprobs (`echo` + `logprobs` in /v3/completions): every prompt token's logprob under the model, the
first one null, equal to transformers' log_softmax of its logits on the default model in f32 — through chunked
prefill, the prefix cache, every backend, and the HTTP API (unary and streaming)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from appliance.config import EngineConfig
from appliance.params import SamplingParams
from appliance.runtime.engine import Engine
from tests.helpers import NEAR_TIE_F32, greedy_divergence, in_process_api, one_torch_thread

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOP = 3
F32 = dict(precision="f32", max_num_batched_tokens=16)  # 16-token chunks: every prompt spans several steps
TEXTS = ["The quick brown fox jumps over the lazy dog. " * 5, "def fibonacci(n):\n    if n < 2:\n        return n"]


@pytest.fixture(scope="module")
def prompts(default_hf):
    from appliance.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_hf)
    chat = tok.apply_chat_template([{"role": "user", "content": "Explain in two sentences why the sky is blue."}])
    return [tok.encode(chat)] + [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def reference(default_hf, prompts):
    """transformers' log_softmax over the logits of every prompt position."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_hf, dtype=torch.float32).eval()
    with torch.no_grad(), one_torch_thread():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1).numpy() for p in prompts]


def check(entries, prompt: list[int], ref: np.ndarray, engine: Engine, tol: float = 2e-4) -> None:
    assert [e.token_id for e in entries] == prompt
    assert entries[0].logprob is None and entries[0].top == []
    assert [e.token for e in entries] == [engine.token_text(t) for t in prompt]
    got = np.array([e.logprob for e in entries[1:]])
    want = ref[np.arange(len(prompt) - 1), prompt[1:]]
    np.testing.assert_allclose(got, want, atol=tol, rtol=0)
    for e, row in zip(entries[1:], ref[:-1]):
        assert len(e.top) == TOP
        ids = [i for i, _, _ in e.top]
        np.testing.assert_allclose([lp for _, _, lp in e.top], row[ids], atol=tol, rtol=0)
        assert sorted(row[ids]) == sorted(np.sort(row)[-TOP:])  # the TOP best (ties in either order)


@pytest.fixture(scope="module")
def engine(reference):
    from export.default_model import ensure_export

    eng = Engine(ensure_export("openvino", "fp32"), EngineConfig(**F32))
    yield eng
    eng.shutdown()


def test_prompt_logprobs_match_transformers(engine, prompts, reference):
    handles = [engine.submit(p, SamplingParams(max_tokens=3, prompt_logprobs=TOP)) for p in prompts]
    plain = [engine.submit(p, SamplingParams(max_tokens=3, logprobs=TOP)) for p in prompts]  # batched alongside
    for p, ref, h, q in zip(prompts, reference, handles, plain):
        r, q = h.results()[0], q.results()[0]
        check(r.prompt_logprobs, p, ref, engine)
        # the same greedy tokens, up to a near-tie: the two are prefilled in different chunks and batches
        candidates = [{i: lp for i, _, lp in e.top} | {e.token_id: e.logprob} for e in q.logprobs]
        greedy_divergence(q.token_ids, candidates, r.token_ids, NEAR_TIE_F32, "prompt logprobs on vs off")
        assert r.completion_tokens == 3
    assert engine.stats()["kv_blocks_used"] == 0


def test_cached_prompt_still_gives_every_prompt_logprob(engine, prompts, reference):
    """The prompt's full blocks are in the prefix cache (put there here: the test runs in any order), but a
    request for prompt logprobs needs the logits of every prompt position, so it bypasses the cache and computes
    them all."""
    assert engine.submit(prompts[1], SamplingParams(max_tokens=1)).results()[0]  # computes and caches its blocks
    hits = engine.stats()["prefix_cache_hit_tokens"]
    assert engine.submit(prompts[1], SamplingParams(max_tokens=1)).results()[0]
    assert engine.stats()["prefix_cache_hit_tokens"] > hits  # the blocks are cached...
    hits = engine.stats()["prefix_cache_hit_tokens"]
    r = engine.submit(prompts[1], SamplingParams(max_tokens=1, prompt_logprobs=TOP)).results()[0]
    assert engine.stats()["prefix_cache_hit_tokens"] == hits  # ...and not used here
    check(r.prompt_logprobs, prompts[1], reference[1], engine)


def test_max_tokens_zero_returns_only_the_prompt(engine, prompts, reference):
    r = engine.submit(prompts[2], SamplingParams(max_tokens=0, prompt_logprobs=0)).results()[0]
    assert r.token_ids == [] and r.finish_reason == "length" and r.completion_tokens == 0
    assert [e.top for e in r.prompt_logprobs] == [[]] * len(prompts[2])
    got = np.array([e.logprob for e in r.prompt_logprobs[1:]])
    np.testing.assert_allclose(got, reference[2][np.arange(len(prompts[2]) - 1), prompts[2][1:]], atol=2e-4)
    beams = engine.submit(prompts[2], SamplingParams(max_tokens=0, best_of=2, n=2, prompt_logprobs=0)).results()
    assert [b.token_ids for b in beams] == [[], []]
    np.testing.assert_allclose([e.logprob for e in beams[1].prompt_logprobs[1:]], got, atol=2e-4)
    assert engine.stats()["kv_blocks_used"] == 0


def test_prompt_logprobs_with_beam_search(engine, prompts, reference):
    results = engine.submit(prompts[0], SamplingParams(max_tokens=4, best_of=2, n=2, prompt_logprobs=TOP)).results()
    for r in results:
        check(r.prompt_logprobs, prompts[0], reference[0], engine)


@pytest.mark.parametrize("case", ["openvino-static", "onnx"])
def test_static_backends(case, prompts, reference):
    from export.default_model import ensure_export

    backend, cfg = {
        "openvino-static": (
            "openvino",
            dict(F32, static=True, static_context=128, static_batch=2, static_prefill_chunk=16),
        ),
        "onnx": ("onnx", dict(F32, static_context=128, static_batch=2)),
    }[case]
    eng = Engine(ensure_export(backend, "fp32"), EngineConfig(**cfg))
    try:
        handles = [eng.submit(p, SamplingParams(max_tokens=2, prompt_logprobs=TOP)) for p in prompts]
        for p, ref, h in zip(prompts, reference, handles):
            check(h.results()[0].prompt_logprobs, p, ref, eng)
    finally:
        eng.shutdown()


# ---------------------------------------------------------------- HTTP


@pytest.fixture(scope="module")
def api(engine, tmp_path_factory):
    with in_process_api(engine, tmp_path_factory.mktemp("rt")) as client:
        yield client


def _offsets_follow_tokens(lp: dict, start: int = 0) -> None:
    offsets, tokens = lp["text_offset"], lp["tokens"]
    assert offsets[0] == start
    assert all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], tokens))


def test_echo_logprobs_unary(api, engine, prompts, reference):
    text = TEXTS[1]
    body = {"model": "m", "prompt": text, "max_tokens": 4, "logprobs": 2, "echo": True}
    r = api.post("/v3/completions", json=body)
    assert r.status_code == 200, r.get_json()
    choice = r.get_json()["choices"][0]
    plain = api.post("/v3/completions", json={**body, "echo": False}).get_json()["choices"][0]
    ids = prompts[2]
    lp = choice["logprobs"]
    assert lp["tokens"][: len(ids)] == [engine.token_text(t) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    np.testing.assert_allclose(
        lp["token_logprobs"][1 : len(ids)], reference[2][np.arange(len(ids) - 1), ids[1:]], atol=2e-4
    )
    assert all(len(t) == 2 for t in lp["top_logprobs"][1:])
    _offsets_follow_tokens({k: v[: len(ids)] for k, v in lp.items()})  # prompt: from 0
    # the echo request computes every prompt position's logits, the plain one only the last: f32 numerics may
    # differ in the last bits, so the completions agree up to a near-tie (helpers.greedy_divergence)
    mine = plain["logprobs"]
    if greedy_divergence(
        mine["tokens"], mine["top_logprobs"], lp["tokens"][len(ids) :], NEAR_TIE_F32, "echo vs plain"
    ) == len(mine["tokens"]):
        assert choice["text"] == text + plain["text"]
        np.testing.assert_allclose(lp["token_logprobs"][len(ids) :], mine["token_logprobs"], atol=2e-4)
        assert lp["text_offset"][len(ids) :] == [o + len(text) for o in mine["text_offset"]]
    only = api.post("/v3/completions", json={**body, "max_tokens": 0}).get_json()["choices"][0]
    assert only["text"] == text and only["logprobs"]["tokens"] == lp["tokens"][: len(ids)]
    assert only["logprobs"]["token_logprobs"] == lp["token_logprobs"][: len(ids)]


def test_echo_logprobs_streaming(api, prompts):
    text = TEXTS[1]
    body = {"model": "m", "prompt": text, "max_tokens": 4, "logprobs": 1, "echo": True}
    unary = api.post("/v3/completions", json=body).get_json()["choices"][0]
    r = api.post("/v3/completions", json={**body, "stream": True})
    events = [
        json.loads(line[6:])
        for line in r.get_data(as_text=True).splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    first = events[0]["choices"][0]
    assert first["text"] == text
    assert first["logprobs"]["tokens"] == unary["logprobs"]["tokens"][: len(prompts[2])]
    tokens = [t for e in events for t in (e["choices"][0]["logprobs"] or {}).get("tokens", [])]
    assert tokens == unary["logprobs"]["tokens"]
    assert "".join(e["choices"][0]["text"] for e in events) == unary["text"]


def test_logprobs_without_echo_has_no_prompt_part(api):
    r = api.post("/v3/completions", json={"model": "m", "prompt": "Hello", "max_tokens": 3, "logprobs": 0})
    lp = r.get_json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3 and None not in lp["token_logprobs"]
