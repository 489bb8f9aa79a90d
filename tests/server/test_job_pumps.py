"""A job's output pumps (appliance/server/job_pumps.py): a pump thread that cannot start (the unit's TasksMax=1024
reached, or memory) fails that request with a 503, and none of its sequences is left running without a reader:
those already pumping are drained to their abort, the rest are cancelled, and their KV is free again.

`threading.Thread.start` is made to fail for the job's later pumps: first with stand-in handles (what exactly is
cancelled and joined), then on a real engine with a tiny model (nothing left running, no KV block held). Likewise
a worker that is gone before its job's Accepted could be sent: the submitted sequences are cancelled.
"""

from __future__ import annotations

import queue
import threading
import time
from multiprocessing import Pipe

import pytest

from appliance import protocol as p
from appliance.config import EngineConfig
from appliance.limits import Limits
from appliance.outputs import Chunk, Timing
from appliance.params import SamplingParams
from appliance.runtime.engine import Engine
from appliance.server.job_pumps import JobPumps
from appliance.server.jobs import JobRunner
from appliance.server.metrics import ServerMetrics
from appliance.server.slots import Models
from appliance.settings import ModelSpec


@pytest.fixture
def pumps_fail_after(monkeypatch):
    """Let the first `n` engine-pump threads of a job start; the next ones raise as CPython does without a thread."""
    started: list[threading.Thread] = []

    def arm(n: int) -> list[threading.Thread]:
        real = threading.Thread.start

        def start(self: threading.Thread) -> None:
            if self.name == "engine-pump":
                if len(started) >= n:
                    raise RuntimeError("can't start new thread")
                started.append(self)
            real(self)

        monkeypatch.setattr(threading.Thread, "start", start)
        return started

    return arm


class StandIn:
    """A sequence's handle: chunks as the test puts them; cancel() ends it with an abort, as the engine does."""

    def __init__(self) -> None:
        self.out: queue.Queue[Chunk] = queue.Queue()
        self.cancelled = False
        self.timing = Timing()

    def events(self):
        while True:
            chunk = self.out.get()
            yield 0, chunk
            if chunk.finish_reason:
                return

    def cancel(self) -> None:
        self.cancelled = True
        self.out.put(Chunk(finish_reason="abort"))


def test_a_pump_that_cannot_start_fails_the_job_and_cancels_every_sequence(pumps_fail_after):
    started = pumps_fail_after(2)
    handles = [StandIn() for _ in range(5)]
    handles[0].out.put(Chunk(text="a", token_ids=[1], completion_tokens=1))
    worker, engine_side = Pipe()
    pumps = JobPumps(engine_side, [(i, h, time.monotonic()) for i, h in enumerate(handles)], ServerMetrics())
    assert pumps.run() is True
    assert all(h.cancelled for h in handles)
    assert len(started) == 2 and not any(t.is_alive() for t in started)  # drained to their abort, joined
    events = []
    while worker.poll(0.5):
        events.append(worker.recv())
    failed = [e for e in events if isinstance(e, p.Failed)]
    assert len(failed) == 1 and (failed[0].status, failed[0].code) == (503, "engine_overloaded")
    assert isinstance(events[-1], p.End)
    assert not any(isinstance(e, p.ChoiceChunk) and e.chunk.finish_reason == "abort" for e in events)


@pytest.fixture
def served(exported):
    """A tiny model's engine, served as model "m"."""
    out, _ = exported("gpt2", "openvino", "fp32")
    engine = Engine(out, EngineConfig(precision="f32", max_num_batched_tokens=64))
    models = Models([ModelSpec("m", str(out))], graceful_timeout=1)
    models.attach(engine, "CPU", "m")
    try:
        yield engine, models
    finally:
        models.stop()
        engine.shutdown()


def _settled(engine: Engine) -> dict:
    deadline = time.monotonic() + 30
    while engine.stats()["running"] + engine.stats()["queued"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return engine.stats()


def test_a_worker_gone_before_the_job_is_accepted_leaves_nothing_running(served):
    """The worker closed its end while the job was submitted: sending Accepted fails, and the sequences are
    cancelled rather than generated to max_tokens for nobody."""
    engine, models = served
    job = p.Job("r", [p.PromptSpec(text="Hello, how are")], SamplingParams(max_tokens=240, ignore_eos=True), n=4)
    worker, engine_side = Pipe()
    worker.close()
    with pytest.raises(OSError):
        JobRunner(models, ServerMetrics(), Limits()).run(engine_side, job)
    stats = _settled(engine)
    assert (stats["running"], stats["queued"], stats["kv_blocks_used"]) == (0, 0, 0), stats
    assert stats["aborted"] == 4 and stats["generated_tokens"] < 4 * 240, stats


def test_on_a_real_engine_nothing_runs_on_and_the_kv_is_freed(served, pumps_fail_after):
    engine, models = served
    idle = engine.stats()
    started = pumps_fail_after(2)
    job = p.Job("r", [p.PromptSpec(text="Hello, how are")], SamplingParams(max_tokens=240, ignore_eos=True), n=6)
    worker, engine_side = Pipe()
    try:
        answered = JobRunner(models, ServerMetrics(), Limits()).run(engine_side, job)
    except RuntimeError as exc:  # the failure this test is about: see what it leaves behind first
        answered = exc
    events = []
    while worker.poll(0.5):
        events.append(worker.recv())
    assert len(started) == 2
    stats = _settled(engine)
    assert (stats["running"], stats["queued"], stats["kv_blocks_used"]) == (0, 0, idle["kv_blocks_used"]), stats
    # cancelled, not generated to max_tokens with nobody reading
    assert stats["aborted"] == 6 and stats["generated_tokens"] < 6 * 240, stats
    assert answered is True
    assert isinstance(events[0], p.Accepted) and isinstance(events[-1], p.End)
    assert [(e.status, e.code) for e in events if isinstance(e, p.Failed)] == [(503, "engine_overloaded")]
    # the engine serves the next request
    assert len(engine.submit([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)).results()[0].token_ids) == 3


def test_a_first_token_is_offered_to_the_taker_once_and_only_a_first_token():
    """RequestHandle.divert_first: the engine's next chunk, when it is a first token that does not end the request,
    goes to the taker (True: taken, not queued); anything else, a refusal, or a taker that raises, is queued."""
    from types import SimpleNamespace

    from appliance.runtime.engine.handles import RequestHandle

    def handle():
        seq = SimpleNamespace(request_id="r", prompt_len=1, group=None, out=queue.SimpleQueue(), timing=Timing())
        return seq, RequestHandle(lambda target: None, seq)  # type: ignore[arg-type]

    first, second = Chunk(token_ids=[5], completion_tokens=1), Chunk(token_ids=[6], completion_tokens=2)
    taken: list[Chunk] = []
    seq, h = handle()
    h.divert_first(lambda c: taken.append(c) is None)
    seq.out.put(first)  # what Sequence.emit does on the engine thread
    assert taken == [first] and isinstance(seq.out, queue.SimpleQueue) and seq.out.empty()
    seq.out.put(second)  # the tap is gone: the pump reads the rest
    assert seq.out.get_nowait() is second and taken == [first]
    for chunk, answer in (
        (second, True),  # a first token made before the tap: the next is not first
        (Chunk(token_ids=[5], completion_tokens=1, finish_reason="length"), True),  # it ends the request
        (first, False),  # refused (the socket could not take it now)
        (first, None),  # raising
    ):
        seq, h = handle()
        h.divert_first(lambda c, a=answer: 1 / 0 if a is None else a)
        seq.out.put(chunk)
        assert seq.out.get_nowait() is chunk
