"""The measured cost of a proposed token: the fit of step seconds on tokens, and what the
speculator does with it."""

from __future__ import annotations

import random

import pytest

from loramux.engine.scheduler import ScheduledSequence, SchedulerOutput
from loramux.engine.speculative.draft_length import best_draft_length
from loramux.engine.speculative.speculator import VERIFY_COST, Speculator
from loramux.engine.speculative.step_cost import MIN_WEIGHT, StepCost


def feed(cost: StepCost, a: float, b: float, steps: int, tokens=range(1, 9), noise=0.0, seed=0):
    rng = random.Random(seed)
    for i in range(steps):
        n = tokens[i % len(tokens)]
        cost.observe(n, (a + b * n) * (1 + noise * rng.uniform(-1, 1)))


def test_the_fit_recovers_the_fixed_and_per_token_parts():
    cost = StepCost()
    feed(cost, a=0.050, b=0.010, steps=200, noise=0.05)
    a, b = cost.fit()
    assert a == pytest.approx(0.050, rel=0.1) and b == pytest.approx(0.010, rel=0.1)


@pytest.mark.parametrize(("decoding", "expected"), [(1, 0.010 / 0.060), (4, 0.040 / 0.090)])
def test_the_cost_is_the_batchs_tokens_share_of_its_step(decoding, expected):
    cost = StepCost()
    feed(cost, a=0.050, b=0.010, steps=100)
    assert cost.verify_cost(decoding) == pytest.approx(expected, rel=1e-6)


def test_the_prior_holds_until_steps_of_different_sizes_were_seen():
    cost = StepCost(default=0.1)
    assert cost.verify_cost(1) == 0.1
    feed(cost, a=0.050, b=0.010, steps=100, tokens=[3])  # one size only: no slope
    assert cost.fit() is None and cost.verify_cost(3) == 0.1
    fresh = StepCost(default=0.1)
    feed(fresh, a=0.050, b=0.010, steps=int(MIN_WEIGHT) - 1)
    assert fresh.fit() is None  # too few steps


def test_the_cost_stays_within_its_bounds():
    cost = StepCost(floor=0.02)
    feed(cost, a=1.0, b=0.0, steps=100)  # tokens cost nothing
    assert cost.verify_cost(4) == 0.02
    steep = StepCost()
    feed(steep, a=0.0, b=0.01, steps=100)  # all of a step in its tokens
    assert steep.verify_cost(1) == pytest.approx(1.0)


def test_the_fit_follows_a_machine_that_slows_down():
    cost = StepCost()
    feed(cost, a=0.050, b=0.005, steps=300)
    before = cost.verify_cost(1)
    feed(cost, a=0.050, b=0.020, steps=300)
    assert before == pytest.approx(0.005 / 0.055, rel=0.05)
    assert cost.verify_cost(1) == pytest.approx(0.020 / 0.070, rel=0.05)


@pytest.mark.parametrize(
    "kwargs", [{"default": 0.1, "floor": 0.2}, {"default": 1.5}, {"decay": 1.0}, {"decay": 0.0}]
)
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(ValueError, match="StepCost needs"):
        StepCost(**kwargs)


def test_a_higher_cost_makes_a_middling_request_back_off():
    """At acceptance 0.4: speculating pays at this CPU's batch-1 cost (~0.2) but not at its
    batch-4 cost (~0.5)."""
    assert best_draft_length(0.4, 4, 0.2) > 0
    assert best_draft_length(0.4, 4, 0.5) == 0
    assert best_draft_length(0.9, 4, 0.5) > 0  # a copying request still speculates


class _Seq:
    def __init__(self, request_id: str):
        self.request_id = request_id


def _decode_plan(query_tokens: list[int]) -> SchedulerOutput:
    items = []
    for i, n in enumerate(query_tokens):
        item = ScheduledSequence(_Seq(f"r{i}"), 1, samples=True)
        item.draft_token_ids = [0] * (n - 1)
        items.append(item)
    return SchedulerOutput(scheduled=items)


def test_the_speculator_learns_from_decode_steps_only():
    speculator = Speculator(max_k=4, ngram_max_n=4, ngram_min_n=2, max_model_len=512)
    assert speculator.proposal_cost == VERIFY_COST
    for i in range(60):
        extra = i % 4
        plan = _decode_plan([1 + extra, 1])
        speculator.observe_step(plan, 0.050 + 0.010 * (2 + extra))
    a, b = speculator.step_cost.fit()
    assert a == pytest.approx(0.050) and b == pytest.approx(0.010)
    prefill = SchedulerOutput(scheduled=[ScheduledSequence(_Seq("p"), 64, samples=True)])
    speculator.observe_step(prefill, 10.0)  # a prefill chunk: not a verified token's cost
    assert speculator.step_cost.fit() == pytest.approx((a, b))
