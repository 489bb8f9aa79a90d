"""appliance.runtime.stopping: stop strings over streamed pieces, and the per-token stop/length rule."""

from __future__ import annotations

import random
import time

import pytest

from appliance.params import SamplingParams
from appliance.runtime.stopping import StopStringMatcher, check_token_stop, stop_token_ids


def run(stops, pieces, include=False):
    m = StopStringMatcher(stops, include)
    out = []
    for p in pieces:
        emit, stopped = m.feed(p)
        out.append(emit)
        if stopped:
            return out, True, m
    out.append(m.flush())
    return out, False, m


def test_no_stops_passes_through():
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""


def test_holds_only_what_could_start_a_stop():
    m = StopStringMatcher(["STOP"])
    assert m.feed("hello S") == ("hello ", False)  # "S" might start STOP
    assert m.held == "S"
    assert m.feed("T") == ("", False)
    assert m.feed("O") == ("", False)
    assert m.feed("x") == ("STOx", False)  # not a stop after all: released at once, in full
    assert m.feed("no s here") == ("no s here", False)  # lowercase s is not a prefix
    assert m.feed("TS") == ("T", False)  # "TS": only the trailing "S" can start STOP
    assert m.flush() == "S"


def test_stop_split_across_many_pieces():
    out, stopped, m = run(["<|end|>"], ["Hi", " there", "<", "|", "e", "n", "d", "|", ">", " never"])
    assert stopped and m.stop_str == "<|end|>"
    assert out == ["Hi", " there", "", "", "", "", "", "", ""]
    assert "".join(out) == "Hi there"


def test_include_stop_string():
    out, stopped, _ = run(["<|end|>"], ["Hi", "<|e", "nd|>tail"], include=True)
    assert stopped and out == ["Hi", "", "<|end|>"]  # never anything after the stop


def test_stop_inside_one_piece_drops_the_rest():
    out, stopped, _ = run(["\n\n"], ["para one\n\npara two"])
    assert stopped and out == ["para one"]


def test_stop_at_very_start():
    assert run(["Q:"], ["Q:", "x"])[0] == [""]
    assert run(["Q:"], ["Q", ":"])[0] == ["", ""]
    assert run(["Q:"], ["Q:"], include=True)[0] == ["Q:"]


def test_feed_after_stop_is_inert():
    m = StopStringMatcher(["x"])
    assert m.feed("axb") == ("a", True)
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_flush_returns_held_text():
    out, stopped, _ = run(["STOP", "END"], ["the ", "EN"])
    assert not stopped and out == ["the ", "", "EN"]


def test_overlapping_stops_first_to_complete_wins():
    # "bc" completes (at 3) before "abcd" could (at 4): generation must halt there
    assert run(["abcd", "bc"], ["xabcd"])[0] == ["xa"]
    assert run(["abcd", "bc"], ["xab", "cd"])[0] == ["x", "a"]
    # same end: the earlier start (longer string) wins, cutting more
    out, _, m = run(["bc", "abc"], ["xabc"])
    assert out == ["x"] and m.stop_str == "abc"
    out, _, m = run(["bc", "abc"], ["xabc"], include=True)
    assert out == ["xabc"] and m.stop_str == "abc"
    # one stop a prefix of another: the shorter completes first
    out, _, m = run(["ab", "abc"], ["xabc"])
    assert out == ["x"] and m.stop_str == "ab"


def test_hold_uses_the_longest_matching_prefix_across_stops():
    m = StopStringMatcher(["abcX", "bcY"])
    assert m.feed("zabc") == ("z", False)  # "abc" could still become abcX
    assert m.feed("Y") == ("a", True)  # "bcY" completed; "a" precedes it


@pytest.mark.parametrize("include", [False, True])
def test_chunking_never_changes_the_result(include):
    rnd = random.Random(7)
    alphabet = "ab\n<|>"
    stops = ["<|a|>", "a\n", "bb", "\n\n<", "|"]
    for _ in range(300):
        text = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 30)))
        whole, stopped_whole, m = run(stops, [text], include)
        cuts = sorted(rnd.sample(range(len(text) + 1), k=min(len(text) + 1, rnd.randint(0, 8))))
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        split, stopped_split, m2 = run(stops, pieces, include)
        assert "".join(split) == "".join(whole) and stopped_split == stopped_whole and m.stop_str == m2.stop_str
        if not stopped_whole:
            assert "".join(whole) == text
        else:  # reference: earliest end, then earliest start
            hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
            end, start, s = min(hits)
            assert "".join(whole) == text[: end if include else start]


# -- check_token_stop ------------------------------------------------------------------------------------------

EOS = {2, 7}


def stops(token: int, num_generated: int, p: SamplingParams, context_full: bool) -> str | None:
    return check_token_stop(token, num_generated, p, stop_token_ids(p, EOS), context_full)


def test_eos_and_stop_token_ids():
    p = SamplingParams(stop_token_ids=[9])
    assert stops(2, 1, p, False) == "stop"
    assert stops(7, 1, p, False) == "stop"
    assert stops(9, 1, p, False) == "stop"
    assert stops(5, 1, p, False) is None


def test_ignore_eos_keeps_stop_token_ids():
    p = SamplingParams(ignore_eos=True, stop_token_ids=[9])
    assert stops(2, 1, p, False) is None
    assert stops(9, 1, p, False) == "stop"


def test_min_tokens():
    p = SamplingParams(min_tokens=3, stop_token_ids=[9])
    assert [stops(2, n, p, False) for n in (1, 2, 3, 4)] == [None, None, None, "stop"]
    assert stops(9, 3, p, False) is None


def test_length_limits():
    p = SamplingParams(max_tokens=3)
    assert stops(5, 2, p, False) is None
    assert stops(5, 3, p, False) == "length"
    assert stops(2, 3, p, False) == "stop"  # stop beats length
    assert stops(5, 1, SamplingParams(), True) == "length"
    assert stops(5, 10_000, SamplingParams(), False) is None  # max_tokens None: unbounded


def test_stop_token_set_is_built_once_and_membership_is_constant_time():
    p = SamplingParams(stop_token_ids=list(range(100_000, 200_000)))
    stops_set = stop_token_ids(p, EOS)
    assert isinstance(stops_set, frozenset) and {2, 7, 150_000} <= stops_set
    t = time.perf_counter()
    for _ in range(10_000):
        check_token_stop(5, 1, p, stops_set, False)
    assert time.perf_counter() - t < 0.5  # a list scan: 10,000 x 100,000 comparisons, minutes
