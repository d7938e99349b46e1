"""DraftLength: proposes max_k where drafts are accepted, backs off where they are not,
probes now and then, and picks the k with the most expected tokens per unit cost."""

from __future__ import annotations

import random

import pytest

from loramux.engine.speculative.draft_length import (
    DraftLength,
    best_draft_length,
    expected_tokens,
    tokens_per_cost,
)


def closed_form_tokens(alpha: float, k: int) -> float:
    """(1 − α^(k+1)) / (1 − α), as the module docstring writes it (k + 1 at α = 1)."""
    return k + 1 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def closed_form_score(alpha: float, k: int, cost: float) -> float:
    """Expected tokens for a step that costs 1 + c·k plain steps."""
    return closed_form_tokens(alpha, k) / (1 + cost * k)


def run_steps(length: DraftLength, steps: int, accept) -> list[int]:
    """``steps`` steps where ``accept(k)`` says how many of k drafts were accepted; the ks."""
    ks = []
    for _ in range(steps):
        k = length.next_k()
        ks.append(k)
        if k:
            length.record(k, accept(k))
    return ks


def accept_all(k: int) -> int:
    return k


def reject_all(k: int) -> int:
    return 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_k": 0},
        {"max_k": 4, "verify_cost": 0.0},
        {"max_k": 4, "decay": 1.0},
        {"max_k": 4, "decay": 0.0},
        {"max_k": 4, "probe_interval": 0},
        {"max_k": 4, "probe_interval": 8, "max_probe_interval": 4},
    ],
)
def test_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError, match="DraftLength needs"):
        DraftLength(**kwargs)


@pytest.mark.parametrize(("proposed", "accepted"), [(2, 3), (1, -1), (-1, -1)])
def test_record_rejects_impossible_counts(proposed, accepted):
    with pytest.raises(ValueError, match="accepted <= proposed"):
        DraftLength(4).record(proposed, accepted)


def test_a_new_request_proposes_max_k():
    assert DraftLength(5).next_k() == 5


def test_everything_accepted_keeps_max_k():
    length = DraftLength(4)
    assert run_steps(length, 200, accept_all) == [4] * 200
    assert length.acceptance == 1.0


def test_nothing_accepted_backs_off_to_zero_apart_from_rare_probes():
    length = DraftLength(4, verify_cost=0.1)
    ks = run_steps(length, 2_000, reject_all)
    assert ks[0] == 4
    assert all(k == 1 for k in ks[20:] if k)  # after backing off, only probes of one token
    # The first ~7 steps, then probes 4, 8, 16, 32 and then 64 steps apart.
    assert sum(k > 0 for k in ks) / len(ks) < 0.025
    # What speculating cost, as a fraction of the 2,000 plain steps: under 5% even with
    # the first steps, which proposed before the evidence came in.
    assert sum(0.1 * k for k in ks) / len(ks) < 0.05
    assert sum(0.1 * k for k in ks[100:]) / len(ks[100:]) < 0.005  # probes alone, later


def test_probe_spacing_doubles_while_probes_fail_and_is_capped():
    length = DraftLength(4, probe_interval=4, max_probe_interval=64)
    ks = run_steps(length, 1_000, reject_all)
    backed_off_from = ks.index(0)
    probes = [i for i, k in enumerate(ks) if k and i >= backed_off_from]
    gaps = [b - a for a, b in zip([backed_off_from - 1, *probes], probes, strict=False)]
    assert gaps[:5] == [4, 8, 16, 32, 64]
    assert set(gaps[5:]) == {64} and len(gaps) > 10
    assert length.probe_interval == 64


def test_an_accepted_probe_brings_probes_back_close_together():
    length = DraftLength(4, probe_interval=4, max_probe_interval=64)
    run_steps(length, 500, reject_all)
    ks = run_steps(length, 64, lambda k: 0)
    assert length.probe_interval == 64 and 1 in ks
    # The next probe (within 64 steps) is accepted.
    ks = [length.next_k() for _ in range(64)]
    assert ks[-1] == 1 and set(ks) == {0, 1}
    length.record(1, 1)
    assert length.probe_interval == 4


def test_recovers_max_k_after_the_text_turns_copy_heavy():
    length = DraftLength(4, probe_interval=4, max_probe_interval=64)
    run_steps(length, 2_000, reject_all)  # deep in backoff: the longest probe spacing
    ks = run_steps(length, 200, accept_all)
    recovered_at = ks.index(4)
    assert recovered_at <= 64 + 20, ks[: recovered_at + 1]
    assert ks[recovered_at:] == [4] * (200 - recovered_at)


def test_falls_back_after_the_text_stops_being_copy_heavy():
    length = DraftLength(4)
    run_steps(length, 200, accept_all)
    ks = run_steps(length, 100, reject_all)
    # 200 steps of 4 acceptances each are strong evidence: k falls step by step, and
    # what it wastes on the way (c·k per step) is a few steps' worth.
    assert ks[0] == 4 and ks.index(0) <= 40
    assert sorted(ks[: ks.index(0)], reverse=True) == ks[: ks.index(0)]
    assert sum(0.1 * k for k in ks) < 10


def test_a_probe_stays_offered_until_a_step_records_it():
    length = DraftLength(4, probe_interval=4)
    ks = run_steps(length, 100, reject_all)
    assert ks[-1] == 0
    assert 1 in [length.next_k() for _ in range(64)]  # the probe, offered
    # Steps that proposed nothing (no n-gram match): the probe is still on offer.
    assert [length.next_k() for _ in range(5)] == [1] * 5
    length.record(1, 0)
    assert length.next_k() == 0


def test_a_step_that_verified_nothing_changes_nothing():
    length = DraftLength(4)
    run_steps(length, 10, lambda k: k // 2)
    before = length.acceptance
    length.record(0, 0)
    assert length.acceptance == before


@pytest.mark.parametrize(
    ("proposed", "accepted", "alpha"), [(4, 2, 2 / 3), (4, 0, 0.0), (3, 1, 0.5)]
)
def test_acceptance_counts_one_rejection_per_step_not_the_unjudged_tail(proposed, accepted, alpha):
    # Verification stops at the first rejection, so (4 proposed, 2 accepted) is two
    # acceptances and one rejection: α = 2/3, where accepted/proposed would say 1/2.
    length = DraftLength(4)
    for _ in range(300):
        length.record(proposed, accepted)
    assert length.acceptance == pytest.approx(alpha, abs=1e-9)


@pytest.mark.parametrize("alpha", [0.0, 0.05, 0.3, 0.5, 0.75, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("k", [0, 1, 4, 9])
def test_expected_tokens_is_the_closed_form(alpha, k):
    assert expected_tokens(alpha, k) == pytest.approx(closed_form_tokens(alpha, k))
    assert tokens_per_cost(alpha, k, 0.2) == pytest.approx(closed_form_score(alpha, k, 0.2))


@pytest.mark.parametrize("cost", [0.02, 0.1, 0.3])
@pytest.mark.parametrize("max_k", [1, 4, 8])
def test_the_chosen_k_maximises_tokens_per_cost(cost, max_k):
    for alpha in [i / 40 for i in range(41)] + [0.999]:
        scores = [closed_form_score(alpha, k, cost) for k in range(max_k + 1)]
        chosen = best_draft_length(alpha, max_k, cost)
        assert scores[chosen] == pytest.approx(max(scores), rel=1e-12), (alpha, chosen, scores)
    assert best_draft_length(0.0, max_k, cost) == 0
    # At α = c, one draft scores exactly what plain decoding does: the tie goes to 0.
    assert tokens_per_cost(0.25, 1, 0.25) == 1.0
    assert best_draft_length(0.25, max_k, 0.25) == 0
    assert best_draft_length(1.0, max_k, cost) == max_k


@pytest.mark.parametrize("accepted_per_step", [1, 2, 3])
@pytest.mark.parametrize("cost", [0.05, 0.1, 0.3])
def test_next_k_is_the_best_k_for_the_estimated_acceptance(accepted_per_step, cost):
    # Steady steps of 8 proposed and a accepted estimate α = a / (a + 1).
    length = DraftLength(8, verify_cost=cost)
    for _ in range(300):
        length.record(8, accepted_per_step)
    alpha = accepted_per_step / (accepted_per_step + 1)
    assert length.acceptance == pytest.approx(alpha)
    scores = [closed_form_score(alpha, k, cost) for k in range(9)]
    assert length.next_k() == scores.index(max(scores))


def simulated_throughput(alpha: float, steps: int, seed: int, cost: float) -> float:
    """Tokens per unit cost of a request whose drafts are each accepted with
    probability ``alpha`` (until the first rejection), with k from DraftLength."""
    rng = random.Random(seed)
    length = DraftLength(4, verify_cost=cost)
    tokens = spent = 0.0
    for _ in range(steps):
        k = length.next_k()
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        if k:
            length.record(k, accepted)
        tokens += accepted + 1
        spent += 1 + cost * k
    return tokens / spent


@pytest.mark.parametrize("alpha", [0.0, 0.05, 0.1, 0.2, 0.5, 0.8, 0.95, 1.0])
def test_throughput_is_never_much_below_plain_decoding_and_near_the_best_fixed_k(alpha):
    cost = 0.1
    best_fixed = max(closed_form_score(alpha, k, cost) for k in range(5))
    for seed in range(2):
        throughput = simulated_throughput(alpha, 3_000, seed, cost)
        assert throughput >= 0.95  # plain decoding: 1 token per step
        assert throughput >= 0.88 * best_fixed, (throughput, best_fixed)


@pytest.mark.parametrize("prior", [0.0, 0.3, 0.9, 1.0])
def test_a_new_request_starts_at_its_prior_acceptance(prior):
    length = DraftLength(4, verify_cost=0.2, prior_acceptance=prior)
    assert length.acceptance == pytest.approx(prior)
    assert length.next_k() == best_draft_length(prior, 4, 0.2)


def test_a_pessimistic_prior_is_outweighed_by_a_few_accepted_steps():
    length = DraftLength(4, verify_cost=0.1, prior_acceptance=0.0)
    assert length.next_k() == 0
    for _ in range(3):
        length.record(1, 1)
    assert length.acceptance > 0.7 and length.next_k() > 0


@pytest.mark.parametrize("prior", [-0.1, 1.5])
def test_a_prior_outside_0_1_is_refused(prior):
    with pytest.raises(ValueError, match="prior_acceptance"):
        DraftLength(4, prior_acceptance=prior)
