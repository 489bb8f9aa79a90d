"""typical_p (locally typical sampling, Meister et al. 2022): the sampler against transformers' TypicalLogitsWarper,
then the request field end to end through the real server.

The oracle is transformers itself: `_typical` keeps exactly the tokens TypicalLogitsWarper keeps (random logits,
vocabularies from a handful of ids to one where the typical set needs several of the staged sorts, rows with tokens
already dropped), and draws through `sample_batch` follow the distribution transformers' warper chain
(temperature -> top_k -> top_p -> min_p -> typical, its order in `generate`) leaves, never a token it removed. On the
server: typical_p tiny keeps one token per step, so sampled choices with different seeds are all the same text;
typical_p 1 (off) leaves them varied; 0 and 1.5 are 400s with the field's message.
"""

from __future__ import annotations

import numpy as np
import pytest
import requests

from appliance.openai_api.completions import parse_completion
from appliance.openai_api.sampling import to_sampling_params
from appliance.params import SamplingParams
from appliance.runtime.sampling import SequenceSampler, _typical, sample_batch
from tests.helpers import Server, one_torch_thread
from tests.runtime.test_sampling import assert_follows, draw_many

MASSES = [1e-6, 0.05, 0.2, 0.5, 0.9, 0.99]


def transformers_kept(logits: np.ndarray, mass: float) -> np.ndarray:
    """bool[B, V]: what TypicalLogitsWarper(mass) leaves finite, in float64 (-inf logits: already dropped)."""
    import torch
    from transformers.generation.logits_process import TypicalLogitsWarper

    with one_torch_thread():
        out = TypicalLogitsWarper(mass=mass)(None, torch.from_numpy(logits.astype(np.float64)))
    return torch.isfinite(out).numpy()


def transformers_probs(row: np.ndarray, temperature: float, **kw) -> np.ndarray:
    """transformers' sampling distribution for one logits row: its warpers in generate's order, then softmax."""
    import torch
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
        TypicalLogitsWarper,
    )

    warpers = [TemperatureLogitsWarper(temperature)]
    if kw.get("top_k"):
        warpers.append(TopKLogitsWarper(kw["top_k"]))
    if kw.get("top_p", 1.0) < 1.0:
        warpers.append(TopPLogitsWarper(kw["top_p"]))
    if kw.get("min_p"):
        warpers.append(MinPLogitsWarper(kw["min_p"]))
    warpers.append(TypicalLogitsWarper(kw["typical_p"]))
    with one_torch_thread():
        scores = torch.from_numpy(row.astype(np.float64)[None])
        for warper in warpers:
            scores = warper(None, scores)
        return torch.softmax(scores, dim=-1)[0].numpy()


@pytest.mark.parametrize("V", [7, 300, 5000, 50000])
def test_kept_tokens_are_transformers(V):
    """Flat to peaked rows (scale 0.2 .. 8), the last with the lower half of the ids already dropped: the kept set
    equals transformers' for every mass, tiny masses keeping the one most typical token."""
    rng = np.random.default_rng(V)
    x = np.stack([rng.standard_normal(V) * s for s in (0.2, 1.0, 3.0, 8.0, 2.0)]).astype(np.float32)
    x[-1, : V // 2] = -np.inf
    w = np.exp(x - x.max(axis=1, keepdims=True))
    sizes = set()
    for mass in MASSES:
        ours = _typical(w.copy(), np.full(len(x), mass)) > 0
        theirs = transformers_kept(x, mass)
        for r in range(len(x)):
            assert np.array_equal(np.nonzero(ours[r])[0], np.nonzero(theirs[r])[0]), (V, mass, r)
        sizes |= set(ours.sum(axis=1).tolist())
    assert 1 in sizes  # the test covers a one-token set ...
    if V >= 5000:
        assert max(sizes) > 2048  # ... and sets past the first two staged sorts (256, 2048 candidates)


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=1.0, typical_p=0.5),
        dict(temperature=0.7, typical_p=0.9),
        dict(temperature=1.3, typical_p=0.3),
        dict(temperature=1.0, typical_p=0.8, top_k=8),
        dict(temperature=1.0, typical_p=0.6, top_p=0.9),
        dict(temperature=1.0, typical_p=0.7, min_p=0.05),
    ],
)
def test_draws_follow_transformers_distribution(kw):
    """Through sample_batch (each code path: full vocabulary, top_k, top_p, min_p): the draws follow transformers'
    warped distribution (chi-square), and a token it removes is never drawn."""
    rng = np.random.default_rng(11)
    row = (rng.standard_normal(16) * 1.5).astype(np.float32)
    probs = transformers_probs(row, **kw)
    assert 1 < (probs > 0).sum() < len(row)  # the filter removes something, and leaves a choice
    assert_follows(draw_many(row, n=4000, **kw), probs, len(row))


def test_rows_keep_their_own_typical_p_in_one_batch():
    """One batch mixing typical_p values and rows without it: each row keeps its own set."""
    rng = np.random.default_rng(12)
    V = 400
    row = (rng.standard_normal(V) * 2).astype(np.float32)
    masses = [1e-6, 0.3, 1.0, 0.9] * 300
    seqs = [SequenceSampler(SamplingParams(temperature=1.0, typical_p=m, seed=i)) for i, m in enumerate(masses)]
    tokens = sample_batch(np.broadcast_to(row, (len(seqs), V)), seqs).token_ids
    kept = {m: set(np.nonzero(transformers_kept(row[None], m)[0])[0].tolist()) for m in (1e-6, 0.3, 0.9)}
    got = {m: set(tokens[[i for i, mi in enumerate(masses) if mi == m]].tolist()) for m in set(masses)}
    assert got[1e-6] == kept[1e-6] and len(kept[1e-6]) == 1
    assert got[0.3] <= kept[0.3] and got[0.9] <= kept[0.9]
    assert got[1.0] - kept[0.9]  # off: tokens the others drop


# ---------------------------------------------------------------- the request field


def test_generation_config_typical_p_is_the_default():
    """generation_config.json's `typical_p` (transformers' key) fills a request that leaves it unset."""
    body = {"model": "m", "prompt": "hi"}
    assert to_sampling_params(parse_completion(body).sampling, {"typical_p": 0.7}).typical_p == 0.7
    assert (
        to_sampling_params(parse_completion({**body, "typical_p": 0.2}).sampling, {"typical_p": 0.7}).typical_p == 0.2
    )
    assert to_sampling_params(parse_completion(body).sampling, {}).typical_p == 1.0


def complete(server, model_name, **body) -> requests.Response:
    return requests.post(
        server.base + "/v3/completions", json={"model": model_name, "prompt": "Once upon a time", **body}, timeout=120
    )


def texts(server, model_name, typical_p: float) -> list[str]:
    """Eight sampled choices at temperature 1, each with its own seed (no top_k: the whole vocabulary). A first
    request settles the prompt in the prefix cache, so the eight compute the same logits (a cold prefill and a
    cached one may differ in their last bits)."""
    assert complete(server, model_name, max_tokens=1).status_code == 200
    out = []
    for seed in range(8):
        r = complete(
            server,
            model_name,
            max_tokens=12,
            temperature=1.0,
            top_k=-1,
            typical_p=typical_p,
            seed=seed,
            ignore_eos=True,
        )
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


@pytest.fixture(scope="module")
def f32_server(model_dir, tmp_path_factory):
    """A server computing in f32. The cut keeps the tokens tied with the most typical one (transformers' rule), and
    bf16 logits (the default on AVX-512-bf16 CPUs) tie often: 6 texts of 8 differed there at typical_p 1e-6."""
    with Server(model_dir, tmp_path_factory.mktemp("f32") / "serve.log", "--workers", "1", "--precision", "f32") as s:
        yield s


def test_tiny_typical_p_keeps_one_token_per_step(f32_server, model_name):
    """typical_p 1e-6: only the most typical token survives, so every seed writes the same text; typical_p 1 (off,
    the default) samples the whole vocabulary and the seeds part."""
    assert len(set(texts(f32_server, model_name, 1e-6))) == 1
    assert len(set(texts(f32_server, model_name, 1.0))) > 1


@pytest.mark.parametrize("value", [0, 1.5, -0.5])
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_out_of_range_is_400(server, model_name, value, endpoint):
    body = {"messages": [{"role": "user", "content": "hi"}]} if endpoint.startswith("chat") else {"prompt": "hi"}
    r = requests.post(
        f"{server.base}/v3/{endpoint}", json={"model": model_name, "typical_p": value, **body}, timeout=60
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "typical_p out of range(0.0, 1.0]"
