"""The Scheduler on its own: plain Sequences and a real BlockPool, no model. Each test plays the engine's part by
hand (compute what was planned, append a token), so what is checked is the scheduler's bookkeeping: the token
budget, admission limits, preemption and recompute, prefix-cache reuse, forks, and the queue methods the engine
uses instead of editing `running` / `waiting` itself."""

from __future__ import annotations

import queue

from appliance.outputs import Timing
from appliance.params import SamplingParams
from appliance.runtime.kv_cache import BlockPool
from appliance.runtime.scheduler import Scheduler
from appliance.runtime.sequence import Sequence, Status

BS = 4  # block size: small, so that a few tokens make full blocks


def make_seq(prompt: list[int] | int, rid: str = "r", group: object = None, **params) -> Sequence:
    ids = list(range(100, 100 + prompt)) if isinstance(prompt, int) else list(prompt)
    return Sequence(
        rid, len(ids), ids, SamplingParams(**params), len(ids) + 64, queue.SimpleQueue(), Timing(), group=group
    )


def make_scheduler(num_blocks: int = 64, max_seqs: int = 8, budget: int = 64, prefix: bool = False) -> Scheduler:
    return Scheduler(BlockPool(num_blocks, BS, prefix_caching=prefix), max_seqs, budget)


def run_step(sched: Scheduler, token: int = 7) -> list[tuple[Sequence, int]]:
    """One engine step without a model: the planned tokens are computed; a sequence whose tokens are all
    computed samples `token`."""
    plan = sched.schedule()
    for seq, n in plan:
        seq.num_computed += n
        sched.computed(seq)
        if seq.num_computed == len(seq.token_ids):
            seq.token_ids.append(token)
    return plan


def fed(plan: list[tuple[Sequence, int]]) -> dict[str, int]:
    return {seq.request_id: n for seq, n in plan}


def held(sched: Scheduler) -> int:
    return sum(len(s.block_table) for s in sched.running)


# ---------------------------------------------------------------- chunked prefill and admission


def test_a_long_prompt_is_fed_in_chunks_of_the_token_budget():
    sched = make_scheduler(budget=16)
    a = make_seq(40, "a")
    sched.add(a)
    assert fed(run_step(sched)) == {"a": 16}
    assert fed(run_step(sched)) == {"a": 16}
    assert fed(run_step(sched)) == {"a": 8}  # the prompt is complete: a token is sampled
    assert fed(run_step(sched)) == {"a": 1}  # decoding
    assert len(a.block_table) == sched.pool.blocks_for(a.num_computed)


def test_running_sequences_decode_first_and_prompts_get_the_rest_of_the_budget():
    sched = make_scheduler(budget=16)
    a, b = make_seq(5, "a"), make_seq(40, "b")
    sched.add(a)
    run_step(sched)  # a's prompt, a samples its first token
    sched.add(b)
    assert fed(run_step(sched)) == {"a": 1, "b": 15}
    assert fed(run_step(sched)) == {"a": 1, "b": 15}
    assert a.num_generated == 3 and b.num_computed == 30


def test_admission_stops_at_max_num_seqs():
    sched = make_scheduler(max_seqs=2)
    seqs = [make_seq(5, f"s{i}") for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert set(fed(run_step(sched))) == {"s0", "s1"}
    assert list(sched.waiting) == [seqs[2]] and seqs[2].status is Status.WAITING and not seqs[2].block_table
    sched.finish(seqs[0])
    assert set(fed(run_step(sched))) == {"s1", "s2"}


def test_admission_waits_for_free_blocks_without_holding_any():
    sched = make_scheduler(num_blocks=4)  # 16 positions
    a, b = make_seq(12, "a"), make_seq(8, "b")
    sched.add(a)
    sched.add(b)
    assert fed(run_step(sched)) == {"a": 12}  # b needs 2 blocks, 1 is free: it waits, FIFO
    assert list(sched.waiting) == [b] and b.block_table == [] and b.num_computed == 0
    assert sched.pool.num_free == 1
    sched.finish(a)
    assert sched.pool.num_free == 4
    assert fed(run_step(sched)) == {"b": 8}


# ---------------------------------------------------------------- preemption


def test_the_newest_running_sequence_is_preempted_and_recomputed():
    sched = make_scheduler(num_blocks=4, budget=64)
    a, b = make_seq(7, "a"), make_seq(7, "b")
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prompts: 2 blocks each, the pool is full
    assert sched.pool.num_free == 0 and a.num_computed == b.num_computed == 7
    plan = run_step(sched)  # a's 8th position fits its block; b's too
    assert fed(plan) == {"a": 1, "b": 1}
    plan = run_step(sched)  # position 9 needs a third block each: b (newest) makes room
    assert fed(plan) == {"a": 1}
    assert sched.preemptions == 1
    assert b.status is Status.WAITING and b.block_table == [] and b.num_computed == 0
    assert list(sched.waiting) == [b] and sched.running == [a]
    sched.finish(a)
    plan = run_step(sched)  # b comes back: prompt and generated tokens recomputed
    assert fed(plan) == {"b": 9} and b.num_generated == 3


def test_a_sequence_that_cannot_grow_alone_preempts_itself():
    sched = make_scheduler(num_blocks=2, budget=64)
    a = make_seq(8, "a")
    sched.add(a)
    run_step(sched)  # 2 blocks: the whole pool
    assert run_step(sched) == []  # position 9 needs a block nobody else can give
    assert a.status is Status.WAITING and sched.preemptions == 1 and sched.pool.num_free == 2


def test_preempted_blocks_serve_the_recompute_from_the_prefix_cache():
    sched = make_scheduler(num_blocks=5, prefix=True)
    a, b = make_seq(list(range(200, 209)), "a"), make_seq(6, "b")  # no common prefix: b's blocks are its own
    sched.add(a)
    sched.add(b)
    for _ in range(10):  # both decode until b (newest) needs a block the pool cannot give
        run_step(sched)
        if b.status is Status.WAITING:
            break
    assert b.status is Status.WAITING and sched.preemptions == 1 and b.num_computed == 0
    assert len(b.token_ids) == 9  # its first two blocks were full, and named, before it left
    sched.finish(a)
    hits = sched.pool.hits
    assert fed(run_step(sched)) == {"b": 1}  # they waited in the cache: only the last position is fed
    assert sched.pool.hits - hits == 8 and len(b.block_table) == 3


# ---------------------------------------------------------------- prefix cache


def test_a_prompt_reuses_the_full_blocks_a_finished_one_left_in_the_cache():
    sched = make_scheduler(num_blocks=8, prefix=True)
    shared = list(range(50, 58))  # two full blocks
    a = make_seq(shared + [1, 2, 3], "a")
    sched.add(a)
    run_step(sched)
    a_blocks = list(a.block_table[:2])
    assert len(a.block_hashes) == 2  # the full blocks got names after the step
    sched.finish(a)
    assert sched.pool.num_free == 8  # freed, but kept with their names
    b = make_seq(shared + [9, 9], "b")
    sched.add(b)
    assert fed(run_step(sched)) == {"b": 2}  # only the tokens past the cached prefix
    assert b.block_table[:2] == a_blocks and sched.pool.hits == 8


def test_the_last_prompt_token_is_always_computed():
    sched = make_scheduler(prefix=True)
    prompt = list(range(50, 58))  # exactly two blocks
    a = make_seq(prompt, "a")
    sched.add(a)
    run_step(sched)
    sched.finish(a)
    b = make_seq(prompt, "b")
    sched.add(b)
    assert fed(run_step(sched)) == {"b": 4}  # one block matched: its logits are needed for the first sample


def test_prompt_logprobs_bypass_the_prefix_cache():
    sched = make_scheduler(prefix=True)
    prompt = list(range(50, 61))
    a = make_seq(prompt, "a")
    sched.add(a)
    run_step(sched)
    sched.finish(a)
    b = make_seq(prompt, "b", prompt_logprobs=1)
    sched.add(b)
    assert fed(run_step(sched)) == {"b": 11}  # every prompt position is fed: its logits are wanted


def test_a_shared_prefix_block_is_held_until_its_last_owner_lets_go():
    sched = make_scheduler(num_blocks=8, prefix=True)
    shared = list(range(50, 58))
    a = make_seq(shared + [1], "a")
    sched.add(a)
    run_step(sched)
    b = make_seq(shared + [2], "b")
    sched.add(b)
    run_step(sched)
    assert b.block_table[:2] == a.block_table[:2]
    used = sched.pool.num_used
    sched.finish(a)
    assert sched.pool.num_used == used - 1  # a's own tail block only
    sched.finish(b)
    assert sched.pool.num_used == 0


# ---------------------------------------------------------------- forks


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    sched = make_scheduler(num_blocks=8)
    parent = make_seq(10, "p")
    sched.add(parent)
    run_step(sched)  # 10 positions: 2 full blocks + 2 positions in a third
    child = make_seq(parent.token_ids, "c")
    free = sched.pool.num_free
    copy = sched.fork(parent, child)
    assert copy == (parent.block_table[2], child.block_table[2], 2)
    assert child.block_table[:2] == parent.block_table[:2] and child.block_table[2] != parent.block_table[2]
    assert child.num_computed == 10 and child.status is Status.RUNNING and sched.running[-1] is child
    assert sched.pool.num_free == free - 1
    sched.finish(parent)
    assert sched.pool.num_used == 3  # the shared blocks stay with the child
    sched.finish(child)
    assert sched.pool.num_used == 0


def test_fork_at_a_block_boundary_copies_nothing():
    sched = make_scheduler()
    parent = make_seq(8, "p")
    sched.add(parent)
    run_step(sched)
    parent.token_ids.pop()  # as if nothing was sampled yet: 8 computed, all full blocks
    child = make_seq(parent.token_ids, "c")
    assert sched.fork(parent, child) is None
    assert child.block_table == parent.block_table


# ---------------------------------------------------------------- the queue methods the engine uses


def test_make_room_preempts_the_newest_outside_the_spared_group():
    sched = make_scheduler(num_blocks=6)
    group = object()
    a, g1, b, g2 = make_seq(7, "a"), make_seq(3, "g1", group), make_seq(3, "b"), make_seq(3, "g2", group)
    for s in (a, g1, b, g2):
        sched.add(s)
    run_step(sched)  # 2 + 1 + 1 + 1 blocks: one free
    assert sched.make_room(1, spare=group) and sched.preemptions == 0
    assert sched.make_room(2, spare=group)
    assert sched.preemptions == 1 and b.status is Status.WAITING and a.status is Status.RUNNING
    assert sched.make_room(4, spare=group)  # then a
    assert [s.request_id for s in sched.running] == ["g1", "g2"]
    assert not sched.make_room(5, spare=group)  # only the group is left: nothing more to take
    assert [s.request_id for s in sched.running] == ["g1", "g2"]


def test_prioritize_lets_one_group_through_alone():
    sched = make_scheduler(max_seqs=3)
    group = object()
    seqs = [make_seq(3, "a"), make_seq(3, "g1", group), make_seq(3, "b"), make_seq(3, "c"), make_seq(3, "g2", group)]
    for s in seqs:
        sched.add(s)
    run_step(sched)  # a, g1, b run; c and g2 wait
    sched.prioritize(group)
    assert [s.request_id for s in sched.running] == ["g1"]
    assert [s.request_id for s in sched.waiting][0] == "g2"
    assert {s.request_id for s in sched.waiting} == {"a", "b", "c", "g2"}
    assert all(not s.block_table for s in sched.waiting) and sched.preemptions == 2
    assert set(fed(run_step(sched))) >= {"g1", "g2"}


def test_num_queued_counts_waiting_sequences_with_their_followers():
    sched = make_scheduler(max_seqs=1)
    running, leader, other = make_seq(3, "run"), make_seq(3, "lead"), make_seq(3, "other")
    leader.followers = [make_seq(3, "f1"), make_seq(3, "f2")]
    sched.add(running)
    run_step(sched)
    sched.add(leader)
    sched.add(other)
    assert sched.num_queued() == 4  # lead + its 2 choices + other; the running one is not queued
    assert [s.request_id for s in sched.sequences()] == ["run", "lead", "other"]


def test_add_first_puts_a_sequence_next_in_line():
    sched = make_scheduler(max_seqs=1)
    a, b, c = make_seq(3, "a"), make_seq(3, "b"), make_seq(3, "c")
    sched.add(a)
    sched.add(b)
    sched.add(c, first=True)
    assert [s.request_id for s in sched.waiting] == ["c", "a", "b"]
    assert fed(run_step(sched)) == {"c": 3}


def test_drop_forgets_a_sequence_without_freeing_its_blocks():
    sched = make_scheduler(max_seqs=1)
    a, b = make_seq(5, "a"), make_seq(5, "b")
    sched.add(a)
    sched.add(b)
    run_step(sched)
    used = sched.pool.num_used
    sched.drop(a)
    sched.drop(b)
    assert not sched.has_work() and a.status is b.status is Status.FINISHED
    assert sched.pool.num_used == used  # a bug's blocks may stay held; no queue refers to them


def test_finish_frees_and_is_safe_for_a_waiting_sequence():
    sched = make_scheduler(max_seqs=1)
    a, b = make_seq(5, "a"), make_seq(5, "b")
    sched.add(a)
    sched.add(b)
    run_step(sched)
    sched.finish(b)  # cancelled while waiting
    sched.finish(a)
    assert not sched.has_work() and sched.pool.num_used == 0
    assert a.block_table == [] and a.status is Status.FINISHED
