"""runtime.detokenizer: streamed pieces concatenate to the full decode, never split a character, stay O(window)."""

from __future__ import annotations

import numpy as np
import pytest

from appliance.runtime.detokenizer import IncrementalDetokenizer
from appliance.runtime.tokenizer import Tokenizer, gpt2_unicode_to_byte
from tests.runtime import test_tokenizer as tt  # the tokenizer builders


class CountingTokenizer:
    """Wraps a Tokenizer and records the length of every decode() call."""

    def __init__(self, tok: Tokenizer):
        self.tok, self.special_ids, self.lengths = tok, tok.special_ids, []

    def decode(self, ids, skip_special_tokens=True):
        ids = list(ids)
        self.lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module", params=tt.KINDS)
def tok(request, tmp_path_factory) -> Tokenizer:
    return tt.load_kind(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def bl(tmp_path_factory) -> Tokenizer:
    return tt.load_kind("bytelevel", tmp_path_factory)


@pytest.fixture(scope="module")
def spl(tmp_path_factory) -> Tokenizer:
    return tt.load_kind("sp_llama", tmp_path_factory)


def stream(tok, ids, chunk=1, **kw) -> list[str]:
    det = IncrementalDetokenizer(tok, **kw)
    pieces = [det.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return pieces + [det.flush()]


@pytest.mark.parametrize("text", tt.SAMPLES + ["Hello world foo bar", "日本語のテキスト👩‍👩‍👧"])
def test_text_streams_exactly(tok, text):
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)  # never half a character


def test_multibyte_held_until_complete(bl):
    b2t = {b: c for c, b in gpt2_unicode_to_byte().items()}

    def byte_ids(bs: bytes) -> list[int]:  # one token per byte: the worst case
        return [bl.token_to_id(b2t[b]) for b in bs]

    for text in ["你", "é", "👍🏽", "👩‍👩‍👧", "aé你👍🏽z"]:
        ids = byte_ids(text.encode())
        pieces = stream(bl, ids)
        assert "".join(pieces) == text
        emitted = "".join(pieces[:-1])
        assert emitted == text  # everything complete came out before flush
        assert all(p == "" or "\ufffd" not in p for p in pieces)
    det = IncrementalDetokenizer(bl)
    assert det.add(byte_ids("你".encode()[:2])) == ""
    assert det.flush() == bl.decode(byte_ids("你".encode()[:2]))  # the remainder, as the full decode has it


def test_byte_fallback_tokens(spl):
    ids = spl.encode("x ĳ 𝔘 y")
    assert sum(spl.id_to_token(i).startswith("<0x") for i in ids) >= 6
    pieces = stream(spl, ids)
    assert "".join(pieces) == "x ĳ 𝔘 y"
    # a byte run comes out whole, with the token that ends it (ĳ and 𝔘 are each a run of <0xNN> tokens)
    assert [p for p in pieces if p] == ["x", " ", "ĳ ", "𝔘 ", "y"]


def test_sentencepiece_leading_spaces(spl):
    ids = spl.encode("Hello world, hello again")
    pieces = [p for p in stream(spl, ids) if p]
    assert "".join(pieces) == "Hello world, hello again"
    assert pieces[0].startswith("H") and any(p.startswith(" ") for p in pieces[1:])


@pytest.mark.parametrize("kind", ["bytelevel", "sp_llama"])
def test_prompt_context(kind, tmp_path_factory):
    t = tt.load_kind(kind, tmp_path_factory)
    prompt, gen = t.encode("The answer is"), t.encode(" Hello world")
    if kind == "sp_llama":
        gen = t.encode("Hello world")  # `▁Hello ▁world`: what a model continues the prompt with
    out = "".join(stream(t, gen, prompt_ids=prompt))
    # with a prompt, pieces are what the generated tokens add to the prompt's text
    assert out == t.decode(prompt + gen)[len(t.decode(prompt)) :]
    assert out == " Hello world"
    assert "".join(stream(t, gen)) == t.decode(gen)  # without: exactly decode(generated)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("chunk", [1, 3])
def test_random_ids_property(tok, skip, chunk):
    """Arbitrary id sequences (invalid UTF-8, lone bytes, specials anywhere): the guarantee still holds."""
    rng = np.random.default_rng(1234)
    specials = sorted(tok.special_ids)
    for _ in range(60):
        ids = rng.integers(0, tok.vocab_size, rng.integers(1, 40)).tolist()
        if rng.random() < 0.5:  # bias towards multi-byte material: encoded texts spliced with random ids
            ids = tok.encode(str(rng.choice(tt.SAMPLES))) + ids + [int(rng.choice(specials))]
        pieces = stream(tok, ids, chunk=chunk, skip_special_tokens=skip)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(bl, skip):
    ids = bl.encode("Hi") + [bl.token_to_id("<|im_end|>")] + bl.encode(" there") + [0]
    out = "".join(stream(bl, ids, skip_special_tokens=skip))
    assert out == ("Hi there" if skip else "Hi<|im_end|> there<|endoftext|>")
    assert out == bl.decode(ids, skip_special_tokens=skip)


def test_window_stays_small(tok):
    counting = CountingTokenizer(tok)
    ids = tok.encode(" ".join(tt.SAMPLES) * 3)
    det = IncrementalDetokenizer(counting, prompt_ids=tok.encode("some prompt text here"))
    text = "".join(det.add(i) for i in ids) + det.flush()
    assert text  # O(1)-ish: each decode sees a few tokens, never the growing sequence
    assert max(counting.lengths) <= 8, max(counting.lengths)
    assert len(counting.lengths) <= 2 * len(ids) + 2
    assert len(det.ids) <= 8


def test_accepts_numpy_ids(bl):
    ids = np.array(bl.encode("héllo 你好"), dtype=np.int64)
    det = IncrementalDetokenizer(bl, prompt_ids=np.array(bl.encode("prompt"), dtype=np.int64))
    assert "".join(det.add(i) for i in ids) + det.add(ids[:0]) + det.flush() == "héllo 你好"


def test_add_after_flush_raises(bl):
    det = IncrementalDetokenizer(bl)
    det.add(bl.encode("a"))
    det.flush()
    with pytest.raises(RuntimeError):
        det.add(1)
