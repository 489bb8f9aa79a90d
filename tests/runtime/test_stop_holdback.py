"""Stop strings on the engine's stream (runtime/stopping.py through engine/text.py), on the default model: text
that may begin a stop string is held back until decided, so a stream with include_stop_str_in_output false never
shows any of the stop string and ends exactly where it began, and text that turned out not to begin one is
released (at the latest with the last chunk).

Each stop string is taken from an unconstrained greedy run (ignore_eos, so it runs to max_tokens) at token
boundaries chosen for the case. Every check is made against the run's own tokens (the engine's detokenizer
replayed over them, without stop strings), never against another run's text, so it holds where batching or bf16
makes two greedy runs differ; whether the case was reached (the run went where the first one did) is checked only
when the run's text starts like the first one's.
"""

from __future__ import annotations

import pytest

from appliance.outputs import Chunk
from appliance.params import SamplingParams
from appliance.runtime.detokenizer import IncrementalDetokenizer
from appliance.runtime.engine import Engine

NEW = 40
PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
NEVER = "\u2603"  # a snowman: not in the run's text (checked), so a stop string ending with it never completes


@pytest.fixture(scope="module")
def engine(model_dir):
    e = Engine(model_dir)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    return engine.tokenizer.encode(PROMPT)


def run(engine, ids: list[int], stop: list[str], include: bool = False) -> list[Chunk]:
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW, ignore_eos=True, stop=stop, include_stop_str_in_output=include
    )
    return list(engine.submit(ids, params))


def raw_pieces(engine, ids: list[int], chunks: list[Chunk]) -> list[str]:
    """The text each chunk's token adds with no stop strings: the engine's detokenizer replayed over the run's own
    tokens (the last piece flushed when the run ended on length, as the engine flushes it)."""
    detok = IncrementalDetokenizer(engine.tokenizer, skip_special_tokens=True, prompt_ids=ids)
    pieces = [detok.add(c.token_ids) for c in chunks]
    if chunks[-1].finish_reason == "length":
        pieces[-1] += detok.flush()
    return pieces


def held(text: str, stops: list[str]) -> int:
    """Length of the longest end of text that begins some stop string (and is not all of it)."""
    return max((k for k in range(1, len(text) + 1) for s in stops if len(s) > k and s.startswith(text[-k:])), default=0)


def check_holdback(engine, ids: list[int], chunks: list[Chunk], stops: list[str]) -> tuple[str, str]:
    """The run against its own tokens: after every chunk the text streamed so far is all the text so far but what
    may still begin a stop string; the run ends at the first stop string, its text ending where that began (and
    none of it streamed), else on length with everything released. Returns (raw text, streamed text)."""
    raw = raw_pieces(engine, ids, chunks)
    total, streamed = "", ""
    for i, (chunk, piece) in enumerate(zip(chunks, raw, strict=True)):
        total += piece
        streamed += chunk.text
        found = [(total.find(s), s) for s in stops if s in total]
        if found:  # a stop string completed with this token: the run ends here, cut where it began
            start = min(found)[0]
            assert (streamed, chunk.finish_reason, i) == (total[:start], "stop", len(chunks) - 1)
            return total, streamed
        if chunk.finish_reason is None:
            assert streamed == total[: len(total) - held(total, stops)], (i, streamed, total)
    assert chunks[-1].finish_reason == "length" and streamed == total  # released at the end
    return total, streamed


@pytest.fixture(scope="module")
def reference(engine, prompt) -> tuple[str, list[str]]:
    """The free run's text and the text of each of its tokens (chosen boundaries: ASCII pieces of 2+ characters)."""
    chunks = run(engine, prompt, [])
    pieces = [c.text for c in chunks]
    text = "".join(pieces)
    assert NEVER not in text and len(chunks) == NEW
    return text, pieces


def boundary(pieces: list[str], text: str, first: int, make) -> tuple[int, str]:
    """The first token k >= first whose pieces k..k+2 are ASCII, 2+ characters long and whose stop string
    make(pieces, k) first occurs at its intended place; returns (where the stop string starts in text, it)."""
    for k in range(first, len(pieces) - 3):
        if all(len(p) >= 2 and p.isascii() for p in pieces[k : k + 3]):
            at = len("".join(pieces[:k])) + len(pieces[k]) - 2
            stop = make(pieces, k)
            if text.find(stop) in (at, -1):  # -1: it ends with NEVER
                return at, stop
    pytest.fail("no token boundary fits the case in the reference run")


def test_a_stop_string_spanning_three_tokens_is_never_streamed(engine, prompt, reference):
    """The stop string ends one token, covers the next whole and begins the third: the first two chunks hold their
    part back, the third ends the run where it began; the same stop string, included, is streamed whole."""
    text, pieces = reference
    at, stop = boundary(pieces, text, 5, lambda p, k: p[k][-2:] + p[k + 1] + p[k + 2][:2])
    for include in (False, True):
        chunks = run(engine, prompt, [stop], include)
        if include:
            streamed = "".join(c.text for c in chunks)
            if text.startswith(streamed):  # the run went as the first did
                assert streamed == text[: at + len(stop)] and chunks[-1].finish_reason == "stop"
            continue
        total, streamed = check_holdback(engine, prompt, chunks, [stop])
        assert stop not in streamed
        if total.startswith(text[: at + len(stop)]):  # the run went as the first did: the case was reached
            assert streamed == text[:at] and chunks[-1].finish_reason == "stop"
            assert [c.text for c in chunks[-2:]] == ["", ""]  # the token inside it and the one completing it


def test_a_partial_match_that_is_no_stop_is_released(engine, prompt, reference):
    """A stop string whose start the text matches at a token boundary, then leaves: the matching text is held for
    a token, then streamed; nothing is lost, the run ends on length."""
    text, pieces = reference
    at, stop = boundary(pieces, text, 5, lambda p, k: p[k][-2:] + NEVER)
    chunks = run(engine, prompt, [stop])
    total, streamed = check_holdback(engine, prompt, chunks, [stop])
    assert streamed == total and chunks[-1].finish_reason == "length"
    if total == text:  # the run went as the first did: the token before the boundary held its last 2 characters
        k = next(i for i in range(len(pieces)) if len("".join(pieces[: i + 1])) == at + 2)
        assert "".join(c.text for c in chunks[: k + 1]) == text[:at]
        assert "".join(c.text for c in chunks[: k + 2]).startswith(text[: at + 2])


def test_text_held_at_the_end_is_flushed_with_the_last_chunk(engine, prompt, reference):
    """The run's last characters begin a stop string when max_tokens ends it: the last chunk releases them."""
    text, pieces = reference
    stop = text[-2:] + NEVER
    chunks = run(engine, prompt, [stop])
    total, streamed = check_holdback(engine, prompt, chunks, [stop])
    assert streamed == total and chunks[-1].finish_reason == "length"
    if total == text:  # the run went as the first did: its last 2 characters were held until the end
        assert (
            chunks[-1].text.endswith(text[-2:])
            and "".join(c.text for c in chunks[:-1]) == text[: -len(chunks[-1].text)]
        )
