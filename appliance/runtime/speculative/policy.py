"""When to speculate and how many tokens to draft: a cost model of the step measured when the model loads.

A verification step feeds 1 + k tokens per speculating sequence; what that costs against a plain one-token step
depends on the model, the export and the box, and on the batch. On the AVX-512 box (bf16, fp16 export) 1 to 6
tokens fed cost the same, and prompt lookup with a fixed k = 5 reached 2.37x on grounded prompts at batch 1. On the
2-vCPU AVX2 box with the default model's int8 export, shared with other work (`python -m bench.speculative --only
shapes`, load average 8): a batch-1 forward feeding 1 / 3 / 6 tokens took 62 / 91 / 133 ms, so k = 5 costs 2.1x a
plain step and pays only above ~60% acceptance; the same fixed k there ran at 0.34-0.73x plain decoding (chat and
grounded prompts, 1-4 concurrent: docs/performance.md, "Speculation that never costs").

So `measure_step_costs` times backend.forward once, at load, on a small grid: batch b in 1, 2, 4, 8 (up to
speculation_max_batch, 4 by default) by tokens fed per sequence n in 1, 2, 3 and 6 (n > 1 with the logits of every
position, as verification asks; more tokens are extrapolated linearly), each point after one call that takes the
new shape (the CPU plugin re-plans when the fed shape changes: that call minus the steady one is the `switch`
cost, 15-30 ms on a quiet box) and then one timed call, in three rounds over the grid (the median per point: one
timed call per point was not enough on the shared box, it once timed 3 tokens at batch 1 as cheap as 1 where the
bench shows +47%; with two, the median is their mean, and one slow call moved it: on the quiet 2-vCPU Xeon VM one
load in four or five timed a verifying point at batch 1 40-90% above the steady time, e.g. 3 tokens 12.6 ms against
8.8-9.1, so the policy took verifying as that much dearer until a probe); the grid is made monotone (more never
costs less). The KV contents do not matter for timing, so the sequences share one block table at a 256-token past
and nothing is prefilled. That is 72 forwards of at most 24 tokens (1.5-2 s on the default model); the engine logs
the time and the table (docs/performance.md has the measured load times).

n = 2 is timed, not interpolated, because the cost is not linear across it where a backend runs a step of one token
on another compiled model than a step of more (the paged backend's graphs of rows on our kernels,
backends/row_graphs.py): on the default 135M model, before steps of 2-8 tokens had graphs of their own, on a Zen 5
box the table had one token at 7.4 ms and three at 13.7, so the line put two at 10.5, while the engine's steps of
two took 13.8 (`python -m bench.speculative --only profile`); the policy took k = 1 at acceptances above ~0.57 and
those steps made 1.35 tokens in 14.3 ms against plain's 1 in 8.5.

`SpeculationPolicy.plan` then decides per step, from that table, the current batch and each sequence's running
acceptance a_i (SpecState.rate: decayed counts of accepted / rejected draft positions): with a draft accepted
position by position at rate a, a sequence keeps a (1 - a^k) / (1 - a) drafts per step on top of its own token, so
with the m most accepting of b decoding sequences drafting k each the step makes b + sum_i<m g(a_i, k) tokens in
cost(b, 1 + m k / b) (+ the proposer's own time per drafted token, for a draft model). The plan is the (k, m) with
the most tokens per second, or none unless it beats plain decoding (b tokens in cost(b, 1)) by MARGIN; k is capped
by the requests' num_assistant_tokens and the engine's token budget.

A plan is also fair: no decoding sequence may expect fewer tokens per second than plain decoding gives it (FAIR of
it, for the table's noise). The longer step is everyone's: a sequence left out of the plan, or drafting at a low
acceptance, pays for the others' drafts. Where the fed tokens cost little (the AVX-512 box's fp16 export) that is
nothing; where they cost (our kernels' default model on a Zen 5 box: 4 sequences 13.3 ms plain, 19.5 ms with one
more token each), speculating for the best of them made the batch's own tokens per second higher and every other
stream slower, and four chat requests ended later: 0.92-0.99 of plain decoding's aggregate tok/s in six of six
runs (`python -m bench.speculative --only concurrency --concurrency 4`).

The table is timed once, but the box's speed is not constant and not alike for every step: on a 2-vCPU Zen 5 VM
the default model's one-token step (our kernels, memory-bound) swung 5.4-9.9 ms within minutes while its
three-token step (OpenVINO's graph) moved less, and the table taken at load put the one-token step 10-25% above
what the engine's own decode steps took a minute later; the policy then drafted at acceptances where verifying
lost, and prompt lookup ran 0.90x plain decoding on chat prompts at batch 1. So every decode step the engine runs
is `observe`d (unless it changed the fed shape: that step's extra is `switch`, counted apart): its backend time
against the table's, per measured batch and per kind (plain or verifying), a running ratio (OBSERVED per step)
that scales the table from then on. Plain steps run all the time and keep their
scale current; a verifying kind is corrected whenever it runs, so a table that flatters speculation corrects
itself within a few steps. One that undersells it would never be corrected, since the policy would not verify
again: a soak of 10,000 requests on a 2-vCPU host whose speed swung 2x within minutes drafted 5 tokens where its
other runs drafted ~2,500 (the table timed at load in a slow moment for the verifying shapes). So after EXPLORE
plans in a row without speculation, the policy probes: PROBE steps in which the most accepting sequence verifies
one draft token, whatever the table predicts (the first of them pays the shape's switch, or where the step runs on a
graph of its own what waking that graph costs, and is not observed), and their times weigh PROBED each in the
verifying kind's ratio. Waking costs where memory a process has not touched for a while is slow to reach again: on
the 2-vCPU Xeon VM (the host's, not the guest's: no page faults) the default model's graph of 4 rows took 36-47 ms
for its first step after 200 single-token steps against 13 back to back: observed, a probe's first step would weigh
the clamp (2x) at PROBED in the verifying kind's ratio. If verifying is as dear as the table says, that is
PROBE steps of one more fed token and two shape switches in EXPLORE steps (<1% at the default model's 8 ms a step
and a 30 ms switch); if not, the policy speculates again from the next step on.

A change of the fed shape costs `switch` once,
so a plan that changes the step's shape must beat keeping the last one by that cost spread over the next
`horizon` steps: the plan does not flicker between two near-equal shapes. Not where the backend runs the step's
count on a graph of its own (StepCosts.fixed, Backend.fixed_shapes: the paged backend's graphs of rows): a graph of
static shapes is never re-planned.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

BATCHES = (1, 2, 4, 8)  # batch sizes timed at load (up to speculation_max_batch)
FED = (1, 2, 3, 6)  # tokens fed per sequence timed at load: plain, k = 1, 2, 5 (more: extrapolated linearly)
ROUNDS = 3  # passes over the grid (the median per point: one slow call is not the point's cost)
CONTEXT = 256  # past tokens of every timed sequence
MARGIN = 1.1  # speculate only for a predicted gain above 10%: the costs are timed once, on a box with other work
OBSERVED = 0.05  # weight of one observed step in its kind's running ratio (~20 steps of memory)
EXPLORE = 1000  # plans in a row without speculation before the policy probes what verifying costs now
PROBE = 3  # steps a probe verifies one draft token (the first pays the shape's switch and is not observed)
PROBED = 0.5  # weight of a probe's observed step in its kind's running ratio
MEMO = 4096  # interpolated costs kept (StepCosts.cost)
FAIR = 0.95  # the least share of plain decoding's tokens per second a plan may predict for any decoding sequence


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one forward by (batch, tokens fed per sequence), measured on a grid; `cost` interpolates.
    `switch`: the extra seconds of the first call after the fed shape changes."""

    batches: tuple[int, ...]
    fed: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]  # [batch index][fed index]
    switch: float = 0.0
    measured_s: float = 0.0  # how long the measurement took
    fixed: int = 0  # steps of at most this many tokens change shape at no cost (Backend.fixed_shapes)
    # (b, n) -> cost: a plan asks ~10 points a step, each an interpolation over the whole grid (~3 us); the points
    # a step can ask are few (b up to speculation_max_batch, n = fed / b), cleared past MEMO all the same; not an
    # argument, so that dataclasses.replace gives a table of other costs a memory of its own
    _memo: dict[tuple[int, float], float] = field(default_factory=dict, init=False, compare=False, repr=False)

    def cost(self, b: int, n: float) -> float:
        """Seconds of a step of b sequences feeding n tokens each on average: linear in n between the measured
        counts, linear in b between the measured batches and proportional to b past the largest (beyond it the
        step is bound by compute)."""
        seconds = self._memo.get((b, n))
        if seconds is None:
            if len(self._memo) >= MEMO:
                self._memo.clear()
            by_batch = [_interp(self.fed, list(times), n) for times in self.seconds]
            if b > self.batches[-1]:
                seconds = by_batch[-1] * b / self.batches[-1]
            else:
                seconds = _interp(self.batches, by_batch, b)
            self._memo[(b, n)] = seconds
        return seconds


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), extrapolated along the nearest segment."""
    if len(xs) == 1:
        return ys[0]
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def expected_drafts(a: float, k: int) -> float:
    """Drafts kept per step when each is accepted with probability a while the previous ones were: sum a^j."""
    if k <= 0 or a <= 0:
        return 0.0
    if a >= 1:
        return float(k)
    return a * (1 - a**k) / (1 - a)


def measure_step_costs(
    forward: Callable[[int, int], None],
    batches: Sequence[int] = BATCHES,
    fed: Sequence[int] = FED,
    rounds: int = ROUNDS,
    fixed: int = 0,
) -> StepCosts:
    """Time `forward(b, n)` (one backend call of b sequences feeding n tokens each) on the grid, round by round
    (a drift of the box's load then touches every point alike): per point and round a call that takes the shape,
    then a timed one; per point the median over the rounds. `fixed`: the backend's Backend.fixed_shapes (the
    switch cost is taken from the points past it)."""
    t_start = time.perf_counter()
    points = [(b, n) for b in batches for n in fed]
    steady: dict[tuple[int, int], list[float]] = {p: [] for p in points}
    switches: list[float] = []
    for _ in range(rounds):
        for b, n in points:
            t0 = time.perf_counter()
            forward(b, n)
            t1 = time.perf_counter()
            forward(b, n)
            t2 = time.perf_counter()
            steady[(b, n)].append(t2 - t1)
            if b * n > fixed:
                switches.append(max(0.0, (t1 - t0) - (t2 - t1)))
    seconds = [[statistics.median(steady[(b, n)]) for n in fed] for b in batches]
    return StepCosts(
        tuple(batches),
        tuple(fed),
        monotone(seconds),
        switch=statistics.median(switches) if switches else 0.0,
        measured_s=time.perf_counter() - t_start,
        fixed=fixed,
    )


def monotone(seconds: Sequence[Sequence[float]]) -> tuple[tuple[float, ...], ...]:
    """The grid with every point at least its smaller neighbours (more sequences or more tokens never cost less:
    a point below them was timed while other work paused)."""
    out: list[tuple[float, ...]] = []
    for row in seconds:
        out.append(tuple(max([t, *row[:j], *(r[j] for r in out)]) for j, t in enumerate(row)))
    return tuple(out)


@dataclass(frozen=True)
class Plan:
    """This step's speculation: the `m` most accepting sequences draft `k` tokens each (k = 0: none does)."""

    k: int = 0
    m: int = 0
    rate: float = 0.0  # predicted tokens per second
    plain: float = 0.0  # predicted tokens per second without speculation


class SpeculationPolicy:
    """Per step: speculate or not, how many sequences and how many draft tokens each, from the measured step costs
    (module docstring). `horizon`: steps a changed shape is expected to last (the switch cost is spread over them).
    """

    def __init__(self, costs: StepCosts, horizon: int = 8, margin: float = MARGIN, fair: float = FAIR):
        self.costs, self.horizon, self.margin, self.fair = costs, horizon, margin, fair
        self.last_fed = 0  # tokens the last step fed for its decoding sequences
        # (index of the measured batch at or below b, verifying?) -> running ratio of observed to tabled seconds
        self.scale: dict[tuple[int, bool], float] = {}
        self.quiet = 0  # plans in a row without speculation
        self.probing = 0  # steps left of the current probe
        self.probe = False  # this step's plan is a probe

    def _kind(self, b: int, n: float) -> tuple[int, bool]:
        return max(0, bisect.bisect_right(self.costs.batches, b) - 1), n > 1

    def cost(self, b: int, n: float) -> float:
        """Seconds of a step of b sequences feeding n tokens each: the table's, scaled by what such steps took."""
        return self.costs.cost(b, n) * self.scale.get(self._kind(b, n), 1.0)

    def observable(self, fed: int) -> bool:
        """Whether this step, feeding `fed` tokens as the last `plan` decided (asked before `fed` records them), tells
        what such steps cost: not where it changes the fed shape past the graphs of static shapes (its extra is
        `switch`), nor a probe's first step (it pays that switch, or waking its graph: the module docstring)."""
        if self.probe and self.probing == PROBE - 1:
            return False
        return fed == self.last_fed or fed <= self.costs.fixed

    def observe(self, b: int, fed: int, seconds: float) -> None:
        """A decode step of b sequences feeding `fed` tokens in all took `seconds` in the backend (one that was
        `observable`). One step's ratio is clamped to [0.5, 2]: a pause of the whole process (a collection, a
        swap-in) is not the step's cost."""
        kind = self._kind(b, fed / b)
        ratio = min(2.0, max(0.5, seconds / max(1e-9, self.costs.cost(b, fed / b))))
        weight = PROBED if self.probe and kind[1] else OBSERVED
        self.scale[kind] = (1 - weight) * self.scale.get(kind, 1.0) + weight * ratio

    def plan(self, b: int, rates: Sequence[float], max_k: int, budget: int, draft_cost: float = 0.0) -> Plan:
        """b: sequences decoding this step; rates: the running acceptance of those that may speculate, highest
        first (len(rates) <= b); max_k: the most drafts any of them allows; budget: the step's token budget (at
        most b + m k fed); draft_cost: the proposer's seconds per drafted token."""
        cost = self.cost
        switch = self.costs.switch / max(1, self.horizon)
        self.probe = False

        def penalty(fed: int) -> float:
            return switch if self.last_fed and fed != self.last_fed and fed > self.costs.fixed else 0.0

        plain_step = cost(b, 1) + penalty(b)
        plain_rate = b / plain_step
        best = Plan(0, 0, plain_rate, plain_rate)
        gains = [0.0] * (len(rates) + 1)
        searched = self._may_beat(b, rates, max_k, max(1.0, self.margin) * plain_rate)  # else no k can win
        for k in range(1, max_k + 1) if searched else ():
            for m in range(1, len(rates) + 1):
                kept = expected_drafts(rates[m - 1], k)  # the least accepting of the m drafting sequences
                gains[m] = gains[m - 1] + kept
                fed = b + m * k
                if fed > budget:
                    break
                step = cost(b, fed / b) + draft_cost * m * k + penalty(fed)
                rate = (b + gains[m]) / step
                least = 1.0 if m < b else 1.0 + kept  # tokens this step of the sequence that gains least
                fair = least / step >= self.fair / plain_step
                if fair and rate > best.rate and rate > self.margin * plain_rate:
                    best = Plan(k, m, rate, plain_rate)
        if best.k:
            self.quiet = self.probing = 0
            return best
        return self._explore(b, rates, min(max_k, budget - b), best)

    def _may_beat(self, b: int, rates: Sequence[float], max_k: int, rate: float) -> bool:
        """Whether any plan could make more than `rate` tokens per second: at most every sequence keeps what k =
        max_k would keep, in at least the cheapest verifying step (one more token fed; the table is monotone). Most
        steps of chat fail it, and `plan` then skips its search over k and m: on the default model at 4 chat
        requests that search was most of speculation's 120-140 us a step, 1.5% of the step's time, for plans
        that never speculated."""
        most = b + sum(expected_drafts(a, max_k) for a in rates)
        return max_k > 0 and most / self.cost(b, (b + 1) / b) > rate

    def _explore(self, b: int, rates: Sequence[float], room: int, plain: Plan) -> Plan:
        """No plan beats plain decoding: count it, and after EXPLORE such plans probe for PROBE steps (module
        docstring): the most accepting sequence verifies one draft token. room: the most drafts allowed (by the
        requests and the token budget)."""
        if not rates or room < 1:
            return plain
        if not self.probing:
            self.quiet += 1
            if self.quiet < EXPLORE:
                return plain
            self.quiet, self.probing = 0, PROBE
        self.probing -= 1
        self.probe = True
        return Plan(1, 1, (b + expected_drafts(rates[0], 1)) / self.cost(b, (b + 1) / b), plain.plain)

    def fed(self, tokens: int) -> None:
        """The step fed `tokens` for its decoding sequences (what the next plan's shape is compared with)."""
        self.last_fed = tokens
