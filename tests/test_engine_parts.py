"""The engine's feature parts as objects on their own (runtime/engine/choices.py, speculation.py, beams.py): a real
Scheduler and BlockPool, plain Sequences, no model. Each test plays the engine's part by hand (what a step
computed, the logits it produced), so what is checked is each part's bookkeeping through its constructor's
dependencies: which blocks a fork shares or copies and when they are freed, what a verification keeps and rolls
back, how a beam search's group collects its rows, forks its beams and ends."""

from __future__ import annotations

import queue

from appliance.outputs import Timing
from appliance.params import SamplingParams
from appliance.runtime.engine.choices import FollowerForks
from appliance.runtime.kv_cache import BlockPool
from appliance.runtime.scheduler import Scheduler
from appliance.runtime.sequence import Sequence, Status

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
