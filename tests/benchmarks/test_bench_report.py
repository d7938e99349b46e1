"""The bench report's pure parts: latency samples kept for plots, agreement, verdicts."""

from __future__ import annotations

from loramux.benchmarks.common.measures import agreement
from loramux.benchmarks.serve.gpu import judge, unjudged_reason
from loramux.benchmarks.serve.presets import PRESETS
from loramux.benchmarks.serve.report import cdf_points


def test_cdf_points_keep_short_samples_and_thin_long_ones_to_quantiles():
    assert cdf_points([3.0, 1.0, 2.0]) == [1.0, 2.0, 3.0]
    values = [float(v) for v in range(100_000, 0, -1)]
    points = cdf_points(values, limit=101)
    assert len(points) == 101 and points == sorted(points)
    assert (points[0], points[-1]) == (1.0, 100_000.0)
    assert abs(points[50] - 50_000.5) <= 0.5  # the median, to the nearest sample


def test_agreement_counts_identical_sequences_over_requests_both_served():
    loramux = {0: [1, 2], 1: [3, 4], 2: [5, 6], 3: [7]}
    baseline = {0: [1, 2], 1: [3, 9], 3: [7]}  # request 2 served by loramux only
    result = agreement(loramux, baseline)
    assert (result["requests"], result["identical_requests"]) == (3, 2)
    assert result["mismatched_requests"] == [1]
    assert result["min_common_prefix_tokens"] == 1  # request 1 agrees on its first token
    assert result["mean_common_prefix_tokens"] == round((2 + 1 + 1) / 3, 2)


def figures(requests_per_s: float, tokens_per_s: float, failed: int = 0) -> dict:
    return {
        "requests_per_s": requests_per_s,
        "output_tokens_per_s": tokens_per_s,
        "requests": {"total": 10, "ok": 10 - failed, "failed": failed},
    }


def test_goals_are_met_at_the_bound_unless_strict_and_only_with_every_request_served():
    slora, punica = PRESETS["slora-s2"], PRESETS["punica-distinct"]
    (goal,) = judge(slora, figures(12.0, 500.0), None)["goals"]
    assert (goal["met"], goal["verdict"]) == (True, "met")
    (goal,) = judge(slora, figures(11.9, 500.0), None)["goals"]
    assert (goal["met"], goal["verdict"]) == (False, "not met")
    (goal,) = judge(slora, figures(20.0, 900.0, failed=1), None)["goals"]
    assert goal["met"] is False and goal["verdict"] == "not met: 1 request(s) failed"
    (goal,) = judge(punica, figures(1.0, 1053.0), None)["goals"]  # "more than" Punica
    assert goal["met"] is False
    (goal,) = judge(punica, figures(1.0, 1053.5), None)["goals"]
    assert goal["met"] is True


def test_references_carry_loramux_figure_and_ratio_and_unjudged_runs_say_why():
    slora = PRESETS["slora-s2"]
    verdicts = judge(slora, figures(13.38, 500.0), "the CPU smoke")
    (reference,) = verdicts["references"]
    assert (reference["system"], reference["value"], reference["loramux"]) == (
        "S-LoRA",
        6.69,
        13.38,
    )
    assert abs(reference["ratio"] - 2.0) < 1e-9
    (goal,) = verdicts["goals"]
    assert goal["met"] is None and goal["verdict"] == "not judged: the CPU smoke"
    assert unjudged_reason(slora, 1000, smoke=False) is None
    assert "500 adapters" in unjudged_reason(slora, 500, smoke=False)
    assert "CPU smoke" in unjudged_reason(slora, 1000, smoke=True)
    assert judge(PRESETS["slora-s1"], figures(5.0, 1.0), None) == {"references": [], "goals": []}
