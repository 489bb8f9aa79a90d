"""The per-token path of the engine socket (protocol.send_event, protocol.EventReader, http/client.JobStream):
the same framing as multiprocessing's Connection both ways, whole messages out of partial reads and several out of
one, a closed peer as EOF, and a job's connection pooled at End only when nothing was buffered past it."""

from __future__ import annotations

import socket
import threading
from multiprocessing.connection import Connection

import pytest

from appliance import protocol as p
from appliance.http.client import EngineClient, JobStream
from appliance.outputs import Chunk, Timing


def _pair() -> tuple[Connection, Connection]:
    a, b = socket.socketpair()
    return Connection(a.detach()), Connection(b.detach())


def _event(i: int, text: str = " tok") -> p.ChoiceChunk:
    return p.ChoiceChunk(i, Chunk(text=text, token_ids=[i], completion_tokens=i), Timing(created=1.0))


def test_send_event_is_read_by_connection_recv_and_reader_reads_connection_send():
    engine, worker = _pair()
    with engine, worker:
        p.send_event(engine, _event(1))
        assert worker.recv() == _event(1)
        big = _event(2, "x" * 300_000)  # more than a socket buffer: written in several writes
        sender = threading.Thread(target=p.send_event, args=(engine, big))
        sender.start()
        assert worker.recv() == big
        sender.join()
        reader = p.EventReader(worker)
        engine.send(_event(3))
        assert reader.poll(1.0) and reader.recv() == _event(3)
        sender = threading.Thread(target=engine.send, args=(big,))
        sender.start()
        assert reader.recv() == big
        sender.join()
        assert not reader.buffer


def test_a_traced_job_connection_sends_as_an_untraced_one_and_notes_each_event(monkeypatch):
    """The job runner sends through protocol.EventConnection, or the tracing's subclass of it: both in one write
    (send_event), never through Connection.send's per-message pickler, and the traced one notes every event."""
    from types import SimpleNamespace

    from appliance.server.tracing import TracedConnection

    def slow_send(self, obj):
        raise AssertionError("Connection.send: a ForkingPickler and a BytesIO per message")

    noted: list = []
    events = [p.Accepted([3]), _event(1), p.End()]
    engine, worker = _pair()
    with engine, worker:
        monkeypatch.setattr(Connection, "send", slow_send)
        for conn in (p.EventConnection(engine), TracedConnection(engine, SimpleNamespace(sent=noted.append))):
            for event in events:
                conn.send(event)
            assert [worker.recv() for _ in events] == events
            assert conn.fileno() == engine.fileno() and not conn.poll(0)  # the rest is the Connection's
        assert noted == events


def test_reader_splits_coalesced_events_and_waits_for_partial_ones():
    engine, worker = _pair()
    with engine, worker:
        reader = p.EventReader(worker)
        assert not reader.poll(0.01)  # nothing sent: the timeout passes
        for i in range(5):
            p.send_event(engine, _event(i))
        assert [reader.recv() for _ in range(5)] == [_event(i) for i in range(5)]
        frame = bytearray()
        a, b = _pair()
        with a, b:  # a frame's bytes as Connection writes them
            a.send(_event(9))
            frame += b._recv(4).getvalue()
            frame += b._recv(int.from_bytes(frame, "big")).getvalue()
        fd = engine.fileno()
        import os

        os.write(fd, bytes(frame[:7]))  # half a message: not readable as an event yet
        reader.poll(0.5)
        got: list = []
        t = threading.Thread(target=lambda: got.append(reader.recv()))
        t.start()
        t.join(0.2)
        assert t.is_alive() and not got  # waits for the rest
        os.write(fd, bytes(frame[7:]))
        t.join(5)
        assert got == [_event(9)]
        engine.close()
        with pytest.raises(EOFError):
            reader.recv()


class _Pool(EngineClient):
    def __init__(self):
        super().__init__("unused", b"")
        self.returned: list = []

    def _give_back(self, conn):
        self.returned.append(conn)


def test_job_stream_pools_its_connection_at_end_only_with_nothing_past_it():
    for extra in (False, True):
        engine, worker = _pair()
        pool = _Pool()
        stream = JobStream(pool, worker)
        p.send_event(engine, p.Accepted([3], None, 1))
        p.send_event(engine, _event(1))
        p.send_event(engine, p.End())
        if extra:
            p.send_event(engine, _event(2))  # a protocol slip: the connection must not serve another request
        events = [stream.next(5.0) for _ in range(3)]
        assert isinstance(events[0], p.Accepted) and events[1] == _event(1) and isinstance(events[2], p.End)
        assert stream.ended
        if extra:
            assert pool.returned == [] and worker.closed
        else:
            assert pool.returned == [worker] and not worker.closed
        engine.close()
        worker.close()


def test_job_stream_times_out_then_reports_a_lost_engine():
    engine, worker = _pair()
    stream = JobStream(_Pool(), worker)
    assert stream.next(0.05) is None
    engine.close()
    from appliance.http.client import EngineUnavailable

    with pytest.raises(EngineUnavailable):
        stream.next(1.0)


def _switches(tid: int) -> int:
    status = open(f"/proc/self/task/{tid}/status").read()
    return int(status.split("voluntary_ctxt_switches:")[1].split()[0])


def test_deferred_records_flusher_sleeps_while_nothing_waits(monkeypatch):
    """The flusher of probe / 401 records wakes only when one waits: a periodic timer would wake beside the
    engine's threads on a busy core all the time. Later records still go out."""
    import time

    from appliance.http import client as c

    monkeypatch.setattr(c, "DEFER_SECONDS", 0.02)
    engine = c.EngineClient("/nonexistent", b"k")
    calls: list = []
    monkeypatch.setattr(engine, "call", lambda op, *args, **kw: calls.append(args))
    engine.record_http(p.HttpRecord("/v2/health/live", "GET", 200, 0.001))
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(calls) == 1
    time.sleep(0.1)  # it went back to sleep after the flush
    flusher = engine._flusher
    assert flusher is not None and flusher.native_id is not None
    before = _switches(flusher.native_id)
    time.sleep(0.5)  # 25 periods of DEFER_SECONDS
    assert _switches(flusher.native_id) - before <= 1
    engine.record_http(p.HttpRecord("/v2/health/ready", "GET", 200, 0.001))
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(calls) == 2 and calls[1][0].route == "/v2/health/ready"


def test_drop_reporter_is_woken_by_a_drop_only():
    """The worker's drop reporter waits on Drops.waiting: set by a counted drop, cleared when the counts are taken."""
    from appliance.http.edge_policy import Drops

    drops = Drops()
    assert not drops.waiting.is_set()
    drops.note("head_too_large", "127.0.0.1")
    assert drops.waiting.is_set()
    assert drops.take() == {"head_too_large": 1}
    assert not drops.waiting.is_set() and drops.take() == {}


@pytest.mark.parametrize("slow", ["counting", "handshake", "reading"])
def test_a_posted_http_record_is_counted_by_a_metrics_call_from_any_connection(tmp_path, monkeypatch, slow):
    """record_http does not wait for the engine's reply (a streamed response's first byte must not): a METRICS
    call made after it still counts it, from the same client (the same pooled connection, answered in order, its
    reply read before the next call's) or from another one (the engine settles the records sent before METRICS).
    Slowed down as a loaded box would: the record's counting, the connection's thread after its handshake (the
    record then waits on a connection its thread does not listen to yet), or that thread between reading a message's
    bytes and looking at it (the socket is no longer readable, the record not yet counted: what a full CI run on a
    2-vCPU VM once hit)."""
    import os
    import threading
    import time
    from multiprocessing.connection import Connection

    handshake = p.handshake

    def slow_handshake(conn, authkey, server=False):
        handshake(conn, authkey, server=server)
        if server and slow == "handshake":
            time.sleep(0.05)

    monkeypatch.setattr(p, "handshake", slow_handshake)
    recv = Connection.recv

    def slow_recv(conn):
        message = recv(conn)
        if slow == "reading" and threading.current_thread().name == "engine-conn":
            time.sleep(0.05)
        return message

    monkeypatch.setattr(Connection, "recv", slow_recv)

    from appliance.server.engine_service import EngineService
    from appliance.server.metrics import ServerMetrics
    from appliance.settings import AUTHKEY_FILE, ServeSettings
    from appliance.testing.loopback import parse_metrics

    (tmp_path / AUTHKEY_FILE).write_bytes(os.urandom(32))
    settings = ServeSettings(model_dir="m", served_model_name="m", model_created=0, runtime_dir=str(tmp_path))
    service = EngineService(settings, ServerMetrics())
    counted = service.metrics.record_http

    def slow_count(*args):
        time.sleep(0.05 if slow == "counting" else 0)
        counted(*args)

    monkeypatch.setattr(service.metrics, "record_http", slow_count)
    service.start()
    key = 'appliance_http_requests_total{method="POST",route="/v3/completions",status="200"}'
    try:
        one = EngineClient(settings.socket_path, settings.authkey())
        other = EngineClient(settings.socket_path, settings.authkey())
        other.metrics()  # its connection open before the record is sent
        record = p.HttpRecord("/v3/completions", "POST", 200, 0.1)
        one.record_http(record)
        assert parse_metrics(other.metrics()).get(key) == 1
        one.record_http(record)
        assert parse_metrics(one.metrics()).get(key) == 2  # a str: the record's own reply was read before
        assert not one._unread
    finally:
        service.stop()
