"""Beam search (best_of > 1): the same hypotheses as transformers' `generate(num_beams=B, num_return_sequences=n,
do_sample=False, length_penalty=lp)`.

Three levels: the pure selection rule (appliance.runtime.beam_search) driven by a tiny random torch model against
transformers on many random cases; the engine (beams as sequences sharing KV blocks, forks copying the last
block) on the default model in f32, on every backend and under KV pressure; and the HTTP API.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from appliance.config import EngineConfig
from appliance.params import SamplingParams
from appliance.runtime.beam_search import WIDTH_STOP_TOKENS, BeamSearch, log_softmax, top_continuations
from appliance.runtime.engine import Engine
from tests.helpers import in_process_api, one_torch_thread

os.environ.setdefault("HF_HUB_OFFLINE", "1")

NEW_TOKENS = 20
CHAT = ["What is the capital of France?", "Write a haiku about the sea."]
RAW = ["def fibonacci(n):\n    "]
# (best_of, n, length_penalty)
SEARCHES = [(2, 2, 1.0), (4, 3, 1.0), (4, 2, 0.5)]
F32 = dict(precision="f32", max_num_batched_tokens=64)


# ---------------------------------------------------------------- the selection rule on its own


def test_top_continuations_best_first_ties_by_beam_then_token():
    lp = np.log(np.array([[0.5, 0.25, 0.25], [0.5, 0.3, 0.2]], np.float32))
    cands = top_continuations(lp, np.array([0.0, np.log(0.5)], np.float32), 4)
    assert [(c.beam, c.token) for c in cands] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert [c.rank for c in cands] == [0, 1, 2, 3]
    assert cands[3].score == pytest.approx(np.log(0.25))
    masked = top_continuations(np.array([[0.0, -np.inf]], np.float32), np.zeros(1, np.float32), 2)
    assert [(c.beam, c.token) for c in masked] == [(0, 0)]  # a masked token is never a candidate


def test_only_the_first_num_beams_candidates_may_finish_and_the_pool_keeps_the_best():
    search = BeamSearch(2, length_penalty=1.0)
    lp = np.log(np.array([[0.4, 0.3, 0.2, 0.1]], np.float32))
    cands = search.candidates(lp, [0.0])  # width 2 * 2 = 4: every token
    ended = [c.token in (1, 3) for c in cands]  # token 1 ranks 2nd (may finish), 3 ranks 4th (may not)
    running = search.update(cands, ended, 1, payloads=[c.token for c in cands])
    assert [h.payload for h in search.finished] == [1]
    assert [c.token for c in running] == [0, 2]  # the best two that did not end
    assert not search.done


def test_heuristic_stops_when_no_running_beam_can_beat_the_pool():
    search = BeamSearch(1, length_penalty=1.0)
    cands = search.candidates(np.log(np.array([[0.6, 0.4]], np.float32)), [0.0])
    running = search.update(cands, [True, False], 1, payloads=["a", "b"])
    assert search.done and running == [] and search.best(1)[0].payload == "a"  # log 0.4 <= log 0.6


def test_length_penalty_normalizes_finished_scores():
    search = BeamSearch(2, length_penalty=2.0)
    cands = search.candidates(np.log(np.array([[0.5, 0.5]], np.float32)), [-3.0])
    search.update(cands, [True, True], 3, payloads=["x", "y"])
    assert search.finished[0].score == pytest.approx((-3.0 + np.log(0.5)) / 9)
    assert search.done  # every candidate ended


@pytest.mark.parametrize("lp", [2000.0, -2000.0, 1e308, -1e308, float("inf")])
def test_extreme_length_penalty_never_raises(lp):
    search = BeamSearch(2, length_penalty=lp)
    for score in (-3.0, 0.0, 2.5):
        for n in (1, 2, 500):
            value = search.normalized(score, n)
            assert not np.isnan(value) and (value == 0.0 or np.sign(value) == np.sign(score))
    assert search.normalized(-3.0, 1) == -3.0  # 1 ** lp is 1
    assert search.normalized(-3.0, 2) == (0.0 if lp > 0 else -np.inf)  # saturates, never raises
    cands = search.candidates(np.log(np.array([[0.5, 0.5]], np.float32)), [-3.0])
    search.update(cands, [True, True], 3, payloads=["x", "y"])  # the review's reproducer path
    assert search.done and len(search.finished) == 2


def test_sane_length_penalty_keeps_transformers_expression():
    for lp in (-1.5, 0.0, 0.5, 1.0, 2.0):
        assert BeamSearch(2, length_penalty=lp).normalized(-7.25, 13) == -7.25 / (13**lp)


def test_width_counts_a_few_stop_tokens_only():
    assert BeamSearch(3, num_stop_tokens=1).width == 6  # transformers: max(2, 1 + n_eos) * beams
    assert BeamSearch(3, num_stop_tokens=4).width == 15
    assert BeamSearch(3, num_stop_tokens=10_000).width == (1 + WIDTH_STOP_TOKENS) * 3


def _toy_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=40,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # peaked distributions: EOS gets picked, hypotheses finish early
    return model


def drive_search(model, prompt, beams, n, steps, lp, eos, early_stopping=False) -> tuple[list[list[int]], int]:
    """BeamSearch driven by a tiny torch model (every beam recomputed from scratch each step): the n best
    hypotheses' tokens and the steps the search took."""
    import torch

    search = BeamSearch(beams, lp, len(eos), early_stopping=early_stopping)
    live, taken = [(list(prompt), 0.0)], 0
    for step in range(1, steps + 1):
        taken = step
        with torch.no_grad():
            logits = model(torch.tensor([b for b, _ in live])).logits[:, -1].float().numpy()
        cands = search.candidates(log_softmax(logits), [s for _, s in live])
        ended = [c.token in eos or step == steps for c in cands]
        payloads = [live[c.beam][0][len(prompt) :] + [c.token] for c in cands]
        running = search.update(cands, ended, step, payloads)
        if search.done:
            break
        live = [(live[c.beam][0] + [c.token], c.score) for c in running]
    return [h.payload for h in search.best(n)], taken


def transformers_beams(model, prompt, beams, n, steps, lp, eos, early_stopping=False) -> list[list[int]]:
    """transformers' generate(num_beams=...) on the same model: the n best sequences' generated tokens."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=beams,
            num_return_sequences=n,
            do_sample=False,
            max_new_tokens=steps,
            length_penalty=lp,
            early_stopping=early_stopping,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    return [_until_eos(row[len(prompt) :], eos) for row in out.tolist()]


def test_selection_rule_matches_transformers_on_random_cases():
    """BeamSearch driven by a tiny random model returns exactly transformers' sequences: random prompts, 2-6
    beams, n <= beams, 3-13 tokens, length penalties of both signs, one or two EOS ids (the candidate width
    depends on it)."""
    model = _toy_model()

    rng = np.random.default_rng(0)
    finished_early = 0
    with one_torch_thread():
        for _ in range(40):
            prompt = rng.integers(3, 40, size=rng.integers(2, 8)).tolist()
            beams = int(rng.choice([2, 3, 4, 6]))
            n, steps = int(rng.integers(1, beams + 1)), int(rng.integers(3, 14))
            lp = float(rng.choice([1.0, 0.0, 2.0, -0.5]))
            eos = [2] if rng.random() < 0.7 else [2, 5]
            got, _ = drive_search(model, prompt, beams, n, steps, lp, eos)
            assert got == transformers_beams(model, prompt, beams, n, steps, lp, eos), (
                prompt,
                beams,
                n,
                steps,
                lp,
                eos,
            )
            finished_early += any(len(g) < steps for g in got)
    assert finished_early >= 10  # the EOS / early-stopping paths were exercised, not only max length


def _until_eos(tokens: list[int], eos) -> list[int]:
    cut = next((i for i, t in enumerate(tokens) if t in eos), None)
    return tokens if cut is None else tokens[: cut + 1]


# ---------------------------------------------------------------- the engine on the default model


@pytest.fixture(scope="module")
def prompts(default_hf):
    from appliance.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_hf)
    chats = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT]
    return [tok.encode(t) for t in chats + RAW]


@pytest.fixture(scope="module")
def reference(default_hf, prompts):
    """transformers' beams, computed before any engine exists (no CPU contention with its threads)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_hf, dtype=torch.float32).eval()
    out = {}
    with torch.no_grad(), one_torch_thread():
        for beams, n, lp in SEARCHES:
            for i, p in enumerate(prompts):
                ids = model.generate(
                    torch.tensor([p]),
                    attention_mask=torch.ones(1, len(p), dtype=torch.long),
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    num_beams=beams,
                    num_return_sequences=n,
                    length_penalty=lp,
                    eos_token_id=2,
                    pad_token_id=2,
                )
                out[beams, n, lp, i] = [_until_eos(row[len(p) :], [2]) for row in ids.tolist()]
    return out


@pytest.fixture(scope="module")
def engine(reference):
    from export.default_model import ensure_export

    eng = Engine(ensure_export("openvino", "fp32"), EngineConfig(**F32))
    yield eng
    eng.shutdown()


def run_searches(engine: Engine, prompts) -> dict:
    """Every search of SEARCHES on every prompt, all submitted at once (batched together, with greedy traffic)."""
    handles = {
        (beams, n, lp, i): engine.submit(
            p, SamplingParams(max_tokens=NEW_TOKENS, best_of=beams, n=n, length_penalty=lp)
        )
        for beams, n, lp in SEARCHES
        for i, p in enumerate(prompts)
    }
    greedy = [engine.submit(p, SamplingParams(max_tokens=NEW_TOKENS)) for p in prompts]
    out = {key: [r.token_ids for r in h.results()] for key, h in handles.items()}
    for g in greedy:
        g.results()
    return out


@pytest.fixture(scope="module")
def paged_results(engine, prompts):
    return run_searches(engine, prompts)


def test_engine_beams_match_transformers(engine, paged_results, reference):
    assert paged_results == reference
    assert any(r[-1] == 2 for beams in reference.values() for r in beams)  # some end with EOS
    assert any(len(r) == NEW_TOKENS for beams in reference.values() for r in beams)  # some with max_tokens
    assert engine.stats()["kv_blocks_used"] == 0


def test_logits_processors_apply_to_log_probabilities_as_in_transformers(engine, prompts, default_hf):
    """repetition_penalty / min_tokens work on the beams' log-probabilities, as transformers' processors do."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_hf, dtype=torch.float32).eval()
    p = prompts[0]
    with torch.no_grad(), one_torch_thread():
        out = model.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            num_beams=3,
            num_return_sequences=2,
            repetition_penalty=1.3,
            min_new_tokens=8,
            eos_token_id=2,
            pad_token_id=2,
        )
    want = [_until_eos(row[len(p) :], [2]) for row in out.tolist()]
    got = engine.submit(
        p, SamplingParams(max_tokens=NEW_TOKENS, best_of=3, n=2, repetition_penalty=1.3, min_tokens=8)
    ).results()
    assert [r.token_ids for r in got] == want
    assert all(len(r.token_ids) > 8 for r in got)


def test_beam_results_are_well_formed(engine, prompts):
    handle = engine.submit(prompts[0], SamplingParams(max_tokens=NEW_TOKENS, best_of=4, n=4, logprobs=2))
    results = handle.results()
    assert len(results) == 4 and len({tuple(r.token_ids) for r in results}) == 4
    for r in results:
        assert r.text == engine.tokenizer.decode(r.token_ids)  # EOS hidden, as in streaming
        assert r.finish_reason == ("stop" if r.token_ids[-1] == 2 else "length")
        assert r.completion_tokens == len(r.token_ids) == len(r.logprobs)
        assert [e.token_id for e in r.logprobs] == r.token_ids
        assert all(len(e.top) == 2 and e.top[0][2] >= e.logprob - 1e-6 for e in r.logprobs)
    # the best hypothesis scores highest: sum of logprobs / length (length_penalty 1)
    scores = [sum(e.logprob for e in r.logprobs) / len(r.token_ids) for r in results]
    assert scores[0] == max(scores)


def test_forks_share_full_blocks(engine):
    """A 100-token prompt spans 4 blocks: the 4 beams share its 3 full ones (each owns its last block)."""
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 10)[:100]
    before = engine.pool.num_used
    handle = engine.submit(prompt, SamplingParams(max_tokens=60, best_of=4, n=1, ignore_eos=True))
    peak = before
    while handle._seq.group.out.empty():
        peak = max(peak, engine.pool.num_used)
        time.sleep(0.002)
    handle.results()
    assert peak - before <= 3 + 4 * 3  # shared prompt blocks + per beam at most 3 of its own
    assert engine.pool.num_used == before


def test_copy_blocks_paged(engine):
    backend, pool = engine.backend, engine.pool
    src, dst = pool.allocate(2)
    try:
        views = [
            np.asarray(backend.request.get_tensor(name).data).reshape(backend.num_blocks, -1).view(np.uint8)
            for name in (p.get_any_name() for p in backend.compiled.inputs)
            if "_cache." in name
        ]
        assert views
        for i, v in enumerate(views):
            v[src] = i + 1
            v[dst] = 0
        backend.copy_blocks([(src, dst)])
        assert all((v[dst] == i + 1).all() for i, v in enumerate(views))
    finally:
        pool.free([src, dst])


def test_stop_strings_end_hypotheses(engine, prompts):
    free = engine.submit(prompts[2], SamplingParams(max_tokens=NEW_TOKENS, best_of=3, n=3)).results()
    stop = free[0].text.strip().split()[0][:3]  # a piece of text the beams write
    results = engine.submit(prompts[2], SamplingParams(max_tokens=NEW_TOKENS, best_of=3, n=3, stop=[stop])).results()
    assert any(r.finish_reason == "stop" for r in results)
    for r in results:
        assert stop not in r.text
        if r.finish_reason == "stop" and r.token_ids[-1] != 2:
            assert stop in engine.tokenizer.decode(r.token_ids)  # ended by the stop string, text cut before it


def test_cancel_frees_every_beam(engine, prompts):
    handle = engine.submit(prompts[2], SamplingParams(max_tokens=400, best_of=4, ignore_eos=True))
    handle.cancel()
    assert [r.finish_reason for r in handle.results()] == ["abort"]
    assert engine.stats()["kv_blocks_used"] == 0


def test_beam_search_that_cannot_fit_is_refused(engine, prompts):
    from appliance.runtime.engine import PromptTooLong

    with pytest.raises(PromptTooLong):
        engine.submit(prompts[0], SamplingParams(max_tokens=8000, best_of=4))
    with pytest.raises(ValueError):
        engine.submit(prompts[0], SamplingParams(max_tokens=8, best_of=2, n=3))


@pytest.mark.parametrize("case", ["paged-tight-kv", "openvino-static"])
def test_other_backends_and_kv_pressure_give_the_same_beams(case, prompts, paged_results):
    """Static slots (a fork copies the slot; ONNX Runtime shares that code); and a paged pool of 10 blocks for
    9 searches plus greedy traffic: forks preempt other requests, searches wait for each other, no deadlock."""
    from export.default_model import ensure_export

    backend, fmt, cfg = {
        "paged-tight-kv": ("openvino", "fp32", dict(F32, kv_cache_tokens=32 * 10)),
        "openvino-static": (
            "openvino",
            "fp32",
            dict(F32, static=True, static_context=128, static_batch=4, static_prefill_chunk=32),
        ),
    }[case]
    eng = Engine(ensure_export(backend, fmt), EngineConfig(**cfg))
    try:
        if case == "paged-tight-kv":
            got = run_searches(eng, prompts)
            assert eng.stats()["preemptions"] > 0
        else:  # static slots run one 4-beam search at a time: keep it short
            got = {}
            for beams, n, lp in SEARCHES[1:2]:
                handles = {
                    (beams, n, lp, i): eng.submit(
                        p, SamplingParams(max_tokens=NEW_TOKENS, best_of=beams, n=n, length_penalty=lp)
                    )
                    for i, p in enumerate(prompts[:2])
                }
                got.update({k: [r.token_ids for r in h.results()] for k, h in handles.items()})
        assert eng.stats()["kv_blocks_used"] == 0
    finally:
        eng.shutdown()
    assert got == {k: paged_results[k] for k in got}


# ---------------------------------------------------------------- HTTP: /v3/completions and chat


@pytest.fixture(scope="module")
def api(engine, tmp_path_factory):
    with in_process_api(engine, tmp_path_factory.mktemp("rt")) as client:
        yield client


def test_completions_best_of_returns_the_n_best_beams(api, engine, prompts):
    body = {"model": "m", "prompt": RAW[0], "max_tokens": NEW_TOKENS, "best_of": 4, "n": 3, "logprobs": 1}
    r = api.post("/v3/completions", json=body)
    assert r.status_code == 200, r.get_json()
    data = r.get_json()
    want = engine.submit(
        engine.tokenizer.encode(RAW[0]), SamplingParams(max_tokens=NEW_TOKENS, best_of=4, n=3, logprobs=1)
    ).results()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert [c["text"] for c in data["choices"]] == [w.text for w in want]
    assert [c["finish_reason"] for c in data["choices"]] == [w.finish_reason for w in want]
    assert [c["logprobs"]["token_logprobs"] for c in data["choices"]] == [[e.logprob for e in w.logprobs] for w in want]
    assert data["usage"]["completion_tokens"] == sum(len(w.token_ids) for w in want)
    two = api.post("/v3/completions", json={**body, "prompt": [RAW[0], "The quick brown fox"], "n": 2}).get_json()
    assert [c["index"] for c in two["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in two["choices"][:2]] == [w.text for w in want[:2]]


def test_chat_best_of(api, engine):
    messages = [{"role": "user", "content": CHAT[0]}]
    r = api.post(
        "/v3/chat/completions",
        json={"model": "m", "messages": messages, "max_tokens": NEW_TOKENS, "best_of": 2, "n": 2},
    )
    assert r.status_code == 200, r.get_json()
    choices = r.get_json()["choices"]
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))
    want = engine.submit(ids, SamplingParams(max_tokens=NEW_TOKENS, best_of=2, n=2)).results()
    assert [c["message"]["content"] for c in choices] == [w.text for w in want]


def test_best_of_errors(api):
    r = api.post("/v3/completions", json={"model": "m", "prompt": "x", "best_of": 2, "stream": True})
    assert r.status_code == 400 and r.get_json()["error"]["message"] == "best_of cannot be used in streaming mode"
    r = api.post("/v3/completions", json={"model": "m", "prompt": "x", "best_of": 4, "max_tokens": 8100})
    assert r.status_code == 400 and "do not fit" in r.get_json()["error"]["message"]
