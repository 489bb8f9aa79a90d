"""The encoder service alone (appliance/server/encoders/service.py and its parts) over a fake Encoder: batching
across requests by length under the padded-token budget, a request split over batches and put back in order, a
vanished client's inputs dropped, one request's failure kept to it, the bounds and `dimensions`, a long rerank
pair cut by the encoder's own truncation, and which thread (priority) runs a forward while chat runs and while it
does not. The real model and server: tests/openai_api/test_embeddings.py."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from appliance import protocol as p
from appliance.limits import Limits
from appliance.openai_api.embeddings import floats
from appliance.server.encoders.embeddings import EncodeFailed, EncoderService

DIM = 8


class FakeEncoder:
    """Ids = one per word (101 first, 102 last); a vector = [len, first word id, ...] normalized; a forward records
    its batch; the id 666 makes a forward fail."""

    task = "embed"
    max_length = 16
    dimensions = DIM

    def __init__(self, task: str = "embed", delay: float = 0.01):
        self.task = task
        self.manifest = SimpleNamespace(normalize=True, vocab_size=1000)
        self.batches: list[list[int]] = []  # lengths per forward
        self.delay = delay
        self.gate = threading.Event()
        self.gate.set()
        self.threads: list[tuple[str, int]] = []  # (thread name, its niceness) per forward
        self.policies: list[int] = []  # the thread's scheduling policy per forward

    def tokenize(self, texts):
        return [[101, *(int(w) for w in t.split()), 102] for t in texts]

    def tokenize_pairs(self, query, documents, *, truncate=False):
        q = [101, *(int(w) for w in query.split()), 102]
        out = []
        for d in documents:
            words = [int(w) for w in d.split()]
            if truncate:  # the document cut so the pair fits, as the real tokenizer's only_second
                words = words[: max(0, self.max_length - len(q) - 1)]
            ids = q + words + [102]
            out.append((ids, [0] * len(q) + [1] * (len(ids) - len(q))))
        self.pairs_truncated = truncate
        return out

    def truncate(self, ids):
        return ids[: self.max_length - 1] + ids[-1:]

    def _check(self, batch):
        tid = threading.get_native_id()
        self.threads.append((threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, tid)))
        self.policies.append(os.sched_getscheduler(tid))
        self.gate.wait()
        time.sleep(self.delay)
        self.batches.append([len(x[0] if isinstance(x, tuple) else x) for x in batch])
        if any(666 in (x[0] if isinstance(x, tuple) else x) for x in batch):
            raise RuntimeError("bad input")

    def embed(self, batch):
        self._check(batch)
        out = np.zeros((len(batch), DIM), np.float32)
        for i, ids in enumerate(batch):
            out[i, 0], out[i, 1], out[i, 2] = len(ids), ids[1], 1.0
        return out / np.linalg.norm(out, axis=1, keepdims=True)

    def score(self, batch):
        self._check(batch)
        return np.array([float(sum(ids[-2:-1])) for ids, _ in batch], np.float32)


def job(texts=None, **kw) -> p.EncodeJob:
    return p.EncodeJob("r", "m", kw.pop("task", "embed"), texts=texts, **kw)


def vectors(answer: p.Encoded) -> np.ndarray:
    assert answer.vectors is not None
    return np.array([floats(v) for v in answer.vectors])


@pytest.fixture
def service():
    svc = EncoderService(FakeEncoder(), batch_tokens=64, max_batch=8, nice=0)
    yield svc
    svc.shutdown()


def test_inputs_come_back_in_order_across_batches(service):
    texts = [" ".join(["7"] * (i % 9 + 1)) for i in range(40)]  # lengths 3..11, mixed
    got = vectors(service.encode(job(texts), Limits()))
    raw = np.array([[i % 9 + 3, 7, 1] for i in range(40)], np.float32)
    want = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    np.testing.assert_allclose(got[:, :3], want, rtol=1e-6)
    lengths = service.encoder.batches
    assert len(lengths) > 1  # split over several forwards
    assert all(max(b) * len(b) <= 64 and len(b) <= 8 for b in lengths)  # the padded budget held
    assert sum(map(len, lengths)) == 40


def test_batches_are_length_buckets_shared_by_requests(service):
    service.encoder.gate.clear()  # hold the first forward so both requests queue
    limits = Limits()
    results = {}

    def run(name, texts):
        results[name] = vectors(service.encode(job(texts), limits))

    a = threading.Thread(target=run, args=("a", ["1", "1 " * 12] * 4))  # short and long inputs interleaved
    b = threading.Thread(target=run, args=("b", ["2 " * 12, "2"] * 4))
    a.start()
    time.sleep(0.05)
    b.start()
    time.sleep(0.1)
    service.encoder.gate.set()
    a.join(5)
    b.join(5)
    assert results["a"][:, 1].tolist() and set(np.round(results["a"][:, 1] / results["a"][:, 2]).tolist()) == {1.0}
    assert set(np.round(results["b"][:, 1] / results["b"][:, 2]).tolist()) == {2.0}
    # after the first held forward, the short inputs of both requests share a forward, and so do the long ones
    spreads = [max(b) - min(b) for b in service.encoder.batches]
    assert max(spreads) == 0, service.encoder.batches


def test_requests_take_turns(service):
    """A small request that comes after a large one is answered before the large one ends (round robin)."""
    service.encoder.gate.clear()
    big = service.submit(service.prepare(job(["7"] * 40), Limits()))  # 5 forwards of 8
    time.sleep(0.05)  # the loop holds big's first forward
    small = service.submit(service.prepare(job([" ".join(["1"] * 10)]), Limits()))
    service.encoder.gate.set()
    assert small.done.wait(5)
    assert big.remaining > 0, service.encoder.batches
    assert big.done.wait(5)


def test_a_failing_request_fails_alone(service):
    service.encoder.gate.clear()
    outcome = {}

    def run(name, texts):
        try:
            outcome[name] = service.encode(job(texts), Limits())
        except EncodeFailed as exc:
            outcome[name] = exc.failed

    threads = [  # the first holds the loop (gate closed) so the other two queue and share the next forward
        threading.Thread(target=run, args=("first", ["9"])),
        threading.Thread(target=run, args=("bad", ["1 2", "666 3"])),
        threading.Thread(target=run, args=("good", ["4 5", "6 7"])),
    ]
    for t in threads:
        t.start()
        time.sleep(0.05)
    service.encoder.gate.set()
    for t in threads:
        t.join(5)
    assert isinstance(outcome["bad"], p.Failed) and outcome["bad"].status == 500
    assert isinstance(outcome["good"], p.Encoded) and len(outcome["good"].vectors or []) == 2
    assert [4, 4, 4, 4] in service.encoder.batches  # they did share a forward (which failed)
    assert service.alive


def test_a_cancelled_request_is_dropped(service):
    service.encoder.gate.clear()
    first = service.submit(service.prepare(job(["1"]), Limits()))
    time.sleep(0.05)  # the loop holds the first forward
    gone = service.submit(service.prepare(job(["2"] * 30), Limits()))
    service.cancel(gone)
    service.encoder.gate.set()
    assert first.done.wait(5)
    time.sleep(0.1)
    assert sum(map(len, service.encoder.batches)) == 1  # none of the 30 ran
    assert service.stats()["queued"] == 0


def test_bounds_and_truncate(service):
    long = " ".join(["5"] * 20)  # 22 tokens > 16
    with pytest.raises(EncodeFailed, match="more than the model's maximum of 16") as exc:
        service.encode(job([long]), Limits())
    assert exc.value.failed.status == 400 and exc.value.failed.param == "input"
    answer = service.encode(job([long], truncate=True), Limits())
    assert answer.tokens == [16]
    with pytest.raises(EncodeFailed, match="limit of 20 per request"):
        service.encode(job(["1 2 3"] * 5), Limits(embedding_tokens=20))
    with pytest.raises(EncodeFailed, match="out of the vocabulary"):
        service.encode(p.EncodeJob("r", "m", "embed", token_ids=[[101, 5000, 102]]), Limits())
    with pytest.raises(EncodeFailed, match="does not serve rerank"):
        service.encode(p.EncodeJob("r", "m", "rerank", query="1", documents=["2"]), Limits())


def test_dimensions_truncate_and_renormalize(service):
    full = vectors(service.encode(job(["3 4"]), Limits()))
    short = vectors(service.encode(job(["3 4"], dimensions=2), Limits()))
    assert short.shape == (1, 2)
    np.testing.assert_allclose(short[0], full[0, :2] / np.linalg.norm(full[0, :2]), rtol=1e-6)
    with pytest.raises(EncodeFailed, match="between 1 and 8"):
        service.encode(job(["3"], dimensions=9), Limits())
    service.normalized = False
    with pytest.raises(EncodeFailed, match="not normalized"):
        service.encode(job(["3"], dimensions=2), Limits())


def test_rerank_scores_in_document_order():
    svc = EncoderService(FakeEncoder("rerank"), batch_tokens=64, max_batch=2, nice=0)
    try:
        answer = svc.encode(p.EncodeJob("r", "m", "rerank", query="1", documents=["5", "9 9 3", "7"]), Limits())
        assert answer.scores == pytest.approx([1 / (1 + np.exp(-x)) for x in (5.0, 3.0, 7.0)])
        assert answer.tokens == [5, 7, 5]
    finally:
        svc.shutdown()


def test_rerank_pairs_are_cut_to_fit_by_the_encoders_truncation():
    """A query + document longer than the model's maximum is cut by `tokenize_pairs(truncate=True)` (the query
    kept, the document's end cut), not refused."""
    svc = EncoderService(FakeEncoder("rerank"), batch_tokens=64, max_batch=2, nice=0)
    try:
        answer = svc.encode(p.EncodeJob("r", "m", "rerank", query="1 2", documents=["5 " * 30, "7"]), Limits())
        assert answer.tokens == [16, 6] and svc.encoder.pairs_truncated
        assert max(svc.encoder.batches[0] + svc.encoder.batches[-1]) <= 16
    finally:
        svc.shutdown()


def test_forwards_yield_to_chat_only_while_it_runs():
    """While `contended` (chat running), forwards run on the niced thread; otherwise on the one at the process's
    priority, so an embedding with no chat beside it is not slowed."""
    chat = threading.Event()
    svc = EncoderService(FakeEncoder(), batch_tokens=64, max_batch=8, nice=7, sched="idle", contended=chat.is_set)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        svc.encode(job(["1 2"]), Limits())
        chat.set()
        svc.encode(job(["3 4"]), Limits())
        chat.clear()
        svc.encode(job(["5 6"]), Limits())
        assert svc.encoder.threads == [("encoder", base), ("encoder-bg", base + 7), ("encoder", base)]
        assert svc.encoder.policies == [os.SCHED_OTHER, os.SCHED_IDLE, os.SCHED_OTHER]
        assert svc.background_batches == 1
    finally:
        svc.shutdown()
    assert not svc.alive


def test_an_idle_encoder_runs_a_request_on_its_own_thread():
    """`submit(inline=True)` with nothing queued and no chat: the first batch runs on the caller's thread (no
    handoff), the rest of a large request on the encoder thread, every result in its place; with chat running it
    queues for the niced thread."""
    chat = threading.Event()
    svc = EncoderService(FakeEncoder(), batch_tokens=64, max_batch=8, nice=7, contended=chat.is_set)
    try:
        texts = [" ".join(["7"] * (i % 9 + 1)) for i in range(40)]
        req = svc.submit(svc.prepare(job(texts), Limits()), inline=True)
        req.done.wait(10)
        got = vectors(svc.answer(job(texts), req))
        raw = np.array([[i % 9 + 3, 7, 1] for i in range(40)], np.float32)
        np.testing.assert_allclose(got[:, :3], raw / np.linalg.norm(raw, axis=1, keepdims=True), rtol=1e-6)
        names = [name for name, _ in svc.encoder.threads]
        assert names[0] == threading.current_thread().name and set(names[1:]) == {"encoder"}
        assert svc.inline_batches == 1
        chat.set()
        svc.encode(job(["3 4"]), Limits())  # encode() queues; inline too while chat runs:
        req = svc.submit(svc.prepare(job(["5 6"]), Limits()), inline=True)
        assert req.done.wait(10) and svc.encoder.threads[-1][0] == "encoder-bg" and svc.inline_batches == 1
    finally:
        svc.shutdown()


def test_embedding_model_flag(tmp_path, monkeypatch):
    """--embedding-model: 'none' and 'default' beside another chat model serve nothing; a directory must hold an
    encoder export; 'default' beside `--model default` serves the built default export, or nothing (an info line)
    when it is not built."""
    import argparse
    import json

    from appliance.manifest import MANIFEST_NAME
    from appliance.options import ConfigError, embedding_spec

    def args(word: str, model: str = "default") -> argparse.Namespace:
        return argparse.Namespace(embedding_model=word, model=model, device="CPU")

    def export(path, task: str):
        path.mkdir(parents=True)
        fields = dict(
            name=f"m-{task}", backend="openvino", weight_format="int8", model_file="openvino_model.xml",
            architecture="BertModel", model_type="bert", num_layers=1, num_attention_heads=1, num_kv_heads=1,
            head_dim=8, hidden_size=8, vocab_size=10, max_context=16, kv_dtype="", stateful=False, task=task,
        )  # fmt: skip
        (path / MANIFEST_NAME).write_text(json.dumps(fields))
        return path

    monkeypatch.setenv("APPLIANCE_DATA_DIR", str(tmp_path / "data"))
    assert embedding_spec(args("none"), "chat") is None
    assert embedding_spec(args("default", model="/some/chat"), "chat") is None
    assert embedding_spec(args("default"), "chat") is None  # not built in this data dir
    built = export(tmp_path / "data" / "models" / "all-minilm-l6-v2" / "openvino-int8", "embed")
    spec = embedding_spec(args("default"), "chat")
    assert spec is not None and spec.name == "m-embed" and spec.model_dir == str(built)
    rerank = export(tmp_path / "rerank", "rerank")
    assert embedding_spec(args(str(rerank), model="/some/chat"), "chat").name == "m-rerank"
    with pytest.raises(ConfigError, match="not an embedding or rerank model"):
        embedding_spec(args(str(export(tmp_path / "llm", "generate"))), "chat")
    with pytest.raises(ConfigError, match="chat model's name"):
        embedding_spec(args(str(rerank)), "m-rerank")
    with pytest.raises(ConfigError, match="no appliance_manifest.json"):
        embedding_spec(args(str(tmp_path / "nothing")), "chat")
