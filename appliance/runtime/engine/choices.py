"""n > 1 sampled choices of one prompt: the prompt is computed once.

The first choice (the leader) is scheduled alone; the others (its followers) wait off the scheduler's queues.
When the leader's prompt KV is complete, each follower forks it copy-on-write (full blocks by reference, the
partly filled last block copied; Scheduler.fork) and samples its first token from the same logits row. From then
on every choice is a sequence of its own: it is preempted, fails and finishes alone. A follower that finds no free
block for its tail, or whose leader ends before its prompt was computed, is queued to compute its own prompt.

FollowerForks is an object of the engine's (Engine.choices) with what it uses as its constructor's arguments: the
scheduler that forks and queues, the pool that says whether a tail block is free, and the backend's block copy.
"""

from __future__ import annotations

from collections.abc import Callable

from appliance.runtime.kv_cache import BlockPool
from appliance.runtime.scheduler import Scheduler
from appliance.runtime.sequence import Sequence, Status

CopyTails = Callable[[list[tuple[int, int, int]]], None]  # runs the (src, dst, positions) copies forks queued


class FollowerForks:
    """The n > 1 choices' forks: `fork` when a leader's prompt KV is complete, `release` when it ends before."""

    def __init__(self, scheduler: Scheduler, pool: BlockPool, copy_tails: CopyTails):
        self.scheduler, self.pool, self.copy_tails = scheduler, pool, copy_tails

    def fork(self, leader: Sequence) -> list[Sequence]:
        """leader's prompt KV is complete: the other choices start from it and sample their first token from the
        same logits row. One without a free block for its tail computes its own prompt later."""
        forked, copies = [], []
        tail = int(leader.num_computed % self.pool.block_size > 0)
        assert leader.followers is not None  # called for a leader with followers only (Engine._computed)
        for f in leader.followers:
            if f.status is Status.FINISHED:  # cancelled while waiting
                continue
            if not self.pool.can_allocate(tail):
                self.scheduler.add(f)
                continue
            if (copy := self.scheduler.fork(leader, f)) is not None:
                copies.append(copy)
            f.first_scheduled = leader.first_scheduled
            if leader.prompt_logprobs is not None:
                f.prompt_logprobs = list(leader.prompt_logprobs)
            forked.append(f)
        self.copy_tails(copies)
        leader.followers = None  # only now: if forking raised, _fail ends them all with the leader
        return forked

    def release(self, leader: Sequence) -> None:
        """leader ends before its prompt was computed: the other choices compute their own."""
        for f in leader.followers or ():
            if f.status is not Status.FINISHED:
                self.scheduler.add(f)
        leader.followers = None
