"""DraftModel (runtime/speculative/draft.py) on tiny random models: its proposals are the draft model's own greedy
continuation (checked against an Engine on the draft's folder, f32), batched and chunked; the confidence threshold
cuts a chain; accepted() rolls the draft KV back so the next proposal is still right; release frees every block; a
full pool is no error; a draft with another tokenizer is refused. The draft is the tiny llama truncated to one layer
by the exporter's --num-layers (which these tests also check), the target the whole tiny llama."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from appliance.config import EngineConfig
from appliance.manifest import Manifest
from appliance.params import SamplingParams
from appliance.runtime.engine import Engine
from appliance.runtime.sequence import Sequence
from appliance.runtime.speculative.draft import DraftModel
from appliance.runtime.speculative.state import SpecState
from export.__main__ import main as export_main
from export.exporter import ExportError, export_model

F32 = EngineConfig(precision="f32")
PROMPTS = ([5, 17, 240, 33, 9, 71, 402, 88, 13, 600, 21, 7, 350], [44, 3, 901, 12, 12, 58])


@pytest.fixture(scope="module")
def dirs(tiny: Callable[[str], Path], exported, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target: the tiny llama fp32, draft: its first layer, exported with `python -m export --num-layers 1`)."""
    target, _ = exported("llama", "openvino", "fp32")
    draft = tmp_path_factory.mktemp("draft") / "llama-l1"
    assert export_main([str(tiny("llama")), str(draft), "--weight-format", "fp32", "--num-layers", "1"]) == 0
    return target, draft


@pytest.fixture(scope="module")
def reference(dirs: tuple[Path, Path]):
    """greedy(prompt, n) -> (the draft model's own greedy tokens, their probabilities), from an Engine."""
    engine = Engine(dirs[1], F32)
    cache: dict = {}

    def greedy(prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        key = (tuple(prompt), n)
        if key not in cache:
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
            result = engine.submit(list(prompt), params).results()[0]
            cache[key] = result.token_ids, [math.exp(lp.logprob or 0.0) for lp in result.logprobs or []]
        return cache[key]

    yield greedy
    engine.shutdown()


@pytest.fixture(scope="module")
def draft(dirs: tuple[Path, Path]):
    model = DraftModel(dirs[1], F32, target_dir=dirs[0], max_tokens_per_step=8, kv_tokens=4096)  # prompts go in chunks
    yield model
    model.close()


def sequence(proposer: DraftModel, prompt: list[int], k: int = 5, confidence: float | None = None) -> Sequence:
    seq = Sequence("r", len(prompt), list(prompt), SamplingParams(), 1000, None, None)  # type: ignore[arg-type]
    seq.spec = SpecState(proposer.name, max_k=k, confidence=confidence)
    proposer.start(seq)
    return seq


def verified(seq: Sequence, proposer: DraftModel, keep: list[int]) -> None:
    """What the engine does after a verification: the kept tokens appended, all but the last one computed."""
    seq.token_ids += keep
    seq.num_computed = len(seq.token_ids) - 1
    proposer.accepted(seq)


def test_exporter_num_layers(dirs: tuple[Path, Path], tiny: Callable[[str], Path], tmp_path: Path) -> None:
    draft = Manifest.load(dirs[1])
    assert (draft.num_layers, Manifest.load(dirs[0]).num_layers) == (1, 2)
    assert json.loads((dirs[1] / "config.json").read_text())["num_hidden_layers"] == 1
    assert draft.weight_compression["layers"] == "the first 1 of 2"
    with pytest.raises(ExportError, match="between 1 and the model's 2 layers"):
        export_model(tiny("llama"), tmp_path / "x", "openvino", "fp32", num_layers=3)


def test_proposals_are_the_drafts_greedy_chain(draft: DraftModel, reference) -> None:
    seqs = [sequence(draft, p) for p in PROMPTS]
    forwards = draft.forwards
    proposals = draft.propose([(seqs[0], 5), (seqs[1], 3)])
    # one forward per step with both in it: prompt chunks (13 + 6 tokens at 8 a step) then the greedy steps
    assert proposals == [reference(PROMPTS[0], 5)[0], reference(PROMPTS[1], 3)[0]]
    assert draft.forwards - forwards <= 8
    # the target kept 2 of 5 and then chose its own token; the other sequence kept all 3 plus a bonus token
    verified(seqs[0], draft, proposals[0][:2] + [77])
    verified(seqs[1], draft, proposals[1] + [123])
    assert (
        seqs[0].spec is not None and len(seqs[0].spec.data.tokens) == len(seqs[0].token_ids) - 1
    )  # the draft KV past the kept prefix is gone
    again = draft.propose([(seqs[0], 4), (seqs[1], 4)])
    assert again == [reference(seqs[0].token_ids, 4)[0], reference(seqs[1].token_ids, 4)[0]]
    for seq in seqs:
        draft.release(seq)
        draft.release(seq)  # twice is fine (a preemption, then the end)
    assert draft.pool.num_used == 0
    assert draft.propose([(seqs[0], 2)]) == [reference(seqs[0].token_ids, 2)[0]]  # after a release: from scratch
    draft.release(seqs[0])
    assert draft.pool.num_used == 0


def test_confidence_threshold_cuts_the_chain(draft: DraftModel, reference) -> None:
    tokens, probs = reference(PROMPTS[0], 6)
    cut = min(range(6), key=probs.__getitem__)  # the least confident token: the chain stops before it
    above = min(probs[:cut], default=1.0)
    seq = sequence(draft, PROMPTS[0], confidence=(probs[cut] + above) / 2)
    assert draft.propose([(seq, 6)]) == [tokens[:cut]]
    draft.release(seq)
    seq = sequence(draft, PROMPTS[0], confidence=min(probs) / 2)
    assert draft.propose([(seq, 6)]) == [tokens]
    draft.release(seq)
    assert draft.pool.num_used == 0


def test_full_pool_proposes_nothing(dirs: tuple[Path, Path], reference) -> None:
    small = DraftModel(dirs[1], F32, target_dir=dirs[0], max_tokens_per_step=64, kv_tokens=64)
    try:
        size = small.pool.num_blocks * small.pool.block_size
        big = [10 + 7 * i % 900 for i in range(size - 3)]  # with its 2 drafted tokens: every block
        first, second = sequence(small, big), sequence(small, PROMPTS[1])
        assert small.propose([(first, 2), (second, 2)]) == [reference(big, 2)[0], []]
        assert small.stats()["draft_kv_blocks_used"] == small.pool.num_blocks
        small.release(first)
        assert small.propose([(second, 2)]) == [reference(PROMPTS[1], 2)[0]]
        small.release(second)
        assert small.pool.num_used == 0
    finally:
        small.close()


def test_other_tokenizer_is_refused(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(dirs[1], other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same size, other meaning
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="tokenizer differs"):
        DraftModel(other, F32, target_dir=dirs[0], max_tokens_per_step=8, kv_tokens=4096)


def test_engine_with_its_own_model_as_draft(dirs: tuple[Path, Path]) -> None:
    """The target drafting for itself: every draft token is accepted, and the output is the non-speculative one."""
    target = dirs[0]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = Engine(target, F32)
    try:
        expected = [plain.submit(list(p), params).results()[0].token_ids for p in PROMPTS]
    finally:
        plain.shutdown()
    engine = Engine(target, EngineConfig(precision="f32", draft_model=str(target), num_assistant_tokens=4))
    assert engine.speculation.policy is not None  # the step costs are measured at load
    engine.speculation.policy = None  # draft on every step (a self-draft never pays)
    try:
        handles = [engine.submit(list(p), params) for p in PROMPTS]  # batched together
        assert [h.results()[0].token_ids for h in handles] == expected
        stats = engine.stats()
        assert stats["draft_tokens"] > 20 and stats["accepted_draft_tokens"] == stats["draft_tokens"]
        assert engine.proposers["draft"].stats()["draft_kv_blocks_used"] == 0
    finally:
        engine.shutdown()
