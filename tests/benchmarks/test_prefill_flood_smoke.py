"""``loramux bench prefill-flood --smoke``: the preset's whole run for seconds on the tiny
model, so CI keeps it working: the platform in-process, the two tenants, the idle probes,
the four attacks with the victim's probes during each, the attacker leaving, the usage
records read back, the figures, the plot and the report. Times of so short a run on the
tiny model mean nothing and are not asserted; the report's structure and its bookkeeping
(what the clients received against what was billed) are.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from loramux.benchmarks.prefill_flood.runner import ATTACKS
from tests.benchmarks.commands import loramux


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, tiny_model_dir) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("prefill_flood")
    command = ["bench", "prefill-flood", "--smoke", "--model", str(tiny_model_dir)]
    result = loramux(*command, "--cache-dir", str(out / "cache"), "--out", str(out), timeout=300)
    return result, out


@pytest.fixture(scope="module")
def report(smoke_run) -> dict:
    result, out = smoke_run
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return json.loads((out / "bench_prefill-flood-smoke.json").read_text())


def test_every_attack_has_the_victim_s_ttft_against_idle(report):
    assert report["idle"]["n"] == report["config"]["idle_probes"]
    figures = report["attack_figures"]
    assert list(figures) == [a.name for a in ATTACKS["smoke"]]
    for name, attack in figures.items():
        ttft = attack["ttft"]
        assert ttft["n"] == report["config"]["probes"] and not ttft["errors"], name
        assert attack["p50_over_idle"] == pytest.approx(
            ttft["p50_s"] / report["idle"]["p50_s"], abs=0.01
        )
        assert attack["busy_after_leaving_s"] is not None, name  # the engine went idle


def test_what_was_delivered_is_what_was_billed(report):
    for name, attack in report["attack_figures"].items():
        # Each smoke attack finishes before its client leaves: every prompt token it sent
        # was computed and billed, once, and every completion token it received too.
        assert attack["billed_prompt_tokens"] == attack["sent_prompt_tokens"], name
        assert attack["billed_completion_tokens"] == attack["delivered_completion_tokens"], name
        assert set(attack["outcomes"]) == {"200"}, name
    victim = report["victim"]
    assert victim["received_tokens"] == victim["billed_completion_tokens"] > 0
    assert victim["usage_records"] == victim["probes"]


def test_the_report_and_its_plot_are_written(smoke_run, report):
    _, out = smoke_run
    markdown = (out / "bench_prefill-flood-smoke.md").read_text()
    assert "Victim idle TTFT" in markdown
    for name in report["attack_figures"]:
        assert f"| {name} |" in markdown
    assert (out / "bench_prefill-flood-smoke_ttft.png").stat().st_size > 0
