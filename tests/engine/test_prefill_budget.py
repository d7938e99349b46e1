"""The prompt tokens a step takes, sized so that its prompt part lasts about the target
(engine/prefill_budget.py): against a model of a step's time, fixed cost + decodes + tokens."""

from __future__ import annotations

import pytest

from loramux.engine.prefill_budget import INITIAL_TOKENS, PrefillBudget

FIXED_S = 0.025  # what a step costs whatever it holds
PER_TOKEN_S = 0.002  # one more prompt token
PER_DECODE_S = 0.003  # one more decode row
TARGET_S = 0.15


def step_seconds(prompt_tokens: int, decodes: int) -> float:
    return FIXED_S + PER_TOKEN_S * prompt_tokens + PER_DECODE_S * decodes


def run(budget: PrefillBudget, steps: int, decodes: int = 0) -> list[int]:
    sizes = []
    for _ in range(steps):
        n = budget.tokens()
        sizes.append(n)
        if decodes:  # a step of decodes alone now and then, as a busy engine has them
            budget.observe(0, decodes, step_seconds(0, decodes))
        budget.observe(n, decodes, step_seconds(n, decodes))
    return sizes


def test_a_prefill_step_converges_to_the_target():
    budget = PrefillBudget(TARGET_S, max_tokens=2048, min_tokens=16)
    assert budget.tokens() == INITIAL_TOKENS
    sizes = run(budget, 40)
    expected = (TARGET_S - FIXED_S) / PER_TOKEN_S  # the fixed point: the step lasts the target
    assert sizes[-1] == pytest.approx(expected, rel=0.05)
    assert step_seconds(sizes[-1], 0) == pytest.approx(TARGET_S, rel=0.05)


def test_decodes_beside_the_chunk_do_not_starve_the_prefill():
    # 40 decodes alone take 0.145 s, nearly the target: the chunk still gets the target's
    # worth of prompt work, not the minimum.
    budget = PrefillBudget(TARGET_S, max_tokens=2048, min_tokens=16)
    sizes = run(budget, 60, decodes=40)
    assert sizes[-1] == pytest.approx(TARGET_S / PER_TOKEN_S, rel=0.15)


def test_short_steps_are_not_measured_and_the_budget_stays_in_bounds():
    budget = PrefillBudget(TARGET_S, max_tokens=256, min_tokens=16)
    budget.observe(8, 0, 0.05)  # a short prompt alone: all fixed cost, not measured
    assert budget.tokens() == INITIAL_TOKENS and budget.seconds_per_token is None
    budget.observe(128, 0, 0.001)  # nearly free: capped at max_tokens
    assert budget.tokens() == 256
    for _ in range(20):
        budget.observe(budget.tokens(), 0, 10.0)  # very slow: floored at min_tokens
    assert budget.tokens() == 16


def test_without_a_target_the_token_budget_alone_bounds_a_step():
    budget = PrefillBudget(None, max_tokens=2048, min_tokens=16)
    budget.observe(2048, 0, 30.0)
    assert budget.tokens() == 2048
    with pytest.raises(ValueError, match="positive"):
        PrefillBudget(0.0, max_tokens=2048, min_tokens=16)
