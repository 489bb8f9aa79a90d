"""The speculation policy (runtime/speculative/policy.py) decides from measured step costs and acceptance.

- Its cost table interpolates and extrapolates the measured grid; the measurement times each point after a call that
  takes its shape.
- Its decisions: where a verification step costs what a plain one does (memory-bound), it drafts the most tokens at
  any acceptance; where every fed token costs the same (compute-bound), it never speculates; between (the AVX2
  box's measured table) it drafts more as acceptance rises, fewer as the batch grows, and within the token budget;
  a near-tie does not change the step's shape; no plan makes a decoding sequence slower than plain decoding; the
  engine's decode steps as they run correct the table, per batch and kind of step; a table that oversells verifying
  is probed after a thousand plans without speculation and corrected; the bound that lets a plan skip its search
  never changes what it decides, and the interpolated costs it keeps stay bounded.
- In the engine's Speculation (with a fake proposer): the sequences the plan leaves out get a shadow draft that is
  checked against the tokens the next steps produce, so their running acceptance keeps up and they speculate again
  once a whole draft would have been kept, not after one kept token.
- Where the backend runs a step's count of tokens on a graph of its own (Backend.fixed_shapes), a draft is fed
  unpadded, a change of the count pays no switch, and the switch is timed on the counts past those graphs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from appliance.config import EngineConfig
from appliance.runtime.engine.speculation import Speculation
from appliance.runtime.scheduler import Scheduler
from appliance.runtime.speculative.policy import (
    EXPLORE,
    PROBE,
    SpeculationPolicy,
    StepCosts,
    expected_drafts,
    measure_step_costs,
    monotone,
)
from appliance.runtime.speculative.state import PRIOR, SpecState
from tests.runtime.test_engine_parts import FakeProposer, decoding, make_scheduler

# the default model's int8 export on the 2-vCPU AVX2 box under load (ms, batch x tokens fed per sequence)
AVX2 = StepCosts((1, 2, 4), (1, 3), ((0.103, 0.148), (0.128, 0.291), (0.194, 0.364)), switch=0.03)


def flat(seconds: float = 0.02) -> StepCosts:
    """Memory-bound: a step costs the same whatever is fed."""
    return StepCosts((1, 2, 4), (1, 3), ((seconds,) * 2,) * 3)


def per_token(seconds: float = 0.01) -> StepCosts:
    """Compute-bound: every fed token costs the same."""
    return StepCosts((1, 2, 4), (1, 3), tuple(tuple(seconds * b * n for n in (1, 3)) for b in (1, 2, 4)))


def speculation(costs: StepCosts, fixed_shapes: int = 0) -> tuple[Scheduler, Speculation]:
    """The engine's Speculation over a fresh scheduler, one fake proposer drafting 51, 52, 53, and `costs`; the
    backend's graphs of static shapes hold steps of up to `fixed_shapes` tokens."""
    sched = make_scheduler()
    counters = {"draft_tokens": 0, "accepted_draft_tokens": 0}
    proposers = {"fake": FakeProposer([51, 52, 53])}
    costs = replace(costs, fixed=fixed_shapes)  # as measured on that backend (engine/speculation.py measure)
    return sched, Speculation(proposers, sched, EngineConfig(), counters, costs=costs, fixed_shapes=fixed_shapes)


def test_expected_drafts():
    assert expected_drafts(0.0, 5) == 0 and expected_drafts(0.5, 0) == 0
    assert expected_drafts(1.0, 5) == 5
    assert expected_drafts(0.5, 2) == pytest.approx(0.5 + 0.25)
    assert expected_drafts(0.9, 5) == pytest.approx(sum(0.9**j for j in range(1, 6)))


def test_costs_interpolate_and_extrapolate():
    c = AVX2
    assert c.cost(1, 1) == pytest.approx(0.103) and c.cost(4, 3) == pytest.approx(0.364)
    assert c.cost(1, 2) == pytest.approx((0.103 + 0.148) / 2)
    assert c.cost(3, 1) == pytest.approx((0.128 + 0.194) / 2)
    assert c.cost(1, 6) == pytest.approx(0.148 + 3 * (0.148 - 0.103) / 2)  # past the grid: the last segment
    assert c.cost(8, 1) == pytest.approx(2 * 0.194)  # past the largest batch: proportional


def test_measurement_times_each_point_after_a_shape_call_round_by_round():
    calls: list[tuple[int, int]] = []
    costs = measure_step_costs(lambda b, n: calls.append((b, n)), batches=(1, 2), fed=(1, 3), rounds=2)
    assert calls == 2 * [(1, 1), (1, 1), (1, 3), (1, 3), (2, 1), (2, 1), (2, 3), (2, 3)]
    assert (costs.batches, costs.fed) == ((1, 2), (1, 3))
    assert len(costs.seconds) == 2 and all(len(row) == 2 for row in costs.seconds)
    assert costs.measured_s >= 0 and costs.switch >= 0


@pytest.mark.parametrize("rate", [0.2, 0.5, 0.95])
@pytest.mark.parametrize("b", [1, 2, 4])
def test_memory_bound_steps_draft_the_most(rate, b):
    plan = SpeculationPolicy(flat()).plan(b, [rate] * b, max_k=5, budget=256)
    assert (plan.k, plan.m) == (5, b) and plan.rate > plan.plain


@pytest.mark.parametrize("rate", [0.05, 0.5, 0.95, 0.99])
@pytest.mark.parametrize("b", [1, 2, 4, 8])
def test_compute_bound_steps_never_speculate(rate, b):
    plan = SpeculationPolicy(per_token()).plan(b, [rate] * b, max_k=5, budget=256)
    assert (plan.k, plan.m) == (0, 0) and plan.rate == plan.plain


def test_measured_table_drafts_more_as_acceptance_rises_and_less_as_the_batch_grows():
    policy = SpeculationPolicy(AVX2)
    ks = [policy.plan(1, [a], max_k=5, budget=256).k for a in (0.1, 0.5, 0.8, 0.95)]
    assert ks[0] == 0 and ks == sorted(ks) and ks[-1] == 5
    # extra positions cost more at batch 4: fewer drafts at the same acceptance, none where batch 1 still drafts
    assert 0 < policy.plan(4, [0.7] * 4, max_k=5, budget=256).k < policy.plan(1, [0.7], max_k=5, budget=256).k
    assert policy.plan(1, [0.4], max_k=5, budget=256).k > 0 and policy.plan(4, [0.4] * 4, max_k=5, budget=256).k == 0


def test_a_plan_never_slows_the_sequences_it_leaves_out():
    # the AVX2 table: drafts for two of four sequences would make the step 22-110% longer for the other two
    avx2 = SpeculationPolicy(AVX2)
    assert avx2.plan(4, [0.99, 0.99, 0.1, 0.1], max_k=5, budget=256).k == 0
    assert avx2.plan(4, [0.99] * 4, max_k=5, budget=256).k > 0
    unfair = SpeculationPolicy(AVX2, fair=0.0)  # the batch's tokens per second alone
    assert unfair.plan(4, [0.99, 0.99, 0.1, 0.1], max_k=5, budget=256).m in (1, 2)
    # where fed tokens cost little (2% a token per sequence at batch 4), only the accepting ones draft
    gentle = StepCosts((1, 2, 4), (1, 3), ((0.100, 0.104),) * 3)
    plan = SpeculationPolicy(gentle).plan(4, [0.99, 0.99, 0.1, 0.1], max_k=5, budget=256)
    assert 1 <= plan.m <= 2 and plan.k > 0


def test_request_k_and_token_budget_cap_the_plan():
    policy = SpeculationPolicy(flat())
    assert policy.plan(1, [0.9], max_k=2, budget=256).k == 2
    plan = policy.plan(4, [0.9] * 4, max_k=5, budget=4 + 8)
    assert 4 + plan.m * plan.k <= 12 and plan.k > 0


def test_a_small_predicted_gain_is_not_taken():
    # k = 1 at acceptance 0.5: 1.5 tokens in 0.140 s against 1 in 0.100 s, 7% more: inside the margin
    costs = StepCosts((1,), (1, 2), ((0.100, 0.140),))
    assert SpeculationPolicy(costs).plan(1, [0.5], max_k=1, budget=256).k == 0
    assert SpeculationPolicy(costs, margin=1.0).plan(1, [0.5], max_k=1, budget=256).k == 1


def test_a_near_tie_keeps_the_last_shape():
    # k = 1 at acceptance 0.5: 1.5 tokens in 0.147 s against 1 in 0.100 s, within the switch cost (0.08 s spread over
    # 8 steps): the last step's shape wins
    policy = SpeculationPolicy(StepCosts((1,), (1, 2), ((0.100, 0.147),), switch=0.08), horizon=8, margin=1.0)
    assert policy.plan(1, [0.5], max_k=1, budget=256).k == 1  # no last shape: the faster one
    policy.fed(1)  # the last step decoded plainly
    assert policy.plan(1, [0.5], max_k=1, budget=256).k == 0
    policy.fed(2)  # the last step speculated
    assert policy.plan(1, [0.5], max_k=1, budget=256).k == 1
    assert policy.plan(1, [0.9], max_k=1, budget=256).k == 1  # a clear gain switches whatever the last shape


def test_observed_steps_correct_the_table_by_kind():
    # timed at load: one token 10 ms, three 15 ms; k = 2 at acceptance 0.7 makes 2.19 tokens in 15 ms: speculate
    policy = SpeculationPolicy(StepCosts((1, 2), (1, 3), ((0.010, 0.015), (0.012, 0.020))))
    assert policy.plan(1, [0.7], max_k=2, budget=256).k == 2
    for _ in range(60):  # the engine's plain steps now take 7 ms: verifying 2.19 in 15 loses to 1 in 7
        policy.observe(1, 1, 0.007)
    assert policy.cost(1, 1) == pytest.approx(0.007, rel=0.05) and policy.cost(1, 3) == pytest.approx(0.015)
    assert policy.plan(1, [0.7], max_k=2, budget=256).k == 0
    assert policy.cost(2, 1) == pytest.approx(0.012)  # another batch's steps keep their own scale
    for _ in range(60):  # verifying steps got cheaper too
        policy.observe(1, 3, 0.009)
    assert policy.plan(1, [0.7], max_k=2, budget=256).k == 2
    before = policy.cost(1, 1)
    policy.observe(1, 1, 5.0)  # a stalled process is not the step's cost: one step moves the scale by a tenth at most
    assert before < policy.cost(1, 1) < 1.1 * before


def run_plans(policy: SpeculationPolicy, steps: int, verifying: float) -> list[int]:
    """`steps` plans of one sequence at acceptance 0.9, each step observed at 10 ms plain, `verifying` with a draft:
    the k of each."""
    ks = []
    for _ in range(steps):
        k = policy.plan(1, [0.9], max_k=1, budget=256).k
        policy.observe(1, 1 + k, verifying if k else 0.010)
        ks.append(k)
    return ks


def test_a_table_that_oversells_verifying_is_probed_and_corrected():
    # timed at load in a slow moment: verifying one draft 20 ms against a plain step's 10; it would pay at 0.9
    oversold = StepCosts((1,), (1, 2), ((0.010, 0.020),))
    policy = SpeculationPolicy(oversold)
    assert run_plans(policy, EXPLORE - 1 + PROBE, 0.010) == [0] * (EXPLORE - 1) + [1] * PROBE
    assert policy.plan(1, [0.9], max_k=1, budget=256).k == 1 and not policy.probe  # corrected: a plan of its own
    # where verifying is as dear as the table says, a probe of PROBE steps every EXPLORE plans, no more
    policy = SpeculationPolicy(oversold)
    ks = run_plans(policy, 3 * EXPLORE + 3 * PROBE, 0.020)
    assert sum(ks) == 3 * PROBE and ks[EXPLORE - 1 : EXPLORE - 1 + PROBE] == [1] * PROBE
    assert policy.cost(1, 2) == pytest.approx(0.020)
    # no room for a draft (the requests' k or the token budget): no probe
    policy = SpeculationPolicy(oversold)
    assert not any(policy.plan(1, [0.9], max_k=0, budget=256).k for _ in range(2 * EXPLORE))
    assert not any(policy.plan(2, [0.9], max_k=1, budget=2).k for _ in range(2 * EXPLORE))


def test_a_probes_first_step_is_not_observed():
    # the table oversells verifying (20 ms); the probe's first step wakes its graph of static shapes (100 ms: a step
    # of 2 tokens runs on a graph of its own, so the change of shape alone would not keep it from being observed),
    # the next takes 10
    policy = SpeculationPolicy(StepCosts((1,), (1, 2), ((0.010, 0.020),), fixed=8))
    assert run_plans(policy, EXPLORE - 1, 0.010) == [0] * (EXPLORE - 1)
    observed = []
    for seconds in (0.100, 0.010):
        assert policy.plan(1, [0.9], max_k=1, budget=256).k == 1 and policy.probe
        observed.append(policy.observable(2))
        if observed[-1]:  # as the engine's Speculation: it observes only what the policy finds observable
            policy.observe(1, 2, seconds)
        policy.fed(2)
    assert observed == [False, True]
    assert policy.cost(1, 2) == pytest.approx(0.020 * (0.5 + 0.5 * 0.5))  # the warm step alone moved the scale
    assert policy.plan(1, [0.9], max_k=1, budget=256).k == 1 and not policy.probe  # corrected: a plan of its own


def test_only_a_decode_step_as_planned_is_observed():
    sched, spec = speculation(flat())
    (seq,) = decoding(sched, "s")
    spec.propose()
    assert spec.planned == (0, 0)  # the first step in a new shape: its time is the table's `switch`, not observed
    fed = 1 + len(seq.draft)
    seq.num_computed += 1
    seq.token_ids.append(51)
    spec.propose()
    assert spec.planned == (1, fed) == (1, 1 + len(seq.draft)) and spec.policy is not None
    spec.observe(2, 1 + len(seq.draft) + 7, 0.5)  # a prompt chunk ran beside it
    spec.observe(1, 2, 0.5)  # the schedule cut the draft short
    assert spec.policy.scale == {}
    spec.observe(1, 1 + len(seq.draft), 0.03)
    assert spec.policy.scale == {(0, True): pytest.approx(1 + 0.05 * 0.5)}


def test_measured_costs_are_made_monotone():
    # a larger step timed faster than a smaller one (other work paused meanwhile) counts as the smaller one
    assert monotone([[0.1, 0.2], [0.09, 0.15], [0.3, 0.25]]) == ((0.1, 0.2), (0.1, 0.2), (0.3, 0.3))


def test_rate_follows_recent_verifications():
    spec = SpecState("prompt_lookup", max_k=5)
    assert spec.rate == pytest.approx(PRIOR)
    for _ in range(6):
        spec.observe(5, 5)
    assert spec.rate > 0.95
    for _ in range(10):
        spec.observe(0, 5)
    assert spec.rate < 0.2


def test_left_out_sequences_keep_a_shadow_and_come_back():
    """A compute-bound table: nobody speculates, every sequence gets a shadow draft of the length it would feed
    (padding included); it stays until settled, and once one is kept at every position on a memory-bound table, the
    sequence drafts again."""
    sched, spec = speculation(per_token())
    (seq,) = decoding(sched, "s")
    start = len(seq.token_ids)
    spec.propose()
    assert seq.draft == [] and seq.spec is not None and seq.spec.shadow == (start, (51, 52, 53, 53, 53))
    before = seq.spec.rate
    for token in (51, 52, 53, 53):  # the steps produce the shadow, one token each: nothing settled yet
        seq.num_computed += 1
        seq.token_ids.append(token)
        spec.propose()
        assert seq.spec.shadow == (start, (51, 52, 53, 53, 53)) and seq.spec.rate == before
    spec.policy = SpeculationPolicy(flat())
    seq.num_computed += 1
    seq.token_ids.append(53)  # its last position kept too
    spec.propose()
    assert seq.spec.rate > 0.9 and seq.draft == [51, 52, 53, 53, 53] and seq.spec.shadow is None


def test_a_shadow_kept_for_one_token_only_does_not_start_drafting():
    """Chat: a lookup draft whose first token is kept (a common bigram) and the next missed is settled as one kept
    of five, and the rate falls where a draft kept at every position raises it."""
    sched, spec = speculation(per_token())
    (seq,) = decoding(sched, "s")
    spec.propose()
    assert seq.spec is not None and seq.spec.shadow is not None
    seq.num_computed += 2
    seq.token_ids += [51, 60]  # first position kept, second missed
    spec.propose()
    assert seq.spec.rate < PRIOR * 1.6 and seq.spec.shadow == (len(seq.token_ids), (51, 52, 53, 53, 53))
    spec.policy = SpeculationPolicy(AVX2)
    seq.num_computed += 1
    seq.token_ids.append(70)  # the next shadow missed at once
    spec.propose()
    assert seq.draft == [] and seq.spec.rate < PRIOR


def test_rejected_never_counts_positions_a_verification_has_not_reached():
    """A chunk emitted in the middle of a verification reports what is settled: the usage folds chunks with max(),
    so a transient overcount (every fed position counted before it was checked) would stick."""
    spec = SpecState("prompt_lookup", max_k=3)
    spec.proposed, spec.pending = 3, 3  # a verification of 3 drafts starts
    seen = [spec.rejected]
    for _ in range(2):  # positions 1 and 2 kept, a chunk after each
        spec.accepted, spec.pending = spec.accepted + 1, spec.pending - 1
        seen.append(spec.rejected)
    spec.pending = 0  # position 3 missed: the verification is over
    seen.append(spec.rejected)
    assert seen == [0, 0, 0, 1]


@pytest.mark.parametrize(("fixed", "draft"), [(0, [51, 52, 53, 53, 53]), (4, [51, 52, 53, 53, 53]), (6, [51, 52, 53])])
def test_drafts_are_padded_to_k_only_past_the_backends_fixed_shapes(fixed, draft):
    """A memory-bound table drafts k = 5 at batch 1 (6 tokens fed). A draft of 3 is padded to 5 where a change of
    the fed count may make the graph re-plan; where the backend runs 6 tokens on a graph of their own it is fed as
    it is, and such a step is observed although its count changed."""
    sched, spec = speculation(flat(), fixed_shapes=fixed)
    (seq,) = decoding(sched, "s")
    spec.propose()
    assert seq.draft == draft
    fed = 1 + len(draft)  # the last step fed none: a change of shape, observed only inside the fixed shapes
    assert spec.planned == ((1, fed) if fed <= fixed else (0, 0))


def test_a_change_within_the_fixed_shapes_pays_no_switch():
    """A switch that dwarfs the step keeps the plan from changing the fed shape, but not among counts the backend
    runs on graphs of their own (StepCosts.fixed)."""
    slow = StepCosts((1, 2, 4), (1, 3), ((0.02,) * 2,) * 3, switch=1.0)
    kept = SpeculationPolicy(slow)
    kept.fed(1)
    assert kept.plan(1, [0.9], 2, 64).k == 0
    free = SpeculationPolicy(StepCosts((1, 2, 4), (1, 3), ((0.02,) * 2,) * 3, switch=1.0, fixed=8))
    free.fed(1)
    assert free.plan(1, [0.9], 2, 64).k == 2


def test_the_switch_is_timed_past_the_fixed_shapes():
    """measure_step_costs takes the switch cost from the points the backend's graphs of static shapes do not hold."""
    calls: list[tuple[int, int]] = []

    def forward(b: int, n: int) -> None:
        first = not calls or calls[-1] != (b, n)
        calls.append((b, n))
        if first and b * n > 4:  # a re-plan on the graph of dynamic shapes
            sleep_until(0.004)

    costs = measure_step_costs(forward, (1, 2), (1, 3), rounds=1, fixed=4)
    assert costs.fixed == 4 and costs.switch >= 0.003
    assert measure_step_costs(forward, (1,), (1, 3), rounds=1, fixed=4).switch == 0.0  # no point past it


def sleep_until(seconds: float) -> None:
    """Busy for `seconds` (a stand-in for a graph's re-plan: time.sleep may return early or late by more)."""
    import time

    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class _Searching(SpeculationPolicy):
    """The policy without its bound: every plan searches k and m."""

    def _may_beat(self, b, rates, max_k, rate):
        return True


def _random_costs(rng) -> StepCosts:
    """A monotone table of 1-4 batches by 2-4 fed counts from 1 (as measured), from flat to steeper than per token."""
    batches = (1, *sorted(rng.sample([2, 3, 4, 8], rng.randint(0, 3))))
    fed = (1, *sorted(rng.sample([2, 3, 4, 6], rng.randint(1, 3))))
    slope = rng.choice([0.0, 0.01, 0.3, 1.0, 3.0])
    seconds = [[0.01 * b**0.5 * (1 + slope * (n - 1)) * rng.uniform(0.8, 1.2) for n in fed] for b in batches]
    return StepCosts(batches, fed, monotone(seconds), switch=rng.choice([0.0, 0.02]), fixed=rng.choice([0, 8]))


def test_the_bound_never_changes_a_plan():
    """`plan` skips its search where no plan could beat plain decoding by the margin: it must decide exactly as the
    full search does, probes included (the same calls in the same order, random tables, acceptances and batches)."""
    import random

    rng = random.Random(5)
    skipped = 0
    for _ in range(60):
        costs = _random_costs(rng)
        margin = rng.choice([0.9, 1.0, 1.1, 1.5])
        fast, full = SpeculationPolicy(costs, margin=margin), _Searching(costs, margin=margin)
        for _ in range(40):
            b = rng.randint(1, 6)
            rates = sorted(rng.choice([0.0, 0.05, rng.random(), 0.99]) for _ in range(rng.randint(0, b)))[::-1]
            max_k, budget = rng.randint(0, 6), rng.choice([b, b + 3, 512])
            draft_cost = rng.choice([0.0, 0.001])
            skipped += not fast._may_beat(b, rates, max_k, max(1.0, margin) * b / fast.cost(b, 1))
            assert fast.plan(b, rates, max_k, budget, draft_cost) == full.plan(b, rates, max_k, budget, draft_cost)
            assert (fast.quiet, fast.probing, fast.probe) == (full.quiet, full.probing, full.probe)
            fed = rng.choice([b, b + 1, b + 4])
            fast.fed(fed), full.fed(fed)
            for policy in (fast, full):
                policy.observe(b, fed, costs.cost(b, fed / b) * 1.3)
    assert skipped > 100  # the bound did cut searches short


def test_costs_are_remembered_and_the_memory_is_bounded():
    """StepCosts.cost keeps what it interpolated (a plan asks the same points every step), never more than MEMO."""
    from appliance.runtime.speculative.policy import MEMO

    kept = replace(AVX2)  # a table of its own (a fresh memory), not the module's shared one
    points = [(b, 1 + i / 7) for b in (1, 2, 3, 5) for i in range(MEMO // 3)]
    for b, n in points:
        assert kept.cost(b, n) == pytest.approx(StepCosts(AVX2.batches, AVX2.fed, AVX2.seconds).cost(b, n))
        assert kept.cost(b, n) == kept.cost(b, n)
        assert len(kept._memo) <= MEMO
    assert StepCosts(AVX2.batches, AVX2.fed, AVX2.seconds).cost(2, 2.0) == pytest.approx(kept.cost(2, 2.0))
    doubled = replace(kept, seconds=tuple(tuple(2 * t for t in row) for row in AVX2.seconds))
    assert doubled.cost(2, 2.0) == pytest.approx(2 * kept.cost(2, 2.0))  # its own costs, not the other's memory
