"""Continuous batching: which sequences run in the next step and how many tokens each feeds.

Every step decodes all running sequences (one token each) and spends the rest of the token budget on prompt
chunks (chunked prefill), so a long prompt never stalls running streams. New requests are admitted every step
while KV blocks and sequence slots allow. When the pool runs dry the newest running sequence is preempted
(its blocks freed, recomputed later) instead of failing with out-of-memory.
"""
from __future__ import annotations

from collections import deque

from appliance.kv_cache import BlockPool
from appliance.sequence import Sequence, Status


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """Returns (sequence, tokens to feed) pairs; blocks for them are already allocated."""
        budget = self.max_num_batched_tokens
        plan: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING:       # preempted while making room for an earlier one
                continue
            n = min(len(seq.token_ids) - seq.num_computed, budget)
            if not self._reserve(seq, n, plan):
                continue
            plan.append((seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table and seq.params.prompt_logprobs is None:  # those need every prompt position
                seq.block_table, seq.block_hashes = self.pool.match_prefix(seq.token_ids)
                seq.num_computed = len(seq.block_table) * self.pool.block_size
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
            victim = next((s for s in reversed(self.running) if s is not seq and all(s is not p for p, _ in plan)),
                          None)
            if victim is None:
                self.preempt(seq)
                return False
            self.preempt(victim)
        seq.block_table += self.pool.allocate(need)
        return True

    def computed(self, seq: Sequence) -> None:
        """After a step: name the blocks that just became full so later prompts can reuse them."""
        bs = self.pool.block_size
        while len(seq.block_hashes) < seq.num_computed // bs:
            j = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if j else None
            seq.block_hashes.append(self.pool.register(seq.block_table[j], parent,
                                                       tuple(seq.token_ids[j * bs:(j + 1) * bs])))

    def preempt(self, seq: Sequence) -> None:
        """Recompute later: drop the KV, keep the tokens (prompt + generated so far)."""
        self._release(seq)
        self.preemptions += 1
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

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
