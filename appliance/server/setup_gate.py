"""One request's set-up at a time in the engine process, taken in turn by tenant: the gate a job passes to be
submitted with its bad words and prediction tokenized, its grammar compiled and its ban table built
(JobRunner.submit). Its prompts are tokenized before the gate: the tokenizer drops the GIL, and a long prompt's
seconds of encoding inside it held every other tenant's set-up.

Why: set-up runs on the job's own connection thread, off the engine thread, but on the same cores and under the
same GIL, and nothing bounded how many ran at once: the 2026-12-01 review saw 40 distinct 40-field JSON schemas
sent at once stall four live streams 3.25 s (llguidance drops the GIL while it compiles, so all forty ran), and
four requests at the per-request `setup_work` limit raise a victim stream's median token gap from 116 to 511 ms.
With one set-up at a time, set-up takes at most one core and is the GIL's only other contender beside the engine
thread (the interpreter hands the GIL back within its 5 ms switch interval), whatever the number of requests;
requests wait here instead, in the engine process. Each set-up is short (a 40-field schema compiles in 3-11 ms
on the dev box, a prompt tokenizes in well under that), so the wait is a queue of short turns.

Fair: waiters are served tenant by tenant in turn (round robin over the tenants waiting, first come first served
within one), so a key sending forty schemas makes another key's request wait for one set-up of its, not forty.
Bounded: a job waiting here holds its connection thread, which the workers' --threads bound.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterator
from contextlib import contextmanager


class SetupGate:
    """`with gate.hold(tenant):` one holder at a time; the next one chosen round robin over the tenants waiting."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy = False
        self._waiting: OrderedDict[str, deque[threading.Event]] = OrderedDict()  # tenant -> its waiters, in order

    @contextmanager
    def hold(self, tenant: str) -> Iterator[None]:
        turn = None
        with self._lock:
            if self._busy:
                turn = threading.Event()
                self._waiting.setdefault(tenant, deque()).append(turn)
            else:
                self._busy = True
        if turn is not None:
            turn.wait()  # set by the holder before us, which handed the gate over (still busy)
        try:
            yield
        finally:
            self._hand_over()

    def waiting(self) -> int:
        with self._lock:
            return sum(map(len, self._waiting.values()))

    def _hand_over(self) -> None:
        """To the first waiter of the tenant that has waited longest for a turn; that tenant then goes to the back
        of the line (if it has more waiters)."""
        with self._lock:
            if not self._waiting:
                self._busy = False
                return
            tenant, queue = next(iter(self._waiting.items()))
            turn = queue.popleft()
            del self._waiting[tenant]
            if queue:
                self._waiting[tenant] = queue  # to the back: the other tenants first
            turn.set()
