"""The engine thread's life, and why no request can hurt another.

No request can hurt another: an exception in one request's part of a step fails that request alone (`_isolated`,
see Engine.step), a failed backend call fails that step's requests, and the engine goes on. The engine thread
itself never dies silently: if something escapes its loop, `Engine.dead` records it, every request ends with an
error and `Engine.on_death` is called (the server exits so that systemd / Docker restart it); `Engine.heartbeat`
and `Engine.alive` let readiness see a live loop. `inject_fault` drives these paths in tests.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import queue
import time
from collections.abc import Iterator

from appliance.outputs import Chunk
from appliance.runtime.engine.state import EngineState
from appliance.runtime.sequence import Sequence, Status

log = logging.getLogger("appliance.runtime.engine")

IDLE_WAIT = 0.5  # seconds the idle loop sleeps between checks: the heartbeat's longest idle gap
FAULT_KINDS = ("loop", "forward")


class EngineDead(RuntimeError):
    """The engine thread died (Engine.dead): nothing submitted can run (HTTP 503)."""


class InjectedFault(RuntimeError):
    """Raised by Engine.inject_fault's faults (tests of the failure paths)."""


class Liveness(EngineState):
    """Engine's loop, liveness and failure paths (a part of Engine: see state.py for the state it uses)."""

    @property
    def alive(self) -> bool:
        """The engine thread runs its loop (readiness also wants a fresh `heartbeat`: a wedged loop is alive)."""
        return self._thread.is_alive() and self.dead is None

    def inject_fault(self, kind: str) -> None:
        """Test hook for the failure paths (the server exposes it only with APPLIANCE_FAULT_INJECTION=1).
        "loop": the engine thread's loop raises on its next iteration, outside every guard: the real death path
        (dead set, requests aborted, on_death called). "forward": the next backend forward raises once: that
        step's requests fail, later ones run."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}: one of {', '.join(FAULT_KINDS)}")
        self._faults.add(kind)
        self._wake.set()

    def _injected(self, kind: str) -> None:
        if kind in self._faults:
            self._faults.discard(kind)
            raise InjectedFault(f"injected {kind} fault")

    def shutdown(self, reason: str = "server shutting down") -> None:
        """Stops the loop; what it still holds ends with `reason` (a model removed by a reload says so)."""
        self._stop_reason = reason
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        for proposer in self.proposers.values():
            proposer.close()
        if self.pool.disk is not None:
            self.pool.disk.close()  # the queued writes land first
        self.backend.close()

    # ---- engine thread ----
    def _loop(self) -> None:
        """The engine thread. Each iteration's failures are contained by _iterate; what still escapes (a bug in
        the loop itself) ends the thread through _die, never silently."""
        try:
            while not self._stop:
                self.heartbeat = time.monotonic()
                self._injected("loop")
                self._iterate()
            self._abort_all(self._stop_reason)
        except BaseException as exc:
            self._die(exc)

    def _iterate(self) -> None:
        """One loop iteration: take new requests and cancels, then one step (or wait for work). A failure outside
        every request's own part (the scheduler, say) leaves state that cannot be trusted: every request in the
        scheduler fails, and the engine starts over empty."""
        try:
            self._drain_inbox()
            if not self.scheduler.has_work():
                self._wake.wait(IDLE_WAIT)
                self._wake.clear()
                return
            self.step()
        except Exception as exc:
            log.exception("engine step failed: failing every scheduled request")
            self._abort_scheduled(f"internal error: {type(exc).__name__}")

    def _die(self, exc: BaseException) -> None:
        """The loop is gone: record why, end every request (best effort), tell the owner (on_death)."""
        with self._admit:
            self.dead = exc
        log.critical("the engine thread died", exc_info=exc)
        try:
            self._abort_all(f"the engine stopped: internal error: {type(exc).__name__}")
        except BaseException:
            log.exception("could not abort every request of the dead engine")
        if self.on_death is not None:
            try:
                self.on_death(exc)
            except BaseException:
                log.exception("Engine.on_death failed")

    def _abort_all(self, error: str) -> None:
        """End every request the engine holds (inbox, waiting, running) with an error; each on its own, best
        effort (one that cannot be ended does not keep the others waiting)."""
        while True:
            if self._backlog:  # taken from the inbox, not started yet (_drain_inbox's time budget)
                op, target = self._backlog.popleft()
            else:
                try:
                    op, target = self._inbox.get_nowait()
                except queue.Empty:
                    break
            if op == "add":
                with self._admit:
                    self._inbox_seqs -= sum(map(len, target))
                for seqs in target:
                    for seq in seqs:
                        self._try_fail(seq, error)
        self._abort_scheduled(error)

    def _abort_scheduled(self, error: str) -> None:
        for seq in self.scheduler.sequences():
            self._try_fail(seq, error)

    def _try_fail(self, seq: Sequence, error: str) -> None:
        """_fail, and if even that raises: drop seq from the scheduler and tell its requester all the same (its KV
        may stay held: a bug is in the log, the requester must not wait forever)."""
        try:
            self._fail(seq, error)
        except Exception:
            log.exception("could not end request %s", seq.request_id)
            self.scheduler.drop(seq)
            end = Chunk(finish_reason="abort", error=error, prompt_tokens=seq.prompt_len)
            if seq.group is None:
                seq.emit(end)
            elif not seq.group.done:
                seq.group.done = True
                seq.group.out.put([copy.copy(end) for _ in range(seq.params.n)])

    def _fail(self, seq: Sequence, error: str) -> None:
        """End seq's request with `error` (finish "abort"). The unit: a beam search as a whole (its beams share
        one result); otherwise this sequence, with the n > 1 choices still waiting to start from its prompt KV
        (their prompt is the one that failed; a fork of them that raised leaves them all here). Choices already
        forked are sequences of their own and go on: each choice fails alone. A finished sequence is left alone."""
        if seq.group is None and seq.status is Status.FINISHED:
            return
        for f in seq.followers or ():
            if f.status is not Status.FINISHED:
                self._finish(f, "abort", error=error)
        seq.followers = None
        self._finish(seq, "abort", error=error)

    @contextlib.contextmanager
    def _isolated(self, seq: Sequence) -> Iterator[None]:
        """Runs one request's part of a step: an exception fails that request alone (_fail, with the exception's
        type as the error; the traceback goes to the log) and the caller goes on with the rest of the batch."""
        try:
            yield
        except Exception as exc:
            log.exception("request %s failed in the engine step", seq.request_id)
            self.counters["failed"] += 1
            self._fail(seq, f"internal error: {type(exc).__name__}")
