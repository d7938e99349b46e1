"""``loramux bench fairness-slo --smoke``: the preset's whole run for a few seconds on the
tiny model, so CI keeps it working: the platform in-process with its tenants, the idle
probes, the weighted streams and the priority probes over HTTP, ``/admin/engine`` sampled,
``/metrics`` read, the figures, both plots and the report. Shares and latencies of so short
a run on the tiny model mean nothing and are not asserted; the report's structure and its
bookkeeping (client counts against the server's) are.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from loramux.benchmarks.serve.presets import PRESETS
from tests.benchmarks.commands import loramux

PRESET = PRESETS["fairness-slo"]
WEIGHTED = {"w1": 1.0, "w2": 2.0, "w4": 4.0}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, tiny_model_dir) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("fairness_slo")
    command = ["bench", "fairness-slo", "--smoke", "--model", str(tiny_model_dir)]
    result = loramux(*command, "--cache-dir", str(out / "cache"), "--out", str(out), timeout=300)
    return result, out


@pytest.fixture(scope="module")
def report(smoke_run) -> dict:
    result, out = smoke_run
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return json.loads((out / "bench_fairness-slo-smoke.json").read_text())


def test_the_preset_declares_three_weighted_tenants_and_a_priority_one():
    tenants = {t.name: (t.priority, t.weight) for t in PRESET.workload.tenants}
    assert tenants == {"w1": (5, 1.0), "w2": (5, 2.0), "w4": (5, 4.0), "priority": (9, 1.0)}
    assert PRESET.engine["max_num_seqs"] == 8
    assert {g.metric for g in PRESET.goals} == {
        "share_max_deviation",
        "priority_ttft_p50_ratio",
        "priority_ttft_p99_ratio",
    }


def test_every_weighted_tenant_has_a_share_next_to_its_weight_share(report):
    shares = report["shares"]
    assert set(shares["tenants"]) == set(WEIGHTED)
    for name, weight in WEIGHTED.items():
        row = shares["tenants"][name]
        assert row["weight_share"] == pytest.approx(weight / 7, abs=1e-3)
        assert row["tokens"] > 0, name  # every weighted tenant was served in the window
        assert row["ratio"] == pytest.approx(row["share"] / row["weight_share"], rel=1e-2)
    assert sum(t["share"] for t in shares["tenants"].values()) == pytest.approx(1, abs=1e-3)
    buckets = len(shares["edges_s"]) - 1
    assert all(len(counts) == buckets for counts in shares["tokens"].values())
    # The per-bucket series adds up to the window's tokens.
    first, last = shares["window_buckets"]
    for name, counts in shares["tokens"].items():
        assert sum(counts[first : last + 1]) == shares["tenants"][name]["tokens"]


def test_priority_ttft_idle_and_under_flood_and_their_ratios(report):
    ttft, config = report["ttft"], report["config"]
    assert ttft["priority_idle"]["n"] == config["idle_probes"]
    assert ttft["priority_flood"]["n"] >= 1
    for row in ttft.values():
        if row["n"]:
            assert 0 < row["p50_ms"] <= row["p99_ms"] <= row["max_ms"]
    figures = report["figures"]
    assert figures["priority_ttft_p50_ratio"] == pytest.approx(
        ttft["priority_flood"]["p50_ms"] / ttft["priority_idle"]["p50_ms"], rel=1e-2
    )
    assert [g["metric"] for g in report["goals"]] == [g.metric for g in PRESET.goals]
    assert all(g["met"] in (True, False) for g in report["goals"])


def test_slo_attainment_and_shed_counts_add_up_and_match_the_metrics(report):
    attainment = report["slo_attainment"]
    for name in ("priority 5 (w1, w2, w4)", "priority 9", *WEIGHTED):
        a = attainment[name]
        assert a["sent"] >= a["admitted"] >= a["met"] >= 0
        assert a["sent"] > 0, name
    weighted = attainment["priority 5 (w1, w2, w4)"]
    assert weighted["sent"] == sum(attainment[n]["sent"] for n in WEIGHTED)
    for name, row in report["shed_expired"].items():
        assert row["client"]["errors"] == 0, (name, row)
        assert row["matches"], (name, row)  # what the clients saw is what /metrics counts
    for name, served in report["served_output_tokens"].items():
        assert served["metrics"] >= served["client"] > 0, (name, served)


def test_markdown_and_plots(smoke_run, report):
    _, out = smoke_run
    markdown = (out / "bench_fairness-slo-smoke.md").read_text()
    for figure in (
        "share / weight share",
        "Priority tenant under the flood / idle",
        "SLO attainment",
    ):
        assert figure in markdown
    for name in ("share", "ttft_cdf"):
        png = out / f"bench_fairness-slo-smoke_{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png.name})" in markdown
