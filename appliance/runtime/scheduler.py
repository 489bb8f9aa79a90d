"""Continuous batching: which sequences run in the next step and how many tokens each feeds.

Every step decodes all running sequences (one token each) and spends the rest of the token budget on prompt
chunks (chunked prefill), so a long prompt never stalls running streams. New requests are admitted every step
while KV blocks and sequence slots allow. When the pool runs dry the newest running sequence is preempted
(its blocks freed, recomputed later) instead of failing with out-of-memory.

The scheduler is the only owner of its two queues (`waiting`, `running`) and of the invariants that go with them
(a sequence's status, its block table, the preemption count): the engine reads them but changes them only
through the methods here (add, fork, make_room, prioritize, preempt, finish, drop).
"""

from __future__ import annotations

import contextlib
from collections import deque

from appliance.runtime.kv_cache import BlockPool
from appliance.runtime.sequence import BeamGroup, Sequence, Status


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence, first: bool = False) -> None:
        """Queue seq for admission: last in line, or (first) next in line."""
        seq.status = Status.WAITING
        if first:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def num_queued(self) -> int:
        """Sequences not started: the waiting ones, with the n > 1 choices that wait for their prompt (a snapshot
        that other threads may take while the engine thread moves them)."""
        return sum(1 + len(s.followers or ()) for s in list(self.waiting))

    def sequences(self) -> list[Sequence]:
        """Every sequence the scheduler holds, running first (a copy: the caller may finish them as it goes)."""
        return list(self.running) + list(self.waiting)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """Returns (sequence, tokens to feed) pairs; blocks for them are already allocated."""
        budget = self.max_num_batched_tokens
        plan: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING:  # preempted while making room for an earlier one
                continue
            n = min(len(seq.token_ids) - seq.num_computed, budget)
            if not self._reserve(seq, n, plan):
                continue
            if seq.draft:
                n += self._draft_room(seq, n, budget - n)
            plan.append((seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table and seq.params.prompt_logprobs is None:  # those need every prompt position
                seq.block_table, seq.block_hashes = self.pool.match_prefix(
                    seq.prefix_tokens, seq.params.cache_scope, seq.prompt_chain
                )
                seq.num_computed = len(seq.block_table) * self.pool.block_size
                if seq.first_scheduled is None:  # its first admission: a preempted one's own blocks are no hit
                    seq.num_cached = min(seq.num_computed, seq.prompt_len)
            n = min(len(seq.token_ids) - seq.num_computed, budget)
            need = self.pool.blocks_for(seq.num_computed + n) - len(seq.block_table)
            if not self.pool.can_allocate(need):
                self._release(seq)
                seq.num_computed = 0
                break
            self.waiting.popleft()
            seq.block_table += self.pool.allocate(need)
            seq.status = Status.RUNNING
            self.running.append(seq)
            plan.append((seq, n))
            budget -= n
        return plan

    def _reserve(self, seq: Sequence, n: int, plan: list) -> bool:
        """Allocate blocks for n more tokens, preempting the newest other running sequence if needed."""
        need = self.pool.blocks_for(seq.num_computed + n) - len(seq.block_table)
        while not self.pool.can_allocate(need):
            victim = next(
                (s for s in reversed(self.running) if s is not seq and all(s is not p for p, _ in plan)), None
            )
            if victim is None:
                self.preempt(seq)
                return False
            self.preempt(victim)
        seq.block_table += self.pool.allocate(need)
        return True

    def _draft_room(self, seq: Sequence, n: int, budget: int) -> int:
        """How many of seq's draft tokens (speculative decoding) this step feeds after its n tokens: what the token
        budget and the free blocks allow, never preempting anyone for them; the rest of the draft is dropped."""
        room = min(len(seq.draft), budget) if seq.num_computed + n == len(seq.token_ids) else 0
        need = self.pool.blocks_for(seq.num_computed + n + room) - len(seq.block_table)
        if room and not self.pool.can_allocate(need):
            room = max(0, min(room, len(seq.block_table) * self.pool.block_size - seq.num_computed - n))
            need = 0
        if need > 0:
            seq.block_table += self.pool.allocate(need)
        del seq.draft[room:]
        return room

    def rollback(self, seq: Sequence) -> None:
        """After a verification: give back the blocks past seq's tokens (allocated for drafts it rejected)."""
        keep = self.pool.blocks_for(len(seq.token_ids))
        if len(seq.block_table) > keep:
            self.pool.free(seq.block_table[keep:])
            del seq.block_table[keep:]

    def computed(self, seq: Sequence) -> None:
        """After a step: name the blocks that just became full so later prompts can reuse them (an image's tokens
        named by the picture: Sequence.cache_tokens)."""
        bs = self.pool.block_size
        while len(seq.block_hashes) < seq.num_computed // bs:
            j = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if j else self.pool.root(seq.params.cache_scope)  # the key's namespace
            seq.block_hashes.append(
                self.pool.register(seq.block_table[j], parent, seq.cache_tokens(j * bs, (j + 1) * bs))
            )

    def preempt(self, seq: Sequence) -> None:
        """Recompute later: drop the KV, keep the tokens (prompt + generated so far)."""
        self._release(seq)
        self.preemptions += 1
        seq.num_computed = 0
        seq.draft = []
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int, int] | None:
        """child continues from parent's computed KV and runs: full blocks shared (ref + 1), the partly filled last
        one copied into a block of its own (both write their next position there). Returns that copy, (src, dst,
        positions), for the backend to make before the next forward (None: no partial block). The caller made
        sure one block is free when there is a partial block."""
        full, tail = divmod(parent.num_computed, self.pool.block_size)
        shared = parent.block_table[:full]
        self.pool.fork(shared)
        child.block_table, child.block_hashes = list(shared), list(parent.block_hashes[:full])
        copy = None
        if tail:
            block = self.pool.allocate(1)[0]
            copy = (parent.block_table[full], block, tail)
            child.block_table.append(block)
        child.num_computed, child.status = parent.num_computed, Status.RUNNING
        child.num_cached = parent.num_cached  # the same prompt, supplied the same way (n > 1 followers, beams)
        self.running.append(child)
        return copy

    def make_room(self, blocks: int, spare: BeamGroup | None = None) -> bool:
        """Free `blocks` KV blocks, preempting the newest running sequences (but none of group `spare`) if needed.
        False: not even that frees enough."""
        while not self.pool.can_allocate(blocks):
            victim = next((s for s in reversed(self.running) if spare is None or s.group is not spare), None)
            if victim is None:
                return False
            self.preempt(victim)
        return True

    def prioritize(self, group: BeamGroup) -> None:
        """Let one group of sequences (a beam search) through alone: preempt every other running sequence, and
        put the group's waiting sequences first in line (the rest keep their order)."""
        for seq in list(self.running):
            if seq.group is not group:
                self.preempt(seq)
        first = [s for s in self.waiting if s.group is group]
        rest = [s for s in self.waiting if s.group is not group]
        self.waiting.clear()
        self.waiting.extend(first + rest)

    def finish(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = Status.FINISHED
        try:
            self.waiting.remove(seq)
        except ValueError:
            pass

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []

    def drop(self, seq: Sequence) -> None:
        """Forget seq without touching its KV (the last resort when finishing it raised: its blocks may stay
        held, but no queue refers to it any more)."""
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        with contextlib.suppress(ValueError):
            self.waiting.remove(seq)
