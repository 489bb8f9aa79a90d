"""EdgeWorker.notify (appliance/http/worker.py): the heartbeat to the arbiter at most once a second, not on every
pass of gthread's loop (a `utime` syscall each, 3-4 passes per request)."""

from __future__ import annotations

from appliance.http.worker import HEARTBEAT_SECONDS, EdgeWorker


def test_the_heartbeat_is_touched_at_most_once_a_second():
    class Tmp:
        beats = 0

        def notify(self) -> None:
            self.beats += 1

    worker = EdgeWorker.__new__(EdgeWorker)  # only what notify reads: no process, no sockets
    worker.tmp, worker.last_beat = Tmp(), float("-inf")
    for _ in range(100):  # a loop's passes within a second
        worker.notify()
    assert worker.tmp.beats == 1
    worker.last_beat -= HEARTBEAT_SECONDS  # a second later
    worker.notify()
    assert worker.tmp.beats == 2
