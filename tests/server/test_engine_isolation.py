"""One request never stalls the engine process or grows it much, and API keys are apart in the prefix cache: on a
real server with two keys, hostile requests from key B run while key A's short completions and the liveness probe
are timed, and the engine process's RSS is sampled.

What the requests are (the 2026-11-26 review's probes and their neighbours under the new bounds):
- a /v3/tokenize of 1.5 MB of digits (cannot fit the context: refused before it is encoded) and one of 600,000
  random printable characters (fits the character bound, ~519,000 tokens: encoded, without holding the engine
  process's GIL), as one text, a list, and a completions prompt list;
- completions with `prompt: ["hi"] x 16`, 256 bad words of 256 CJK characters and a 65,536-emoji prediction, then
  the same without the prediction (both refused: the prediction has more tokens than the context, the bad words
  cost more set-up than the limits table allows), and one within the bounds that runs;
- `no_repeat_ngram` far past its cap (400 in the worker) and at its cap over a 2,000-token prompt with n = 8
  (runs: 496,000 units of set-up work);
- n x max_tokens x logprobs past the generated-logprobs limit (400).
Timing bounds hold on a loaded 2-core box: the victim's latency is compared with its own baseline, taken in the
same test, plus the issue's margins (a short completion under 1 s more than its baseline, the liveness probe
under 0.5 s) on a quiet box; on a busy one, where the baseline itself is slow, under LOAD_FACTOR times the
baseline instead, whichever is larger. The failures these catch cost seconds (one 1.5 MB tokenize held the engine
process 3.2 s, the bad-words request 8 s, a 600,000-character encoding under the GIL ~2 s), more than either.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from pathlib import Path

import pytest
import requests

from tests.helpers import Server, rss_mb

pytestmark = pytest.mark.slow

KEY_A, KEY_B = "key-a-0123456789", "key-b-9876543210"
A = {"Authorization": f"Bearer {KEY_A}"}
B = {"Authorization": f"Bearer {KEY_B}"}
VICTIM_MARGIN = 1.0  # seconds a short completion may take beyond its baseline while the attack runs
LIVE_BOUND = 0.5  # seconds the liveness probe may take while the attack runs
LOAD_FACTOR = 3  # on a box so busy that the baselines are slow: how many times them the attack may take
GROWTH_MB = 200  # what one request may add to the engine process
ROUNDS = 3  # timed refusals, interleaved with as many timed transfers: the fastest refusal is compared


def serve(model_dir: Path, tmp_path: Path, *args: str) -> Server:
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    return Server(
        model_dir,
        tmp_path / "serve.log",
        "--api-key-file",
        str(keys),
        "--workers",
        "1",
        "--threads",
        "8",
        "--num-threads",
        "1",
        *args,
    )


@pytest.fixture(scope="class")
def keyed(model_dir, tmp_path_factory):
    with serve(model_dir, tmp_path_factory.mktemp("keyed")) as srv:
        yield srv


def model_of(srv: Server) -> str:
    return requests.get(srv.base + "/v3/models", headers=A, timeout=30).json()["data"][0]["id"]


def victim(srv: Server, name: str) -> float:
    started = time.monotonic()
    r = requests.post(
        f"{srv.base}/v3/completions",
        headers=A,
        json={"model": name, "prompt": "Say OK.", "max_tokens": 1, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text[:300]
    return time.monotonic() - started


def live(srv: Server) -> float:
    started = time.monotonic()
    r = requests.get(srv.base + "/v2/health/live", timeout=60)
    assert r.status_code == 200
    return time.monotonic() - started


class Attack:
    """Runs `send` over and over on a thread (key B) while the engine process's RSS is sampled."""

    def __init__(self, srv: Server, send):
        self.srv, self.send = srv, send
        self.stop = threading.Event()
        self.answers: list[int] = []
        self.errors: list[BaseException] = []
        self.base_rss = rss_mb(srv.pid)
        self.peak_rss = self.base_rss

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                self.answers.append(self.send().status_code)
        except BaseException as exc:  # surfaced by the test
            self.errors.append(exc)

    def _sample(self) -> None:
        while not self.stop.wait(0.02):
            self.peak_rss = max(self.peak_rss, rss_mb(self.srv.pid))

    def __enter__(self) -> Attack:
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._run, self._sample)]
        for t in self.threads:
            t.start()
        time.sleep(0.3)  # the first one is in flight
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)
        assert not self.errors, self.errors


def measured_under(srv: Server, name: str, send, rounds: int = 4) -> tuple[float, float, Attack]:
    """(worst victim seconds, worst liveness seconds, the attack) while `send` runs back to back."""
    with Attack(srv, send) as attack:
        worst_victim = worst_live = 0.0
        for _ in range(rounds):
            worst_live = max(worst_live, live(srv))
            worst_victim = max(worst_victim, victim(srv, name))
            time.sleep(0.1)
    return worst_victim, worst_live, attack


def baseline(srv: Server, name: str) -> tuple[float, float]:
    """Median seconds of the victim's completion and of the liveness probe, with no attack running."""
    victim(srv, name)  # warm
    live(srv)
    return statistics.median(victim(srv, name) for _ in range(3)), statistics.median(live(srv) for _ in range(3))


def post(srv: Server, path: str, body: dict, timeout: float = 120) -> requests.Response:
    return requests.post(srv.base + path, headers=B, json=body, timeout=timeout)


def check(srv: Server, name: str, send, expect: set[int]) -> None:
    """`send` (key B) back to back: its answers in `expect`, key A's completions and the liveness probe on time,
    and the engine process grown by less than GROWTH_MB. The attack runs first unmeasured, as long as measured: the
    first step of a new shape makes OpenVINO allocate once for good (the first prompt-lookup verification step:
    +229 MB, the next ones +0, measured in-process), which is the runtime warming up, not what the request costs.
    (One warm-up round left the long prediction's batch beside the victims to the measured rounds on a busy box:
    +207 MB in 3 of 4 runs of this file.)"""
    measured_under(srv, name, send)  # as many rounds as measured: the batches met there are met here first
    base, live_base = baseline(srv, name)
    worst_victim, worst_live, attack = measured_under(srv, name, send)
    growth = attack.peak_rss - attack.base_rss
    print(
        f"\nvictim {worst_victim:.2f} s (baseline {base:.2f} s), live {worst_live:.3f} s (baseline {live_base:.3f} s),"
        f" engine +{growth:.0f} MB"
    )
    assert attack.answers and set(attack.answers) <= expect, attack.answers
    live_bound = max(LIVE_BOUND, LOAD_FACTOR * live_base)
    assert worst_live < live_bound, f"liveness took {worst_live:.2f} s during the attack (baseline {live_base:.3f} s)"
    victim_bound = max(base + VICTIM_MARGIN, LOAD_FACTOR * base)
    assert worst_victim < victim_bound, f"victim took {worst_victim:.2f} s (baseline {base:.2f} s)"
    assert growth < GROWTH_MB, f"the engine process grew by {growth:.0f} MB"


def digits(n: int) -> str:
    rng = random.Random(n)
    return "".join(rng.choice("0123456789") for _ in range(n))


class TestHostileRequestsFromAnotherKey:
    def test_a_tokenize_that_cannot_fit_is_refused_before_encoding(self, keyed):
        name = model_of(keyed)
        text = digits(1_500_000)
        # the same body for a model that is not there: its transfer and JSON, which the refusal may cost, no more.
        # Three rounds, interleaved: one descheduling of a busy 2-core box lengthens one sample, not the fastest
        # refusal, while encoding first (3-4 s on the 2-core box, 10-20x the transfer) lengthens every one.
        transfers, refusals = [], []
        for _ in range(ROUNDS):
            started = time.monotonic()
            r = post(keyed, "/v3/tokenize", {"model": name + "-absent", "prompt": text})
            assert r.status_code == 404, r.text[:300]
            transfers.append(time.monotonic() - started)
            started = time.monotonic()
            r = post(keyed, "/v3/tokenize", {"model": name, "prompt": text})
            assert r.status_code == 400 and "cannot fit" in r.json()["error"]["message"], r.text[:300]
            refusals.append(time.monotonic() - started)
        refused, transfer = min(refusals), statistics.median(transfers)
        assert refused < 3 * transfer + 0.5, f"refused in {refusals} s, the body's transfer {transfers} s"
        r = post(keyed, "/v3/completions", {"model": name, "prompt": text[:700_000], "max_tokens": 1})
        assert r.status_code == 400 and "cannot fit" in r.json()["error"]["message"], r.text[:300]
        check(keyed, name, lambda: post(keyed, "/v3/tokenize", {"model": name, "prompt": text}), {400})

    def test_a_large_tokenize_does_not_hold_the_engine_process(self, keyed):
        """600,000 random printable ASCII characters fit the character bound (8,192 x 80 for these characters)
        and become ~519,000 tokens (~2 s of encoding): encoded without the GIL, so the engine thread and the probes
        keep going. (600,000 digits are refused before encoding: no token of this vocabulary is two digits.)"""
        name = model_of(keyed)
        rng = random.Random(11)
        text = "".join(chr(rng.randrange(32, 127)) for _ in range(600_000))
        check(keyed, name, lambda: post(keyed, "/v3/tokenize", {"model": name, "prompt": text}), {200})
        r = post(keyed, "/v3/tokenize", {"model": name, "prompt": digits(600_000)})
        assert r.status_code == 400 and "cannot fit" in r.json()["error"]["message"], r.text[:300]
        # a list is bounded as one text: together they cannot fit (7 texts of 600,000 digits: 9 s and +857 MB)
        r = post(keyed, "/v3/tokenize", {"model": name, "prompt": [text[:300_000]] * 3})
        assert r.status_code == 400 and "cannot fit" in r.json()["error"]["message"], r.text[:300]
        # a completions prompt list: the first prompt that cannot fit ends it, before the next is tokenized
        many = {"model": name, "prompt": [text] * 6, "max_tokens": 1}
        check(keyed, name, lambda: post(keyed, "/v3/completions", many), {400})

    def test_bad_words_and_a_prediction_are_bounded_and_tokenized_once(self, keyed):
        name = model_of(keyed)
        rng = random.Random(7)
        words = ["".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(256)) for _ in range(256)]
        body = {"model": name, "prompt": ["hi"] * 16, "max_tokens": 4, "bad_words": words}
        emoji = "".join(chr(rng.randrange(0x1F600, 0x1F650)) for _ in range(65_536))
        r = post(keyed, "/v3/completions", {**body, "prediction": {"type": "content", "content": emoji}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prediction", r.text[:300]
        r = post(keyed, "/v3/completions", body)
        assert r.status_code == 400 and "set-up work" in r.json()["error"]["message"], r.text[:300]
        ok = {**body, "prompt": ["hi"] * 2, "bad_words": words[:4]}  # within the bounds: it runs
        assert post(keyed, "/v3/completions", ok).status_code == 200

        def both() -> requests.Response:
            post(keyed, "/v3/completions", {**body, "prediction": {"type": "content", "content": emoji}})
            return post(keyed, "/v3/completions", body)

        check(keyed, name, both, {400})

    def test_a_long_prediction_within_the_context_runs_without_stalling_others(self, keyed):
        name = model_of(keyed)
        rng = random.Random(3)
        text = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega", "sigma"]) for _ in range(4000))
        body = {
            "model": name,
            "prompt": "Say OK.",
            "max_tokens": 8,
            "temperature": 0,
            "max_ngram_size": 16,
            "prediction": {"type": "content", "content": text},
        }
        check(keyed, name, lambda: post(keyed, "/v3/completions", body), {200})

    def test_no_repeat_ngram_is_capped_and_its_index_counted(self, keyed):
        """The cap refuses 4001 (the review's probe); at the cap the index is prompt tokens x 31 per sequence, so n
        counts: 2,000 tokens x 31 x 16 choices is past the set-up limit, x 8 runs. (2,000 tokens, not 8,000: the
        prefill is what the box can do in a test; the repeats hit key B's own prefix cache, so what is measured
        is the set-up, not the prefill.)"""
        name = model_of(keyed)
        prompt = [random.Random(5).randrange(100, 40000) for _ in range(2000)]
        body = {"model": name, "prompt": prompt, "max_tokens": 2, "no_repeat_ngram": 4001}
        r = post(keyed, "/v3/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "no_repeat_ngram", r.text[:300]
        r = post(keyed, "/v3/completions", {**body, "no_repeat_ngram": 32, "n": 16})
        assert r.status_code == 400 and "set-up work" in r.json()["error"]["message"], r.text[:300]
        check(keyed, name, lambda: post(keyed, "/v3/completions", {**body, "no_repeat_ngram": 32, "n": 8}), {200})

    def test_generated_logprobs_are_bounded_per_request(self, keyed):
        name = model_of(keyed)
        r = post(keyed, "/v3/completions", {"model": name, "prompt": "hi", "n": 20, "logprobs": 20, "max_tokens": 8000})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text[:300]
        r = post(keyed, "/v3/completions", {"model": name, "prompt": "hi", "n": 2, "logprobs": 5, "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][1]["logprobs"]["top_logprobs"], r.text[:300]

    def test_keys_do_not_see_each_others_prefix_cache(self, keyed):
        name = model_of(keyed)
        memo = "CONFIDENTIAL MEMO. Acme Corp will acquire Globex for 4.2 billion dollars next quarter. " * 4
        assert cached(keyed, A, name, memo) == 0
        assert cached(keyed, A, name, memo) > 0  # key A's own repeat hits its blocks
        assert cached(keyed, B, name, memo) == 0, "key B learned what key A sent"
        assert cached(keyed, B, name, memo) > 0  # and key B's own repeat hits its own


def cached(srv: Server, headers: dict, name: str, prompt: str) -> int:
    r = requests.post(
        f"{srv.base}/v3/completions",
        headers=headers,
        json={"model": name, "prompt": prompt, "max_tokens": 1, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text[:300]
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_shared_prefix_cache_is_the_operators_choice(model_dir, tmp_path):
    with serve(model_dir, tmp_path, "--prefix-cache-sharing", "shared") as srv:
        name = model_of(srv)
        memo = "Shared notes for the whole team: the release ships on Friday after the final review. " * 4
        assert cached(srv, A, name, memo) == 0
        assert cached(srv, B, name, memo) > 0
