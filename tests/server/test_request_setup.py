"""Per-request work in the engine process, module by module: the tokenizer's character bound is sound (it never
refuses a text that could fit) and encoding lets other threads run; a request's texts are tokenized once
(Engine.prepare); the engine thread's inbox drain keeps to its time budget. The same bounds on a real server
with hostile clients: tests/server/test_engine_isolation.py."""

from __future__ import annotations

import json
import queue
import random
import threading
import time
from collections import deque
from dataclasses import replace
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from appliance.params import SamplingParams
from appliance.runtime.engine.admission import INBOX_BUDGET_SECONDS, Admission, ParamInvalid
from appliance.runtime.tokenizer import TextTooLong, max_token_chars
from tests.runtime.test_tokenizer import KINDS, SAMPLES, load_kind

HOSTILE = [
    "1234567890" * 300,
    " " * 3000,
    "\n\t " * 700,
    "a" * 3000,
    "ab" * 1500,
    "你好世界" * 500,
    "👍🏽" * 700,
    "=" * 2000 + "-" * 1000,
    "<|im_end|>" * 200,
    "<s></s><unk>" * 200,
    "".join(chr(c) for c in range(0x20, 0x3000, 3)),
]


@pytest.fixture(scope="module", params=KINDS)
def tok(request, tmp_path_factory):
    return load_kind(request.param, tmp_path_factory)


def test_the_character_bound_never_refuses_a_text_that_fits(tok):
    """Every text becomes at least len(text) / max_token_chars tokens, so refusing len(text) > T x max_token_chars
    never refuses a text of T tokens or fewer."""
    per = tok.max_token_chars
    if per is None:  # a pipeline that may drop characters (here NFKC): no refusal by length at all
        tok.check_length("x" * 10**6, 1)
        return
    rng = random.Random(0)
    alphabet = "".join(SAMPLES) + "".join(HOSTILE[-1])
    texts = (
        SAMPLES + HOSTILE + ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 400))) for _ in range(200)]
    )
    # small alphabets: the per-text bound (only pieces spelled with the text's characters) is what decides there
    for alphabet_small in ("ab ", "0123456789", "01 ", "=-\n", "你好 ", "👍🏽", "<|im_end|> ", "\t\n "):
        for _ in range(20):
            texts.append("".join(rng.choice(alphabet_small) for _ in range(rng.randrange(50, 3000))))
    for text in texts:
        ids = tok.encode(text, add_special_tokens=True)
        assert len(ids) * per >= len(text), (text[:40], len(ids), per)
        tok.check_length(text, len(ids))  # exactly its own token count is never refused
        tok.encode(text, token_budget=len(ids))
    with pytest.raises(TextTooLong):
        tok.check_length("x" * (10 * per + 1), 10)


def _state(tok: HFTokenizer) -> dict:
    return json.loads(tok.to_str())


def test_no_bound_where_characters_can_vanish():
    """A bound only where no step can drop or merge characters: otherwise None (and nothing is refused early)."""
    bpe = HFTokenizer(models.BPE(vocab={"a": 0, "<unk>": 1}, merges=[], unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert max_token_chars(_state(bpe)) == 5  # "<unk>"
    fused = HFTokenizer(models.BPE(vocab={"a": 0, "<unk>": 1}, merges=[], unk_token="<unk>", fuse_unk=True))
    assert max_token_chars(_state(fused)) is None  # a run of unknown characters is one token
    nfkc = HFTokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    nfkc.normalizer = normalizers.NFKC()
    assert max_token_chars(_state(nfkc)) is None  # composition shortens text
    spaces = HFTokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    spaces.pre_tokenizer = pre_tokenizers.Whitespace()
    assert max_token_chars(_state(spaces)) is None  # whitespace is dropped
    wordpiece = HFTokenizer(models.WordPiece(vocab={"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    assert max_token_chars(_state(wordpiece)) is None  # a whole unknown word is one token
    stripping = _state(bpe)
    stripping["added_tokens"] = [{"id": 2, "content": "<m>", "lstrip": True, "rstrip": False}]
    assert max_token_chars(stripping) is None  # "<m>" eats the spaces before it


def test_encoding_lets_other_threads_run(tok):
    """A long encode releases the GIL (encode_batch): a thread ticking every 5 ms keeps ticking. (tokenizers'
    `encode` kept it: the ticker ran once in 3.6 s for a million digits.)"""
    text = "1234567890 hello world " * 40_000
    ticks = 0
    done = threading.Event()

    def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            time.sleep(0.005)
            ticks += 1

    thread = threading.Thread(target=ticker)
    thread.start()
    started = time.monotonic()
    tok.encode(text)
    elapsed = time.monotonic() - started
    done.set()
    thread.join()
    if elapsed > 0.2:  # long enough to see it
        assert ticks >= elapsed / 0.005 / 4, (ticks, elapsed)


class Counting:
    """A tokenizer that counts its encode calls."""

    def __init__(self, tok):
        self.tok, self.calls = tok, 0
        self.max_token_chars = tok.max_token_chars

    def encode_many(self, texts, add_special_tokens=False):
        self.calls += 1
        return self.tok.encode_many(texts, add_special_tokens)

    def encode(self, text, add_special_tokens=False, token_budget=None):
        self.calls += 1
        return self.tok.encode(text, add_special_tokens, token_budget)


def test_prepare_tokenizes_a_request_once_and_bounds_the_prediction(tmp_path_factory):
    tok = Counting(load_kind("bytelevel", tmp_path_factory))
    engine = SimpleNamespace(tokenizer=tok, max_context=64)
    params = SamplingParams(bad_words=["world", " Hello"], bad_word_tokens=[[5, 6]], prediction="Hello world")
    ready = Admission.prepare(engine, params)  # type: ignore[arg-type]
    assert ready.bad_words == [] and ready.prediction_ids == tok.tok.encode("Hello world")
    assert (5, 6) in ready.bad_word_tokens and tuple(tok.tok.encode(" world")) in ready.bad_word_tokens
    assert tok.calls == 2  # the bad words in one batch, the prediction once
    assert Admission.prepare(engine, ready) is ready and tok.calls == 2  # prepared params: nothing again
    with pytest.raises(ParamInvalid, match="prediction") as more:  # more tokens than the context
        Admission.prepare(engine, SamplingParams(prediction="Hello world " * 40))  # type: ignore[arg-type]
    calls = tok.calls
    with pytest.raises(ParamInvalid, match="prediction") as longer:  # cannot fit: refused before it is encoded
        Admission.prepare(engine, SamplingParams(prediction="x" * 10**6))  # type: ignore[arg-type]
    assert more.value.param == longer.value.param == "prediction"  # the 400's `param`
    assert tok.calls == calls + 1 or tok.tok.max_token_chars is None


def test_the_inbox_drain_keeps_to_its_time_budget(monkeypatch):
    """A submission of many prompts is started a slice per iteration while sequences run (a step between two
    slices), in order, cancels after what they cancel; with nothing running it is all started at once. The drain's
    clock is a fake one that each start moves on by a quarter of the budget: the slice's size is then exact, and a
    busy machine's descheduling cannot fail the test."""
    from appliance.runtime.engine import admission

    taken: list = []
    now = [0.0]
    step = INBOX_BUDGET_SECONDS / 4

    def take(op, target):
        now[0] += step
        taken.append((op, target))

    monkeypatch.setattr(admission, "time", SimpleNamespace(monotonic=lambda: now[0]))

    engine = SimpleNamespace(
        _inbox=queue.SimpleQueue(),
        _backlog=deque(),
        scheduler=SimpleNamespace(running=[object()]),
        _wake=threading.Event(),
        _take=take,
    )
    engine._inbox.put(("add", [[f"seq{i}"] for i in range(40)]))
    engine._inbox.put(("cancel", "seq0"))
    Admission._drain_inbox(engine)  # type: ignore[arg-type]
    # starts until the budget is spent (the one that begins on the deadline too), never past it by more than one
    assert 4 <= len(taken) <= 5 and now[0] <= INBOX_BUDGET_SECONDS + step, (len(taken), now[0])
    assert engine._backlog and engine._wake.is_set()
    while engine._backlog:
        Admission._drain_inbox(engine)  # type: ignore[arg-type]
    assert taken == [("add", [[f"seq{i}"]]) for i in range(40)] + [("cancel", "seq0")]
    engine.scheduler.running = []
    taken.clear()
    engine._inbox.put(("add", [[f"seq{i}"] for i in range(10)]))
    Admission._drain_inbox(engine)  # type: ignore[arg-type]
    assert len(taken) == 10 and not engine._backlog


def test_the_set_up_gate_admits_one_at_a_time_tenants_in_turn():
    """SetupGate: one holder at a time; waiters served round robin over tenants (first come first served within
    one), so one tenant's forty requests make another's wait for one of them, not forty."""
    from appliance.server.setup_gate import SetupGate

    gate = SetupGate()
    order: list[str] = []
    holding = []
    release = threading.Event()

    def job(tenant: str, name: str) -> None:
        with gate.hold(tenant):
            holding.append(name)
            assert len(holding) == 1  # never two at once
            order.append(name)
            if name == "first":
                release.wait(10)
            holding.remove(name)

    first = threading.Thread(target=job, args=("a", "first"))
    first.start()
    while not order:
        time.sleep(0.001)
    threads = []
    for tenant, name in [("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1"), ("c", "c1"), ("b", "b2")]:
        threads.append(threading.Thread(target=job, args=(tenant, name)))
        threads[-1].start()
        while gate.waiting() < len(threads):  # queued in this order
            time.sleep(0.001)
    release.set()
    for t in [first, *threads]:
        t.join(10)
    assert order == ["first", "a1", "b1", "c1", "a2", "b2", "a3"]
    assert gate.waiting() == 0
    with gate.hold("a"):  # free again: no wait
        pass


def test_a_prompts_ban_table_is_built_off_the_engine_thread_once_for_its_choices(tmp_path_factory):
    """Admission._prebuild (the caller's thread): the ban table of a prompt (its no_repeat_ngram index) built once
    for its n choices, each choice its own fork (its own output index, the prompt's index shared), so the engine
    thread's start only takes it."""
    from appliance.runtime.sequence import Sequence

    engine = SimpleNamespace(tokenizer=load_kind("bytelevel", tmp_path_factory))
    prompt = [5, 6, 7, 8, 5, 6]
    params = SamplingParams(no_repeat_ngram=2, seed=0)

    def sequence(p: SamplingParams) -> Sequence:
        return Sequence("r", len(prompt), list(prompt), p, 20, queue.SimpleQueue(), None)  # type: ignore[arg-type]

    seqs = [sequence(replace(params, seed=i)) for i in range(3)]
    Admission._prebuild(engine, seqs)  # type: ignore[arg-type]
    tables = [s.prebuilt.bans for s in seqs if s.prebuilt is not None]
    assert len(tables) == 3 and len({id(t) for t in tables}) == 3
    assert tables[1].prompt_index is tables[0].prompt_index and tables[0].prompt_index
    assert tables[1].output_index is not tables[0].output_index
    plain = sequence(SamplingParams())
    Admission._prebuild(engine, [plain])  # type: ignore[arg-type]
    assert plain.prebuilt is not None and plain.prebuilt.bans is None  # nothing banned
