"""The encoder's queue and how a forward's batch is chosen from it (appliance/server/encoders/service.py runs them).

Requests from every client queue; their inputs (texts' token ids, rerank pairs) are items. Each forward takes one
batch of items of similar length (a length bucket: the window of waiting items sorted by length, cut where the
padded size, longest x count, would pass `batch_tokens`): the bucket that holds the first waiting item of the
request whose turn it is, the requests taking turns (round robin), so a small request is not stuck behind a large
one that came first, and none waits behind later ones for long. A request's inputs may span several batches (and
share them with other requests); each result goes to its input's place.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

WINDOW = 1024  # waiting items sorted into length buckets per batch


@dataclass(eq=False)
class EncodeRequest:
    items: list[Any]  # token ids (embed) or (ids, token type ids) pairs (rerank)
    task: str
    results: list[Any] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)  # indexes of the items not batched yet
    remaining: int = 0  # items without a result yet
    error: BaseException | None = None
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    queued: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.results = [None] * len(self.items)
        self.waiting = list(range(len(self.items)))
        self.remaining = len(self.items)
        if not self.items:
            self.done.set()


Batch = list[tuple[EncodeRequest, int]]  # (request, its item's index) per input of a forward


def item_length(item: Any) -> int:
    return len(item[0]) if isinstance(item, tuple) else len(item)


def next_batch(queue: deque[EncodeRequest], batch_tokens: int, max_batch: int) -> Batch:
    """The length bucket holding the first waiting item of the request at the head of `queue` (whose turn it
    is); the items taken leave their requests' `waiting`, a request with none left leaves the queue, and the head
    goes to the back (round robin). The caller holds the queue's lock; `queue` is not empty."""
    window: Batch = []
    for req in queue:
        window += [(req, i) for i in req.waiting[: WINDOW - len(window)]]
        if len(window) >= WINDOW:
            break
    first = window[0]
    window.sort(key=lambda it: item_length(it[0].items[it[1]]))
    batches: list[Batch] = [[]]
    longest = 0
    for it in window:
        n = item_length(it[0].items[it[1]])
        if batches[-1] and (max(longest, n) * (len(batches[-1]) + 1) > batch_tokens or len(batches[-1]) >= max_batch):
            batches.append([])
            longest = 0
        batches[-1].append(it)
        longest = max(longest, n)
    batch = next(b for b in batches if first in b)
    taken: dict[EncodeRequest, set[int]] = {}
    for req, i in batch:
        taken.setdefault(req, set()).add(i)
    for req, indexes in taken.items():
        req.waiting = [i for i in req.waiting if i not in indexes]
        if not req.waiting:
            queue.remove(req)
    if queue and queue[0] is first[0]:  # round robin: the next batch starts from the next request
        queue.rotate(-1)
    return batch


def deliver(batch: Batch, values: Any) -> None:
    """Each forward result to its input's place; a request with all its results is done."""
    for (req, i), value in zip(batch, values, strict=True):
        req.results[i] = value
        req.remaining -= 1
        if req.remaining == 0:
            req.done.set()
