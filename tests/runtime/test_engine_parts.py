"""The engine's feature parts as objects on their own (runtime/engine/choices.py, speculation.py, beams.py): a real
Scheduler and BlockPool, plain Sequences, no model. Each test plays the engine's part by hand (what a step
computed, the logits it produced), so what is checked is each part's bookkeeping through its constructor's
dependencies: which blocks a fork shares or copies and when they are freed, what a verification keeps and rolls
back, how a beam search's group collects its rows, forks its beams and ends."""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest

from appliance.config import EngineConfig
from appliance.outputs import Timing
from appliance.params import SamplingParams
from appliance.runtime.engine.beams import BeamSearches
from appliance.runtime.engine.choices import FollowerForks
from appliance.runtime.engine.speculation import Speculation
from appliance.runtime.kv_cache import BlockPool
from appliance.runtime.sampling import SequenceSampler
from appliance.runtime.scheduler import Scheduler
from appliance.runtime.sequence import BeamGroup, Sequence, Status
from appliance.runtime.speculative.base import Proposer
from appliance.runtime.speculative.state import SpecState
from appliance.runtime.tokenizer import Tokenizer
from tests.runtime.test_tokenizer import load_kind

BS = 4  # block size: small, so that a few tokens make full blocks


def make_seq(prompt: int, rid: str = "r", max_tokens: int = 16, **params) -> Sequence:
    ids = list(range(100, 100 + prompt))
    p = SamplingParams(max_tokens=max_tokens, **params)
    return Sequence(rid, len(ids), ids, p, len(ids) + max_tokens, queue.SimpleQueue(), Timing())


def make_scheduler(num_blocks: int = 32, max_seqs: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(BlockPool(num_blocks, BS), max_seqs, budget)


def compute(sched: Scheduler) -> list[tuple[Sequence, int]]:
    """One step's forward without a model: every planned token is computed."""
    plan = sched.schedule()
    for seq, n in plan:
        seq.num_computed += n
        sched.computed(seq)
    return plan


# ---------------------------------------------------------------- n > 1 choices (FollowerForks)


class Copies:
    """The backend's block copy, recorded: (src, dst, positions) per queued copy."""

    def __init__(self) -> None:
        self.made: list[tuple[int, int, int]] = []

    def __call__(self, copies: list[tuple[int, int, int]]) -> None:
        self.made += copies


def leader_with(followers: int, prompt: int = 10) -> tuple[Sequence, list[Sequence]]:
    leader = make_seq(prompt, "c0")
    others = [make_seq(prompt, f"c{i + 1}") for i in range(followers)]
    leader.followers = others
    return leader, others


def test_followers_share_the_leaders_full_blocks_and_copy_its_tail():
    sched, copies = make_scheduler(), Copies()
    forks = FollowerForks(sched, sched.pool, copies)
    leader, others = leader_with(2)  # 10 prompt tokens: 2 full blocks and a tail of 2
    sched.add(leader)
    compute(sched)
    assert sched.pool.num_used == 3
    forked = forks.fork(leader)
    assert forked == others and leader.followers is None
    for f in others:
        assert f.status is Status.RUNNING and f.num_computed == 10 and f in sched.running
        assert f.block_table[:2] == leader.block_table[:2]  # the full blocks, by reference
        assert f.block_table[2] != leader.block_table[2]  # the tail: a block of its own, copied
    assert copies.made == [(leader.block_table[2], f.block_table[2], 2) for f in others]
    assert sched.pool.num_used == 3 + 2  # one tail block per follower, nothing else
    sched.finish(leader)  # the shared blocks stay with the followers
    assert sched.pool.num_used == 2 + 2
    for f in others:
        sched.finish(f)
    assert sched.pool.num_used == 0


def test_a_block_aligned_prompt_forks_without_a_copy():
    sched, copies = make_scheduler(), Copies()
    forks = FollowerForks(sched, sched.pool, copies)
    leader, others = leader_with(1, prompt=8)
    sched.add(leader)
    compute(sched)
    assert forks.fork(leader) == others and copies.made == []
    assert others[0].block_table == leader.block_table and sched.pool.num_used == 2


def test_a_cancelled_follower_is_skipped_and_one_without_a_tail_block_computes_its_own():
    sched, copies = make_scheduler(num_blocks=4), Copies()
    forks = FollowerForks(sched, sched.pool, copies)
    leader, (gone, first, second) = leader_with(3)
    gone.status = Status.FINISHED  # cancelled while it waited
    sched.add(leader)
    compute(sched)  # 3 blocks of 4 used: one tail block left
    assert forks.fork(leader) == [first]
    assert gone.block_table == [] and gone not in sched.running and gone not in sched.waiting
    assert second.status is Status.WAITING and list(sched.waiting) == [second] and second.block_table == []
    assert sched.pool.num_used == 4 and len(copies.made) == 1


def test_a_leader_ending_before_its_prompt_hands_its_followers_to_the_scheduler():
    sched = make_scheduler()
    forks = FollowerForks(sched, sched.pool, Copies())
    leader, (gone, waiting) = leader_with(2)
    gone.status = Status.FINISHED
    sched.add(leader)
    forks.release(leader)
    assert leader.followers is None and list(sched.waiting) == [leader, waiting]
    forks.release(leader)  # nothing left to release
    assert list(sched.waiting) == [leader, waiting]


# ---------------------------------------------------------------- speculative decoding (Speculation)

VOCAB = 256


class FakeProposer(Proposer):
    """Drafts what it is told; records what the engine tells it back."""

    name = "fake"

    def __init__(self, drafts: list[int], adaptive: bool = False) -> None:
        self.drafts, self.adaptive = drafts, adaptive
        self.accepted_seqs: list[str] = []
        self.released: list[str] = []

    def propose(self, batch: list[tuple[Sequence, int]]) -> list[list[int]]:
        return [self.drafts[:k] for _, k in batch]

    def accepted(self, seq: Sequence) -> None:
        self.accepted_seqs.append(seq.request_id)

    def release(self, seq: Sequence) -> None:
        self.released.append(seq.request_id)


def speculation(proposer: FakeProposer, sched: Scheduler, **config) -> tuple[Speculation, dict[str, int]]:
    counters = {"draft_tokens": 0, "accepted_draft_tokens": 0}
    return Speculation({proposer.name: proposer}, sched, EngineConfig(**config), counters), counters


def decoding(sched: Scheduler, *rids: str, prompt: int = 7, k: int = 5) -> list[Sequence]:
    """Sequences past their prompt (the first token sampled, not computed yet) that speculate with k drafts."""
    seqs = [make_seq(prompt, rid) for rid in rids or ("s",)]
    for seq in seqs:
        seq.spec = SpecState("fake", max_k=k)
        sched.add(seq)
    compute(sched)
    for seq in seqs:
        seq.token_ids.append(50)
    return seqs


def argmax_sample(logits: np.ndarray, ready: list[tuple[Sequence, int]]):
    """The engine's sampler played by argmax: one batched output, (sequence, output, row)."""
    out = SimpleNamespace(token_ids=np.argmax(logits, axis=1))
    return [(seq, out, j) for j, (seq, _) in enumerate(ready)]


def append(seq: Sequence, token: int, out, j: int) -> None:  # the engine's _append without text or chunks
    seq.token_ids.append(token)


@contextlib.contextmanager
def not_isolated(seq: Sequence) -> Iterator[None]:
    yield


def fed_rows(draws: list[int]) -> np.ndarray:
    """The logits of the fed positions: position j's argmax is draws[j]."""
    rows = np.zeros((len(draws), VOCAB), dtype=np.float32)
    rows[np.arange(len(draws)), draws] = 1.0
    return rows


def step(spec: Speculation, sched: Scheduler, draws: dict[str, list[int]], append=append, isolate=not_isolated):
    """One speculative step without a model: drafts, the schedule that feeds them, the verification."""
    spec.propose()
    plan = sched.schedule()
    verifying = [(seq, fed_rows(draws[seq.request_id][:n])) for seq, n in plan if seq.draft]
    spec.verify(verifying, argmax_sample, append, isolate)
    return plan


def test_verify_keeps_the_drafts_the_model_draws_and_gives_back_the_rest():
    sched = make_scheduler()
    proposer = FakeProposer([51, 52, 53, 54, 55])
    spec, counters = speculation(proposer, sched)
    [seq] = decoding(sched)  # 8 tokens, 7 computed: 2 blocks
    assert sched.pool.num_used == 2
    plan = step(spec, sched, {"s": [51, 52, 99, 0, 0, 0]})  # the model draws 51, 52, then not 53
    assert plan == [(seq, 6)]  # its last token and 5 drafts: positions 7..12, 4 blocks while verifying
    assert seq.generated == [50, 51, 52, 99]  # 2 drafts kept and the model's own next token
    assert seq.num_computed == 10  # 50, 51, 52 fed and kept; 99 is fed next step
    assert len(seq.block_table) == 3 and sched.pool.num_used == 3  # the block of rejected positions went back
    assert seq.draft == [] and (seq.spec.proposed, seq.spec.accepted, seq.spec.rejected) == (5, 2, 3)
    assert counters == {"draft_tokens": 5, "accepted_draft_tokens": 2}
    assert proposer.accepted_seqs == ["s"] and seq.spec.k == 5  # prompt lookup's k does not adapt


def test_all_drafts_accepted_give_one_more_token_and_nothing_is_rolled_back():
    sched = make_scheduler()
    spec, counters = speculation(FakeProposer([51, 52, 53, 54, 55]), sched)
    [seq] = decoding(sched)
    step(spec, sched, {"s": [51, 52, 53, 54, 55, 77]})
    assert seq.generated == [50, 51, 52, 53, 54, 55, 77] and seq.num_computed == 13
    assert len(seq.block_table) == 4 and counters["accepted_draft_tokens"] == 5


def test_an_adaptive_proposer_drafts_fewer_after_a_rejection_and_pauses():
    sched = make_scheduler()
    proposer = FakeProposer([51, 52], adaptive=True)
    spec, counters = speculation(proposer, sched)
    [seq] = decoding(sched)
    plan = step(spec, sched, {"s": [99] * 6})  # 2 drafts padded to 5; the first is rejected
    assert plan == [(seq, 6)] and seq.generated == [50, 99] and seq.num_computed == 8
    assert (seq.spec.k, seq.spec.misses, seq.spec.pause) == (4, 1, 2)  # k - 1, and a pause of 2 steps
    assert counters == {"draft_tokens": 2, "accepted_draft_tokens": 0}  # padding is not counted
    assert len(seq.block_table) == sched.pool.blocks_for(len(seq.token_ids))
    spec.propose()
    assert seq.draft == [] and seq.spec.pause == 1  # paused: no draft, and an empty one is not padded


def test_a_short_draft_is_padded_to_k_and_padding_is_not_counted():
    sched = make_scheduler()
    spec, counters = speculation(FakeProposer([51]), sched)  # prompt lookup: not adaptive
    [seq] = decoding(sched, k=3)
    spec.propose()
    assert seq.draft == [51, 51, 51] and seq.spec.real == 1  # the same fed shape every step
    sched.schedule()
    spec.verify([(seq, fed_rows([51, 51, 60, 0]))], argmax_sample, append, not_isolated)
    assert seq.generated == [50, 51, 51, 60]  # a filler token the model also drew is kept
    assert counters == {"draft_tokens": 1, "accepted_draft_tokens": 1}


def test_no_drafts_past_speculation_max_batch():
    sched = make_scheduler()
    spec, _ = speculation(FakeProposer([51, 52]), sched, speculation_max_batch=1)
    a, b = decoding(sched, "a", "b")
    spec.propose()
    assert a.draft == [] and b.draft == []
    sched.finish(b)
    spec.propose()
    assert a.draft == [51, 52, 52, 52, 52]


def test_a_failing_sequence_fails_alone_in_the_verification():
    """An exception in one sequence's part of the verification (here its append) fails it alone, through the
    engine's isolate: the other sequence verifies in full."""
    sched = make_scheduler()
    proposer = FakeProposer([51, 52, 53])
    spec, _ = speculation(proposer, sched)
    bad, good = decoding(sched, "bad", "good", k=3)
    failed: list[str] = []

    def breaking(seq, token, out, j):
        if seq is bad:
            raise ValueError("broken")
        append(seq, token, out, j)

    @contextlib.contextmanager
    def isolate(seq):  # the engine's _isolated: the failure ends that sequence alone
        try:
            yield
        except ValueError:
            failed.append(seq.request_id)
            sched.finish(seq)

    step(spec, sched, {"bad": [51, 52, 53, 54], "good": [51, 52, 53, 54]}, breaking, isolate)
    assert failed == ["bad"] and bad.status is Status.FINISHED and bad.block_table == []
    assert good.generated == [50, 51, 52, 53, 54] and good.num_computed == 11
    assert proposer.accepted_seqs == ["good"]
    spec.release(good)
    assert proposer.released == ["good"] and good.draft == []


def test_check_refuses_what_the_proposers_cannot_do():
    sched = make_scheduler()
    spec, _ = speculation(FakeProposer([]), sched)
    spec.check(SamplingParams(num_assistant_tokens=3))
    with pytest.raises(ValueError, match="cannot be used together"):
        spec.check(SamplingParams(num_assistant_tokens=3, assistant_confidence_threshold=0.5))
    with pytest.raises(ValueError, match="needs a draft model"):
        spec.check(SamplingParams(assistant_confidence_threshold=0.5))
    static = Speculation({}, sched, EngineConfig(), {})
    with pytest.raises(ValueError, match="needs paged attention"):
        static.check(SamplingParams(max_ngram_size=2))


# ---------------------------------------------------------------- beam search (BeamSearches)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return load_kind("bytelevel", tmp_path_factory)  # a small real tokenizer: the results' text is decoded


def beam_search(tokenizer, sched: Scheduler, copies=None, **params) -> tuple[BeamSearches, Sequence, BeamGroup]:
    beams = BeamSearches(sched, sched.pool, tokenizer, copies or Copies(), {"generated_tokens": 0})
    root = make_seq(7, "b", **params)
    root.sampler = SequenceSampler(root.params, root.token_ids[:7])
    root.group = BeamGroup(root, 0)
    sched.add(root)
    return beams, root, root.group


def rows(*tops: tuple[int, int]) -> np.ndarray:
    """One logits row per beam: its best token first, its second best next, the rest far below."""
    out = np.full((len(tops), VOCAB), -20.0, dtype=np.float32)
    for i, (best, second) in enumerate(tops):
        out[i, best], out[i, second] = 5.0, 4.0
    return out


def test_a_search_forks_its_beams_and_ends_with_its_n_best(tokenizer):
    sched, copies = make_scheduler(), Copies()
    beams, root, group = beam_search(tokenizer, sched, copies, max_tokens=3, best_of=2, n=2)
    compute(sched)  # the prompt: 7 tokens, 2 blocks (the second holds 3)
    beams.collect([(root, 0)], rows((60, 61)), not_isolated)
    child = group.beams[1]
    assert group.beams == [root, child] and root.generated == [60] and child.generated == [61]
    assert child.block_table[0] == root.block_table[0] and child.block_table[1] != root.block_table[1]
    assert copies.made == [(root.block_table[1], child.block_table[1], 3)] and sched.pool.num_used == 3
    assert child.status is Status.RUNNING and child.num_computed == 7
    assert beams.counters["generated_tokens"] == 2
    for _ in range(2):
        plan = compute(sched)
        assert sorted(s.request_id for s, _ in plan) == ["b", "b"]
        beams.collect([(root, 0)], rows((62, 63)), not_isolated)  # one row in: the search waits for the other
        assert len(group.logits) == 1 and not group.done
        beams.collect([(group.beams[1], 1)], rows((62, 63), (64, 65)), not_isolated)
    assert group.done and sched.pool.num_used == 0 and not sched.running and not sched.waiting
    results = group.out.get_nowait()
    assert len(results) == 2 and all(c.finish_reason == "length" and c.completion_tokens == 3 for c in results)
    assert results[0].token_ids == [60, 62, 62] and results[0].text == tokenizer.decode([60, 62, 62])
    assert root.timing.total_time is not None


def test_an_aborted_search_frees_every_beam_once(tokenizer):
    sched = make_scheduler()
    beams, root, group = beam_search(tokenizer, sched, max_tokens=8, best_of=3, n=2)
    compute(sched)
    beams.collect([(root, 0)], rows((60, 61)), not_isolated)
    assert len(group.beams) >= 2 and sched.pool.num_used > 2
    beams.finish(group, error="internal error: X")
    assert group.done and sched.pool.num_used == 0 and all(s.status is Status.FINISHED for s in group.beams)
    chunks = group.out.get_nowait()
    assert [(c.finish_reason, c.error) for c in chunks] == [("abort", "internal error: X")] * 2
    beams.finish(group)  # ended already: nothing more is sent
    assert group.out.empty()


def test_a_search_that_raises_fails_in_isolate_and_unstall_lets_the_oldest_through(tokenizer):
    sched = make_scheduler()
    beams, root, group = beam_search(tokenizer, sched, max_tokens=8, best_of=2, n=1)
    other = make_seq(5, "other")
    sched.add(other)
    compute(sched)
    beams.unstall()  # nothing was stalled, but the oldest search goes first: the other sequence is preempted
    assert sched.running == [root] and list(sched.waiting) == [other]
    group.search.candidates = None  # type: ignore[assignment]  # the search's scoring raises (TypeError)
    failed: list[str] = []

    @contextlib.contextmanager
    def isolate(seq):
        try:
            yield
        except TypeError:
            failed.append(seq.request_id)
            beams.finish(seq.group, error="internal error: TypeError")

    beams.collect([(root, 0)], rows((60, 61)), isolate)
    assert failed == ["b"] and group.done and root.block_table == [] and other.status is Status.WAITING
