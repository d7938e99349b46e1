"""``loramux bench lora-overhead``: the engine with 16 adapters against itself with none.

The pure parts (counters and where they are read from, the ratio, the goal) on made-up
figures, the argument rules, and the ``--smoke`` form end to end on SmolLM2 through the
console entry point: its report must hold both kinds of run with their counters. The
smoke's times mean nothing; what it checks is that every part ran and was reported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from loramux.benchmarks.bench import study
from loramux.benchmarks.lora_overhead import runner as lora_overhead
from loramux.benchmarks.serve.presets import PRESETS, Baseline, Goal

REPO_ROOT = Path(__file__).resolve().parents[2]

PRESET = PRESETS["lora-overhead"]


def _run(kind: str, seconds: float, **counters) -> dict:
    return {
        "kind": kind,
        "seconds": seconds,
        "failed": 0,
        "counters": {name: counters.get(name, 0) for name in lora_overhead.COUNTERS},
    }


def test_the_preset_is_the_issues_workload():
    spec = PRESET.workload
    assert PRESET.baseline is Baseline.BASE_MODEL and PRESET.device == "cpu"
    assert (spec.num_requests, spec.num_adapters, spec.popularity) == (32, 16, "distinct")
    assert spec.output_len == (64, 64) and spec.input_len == (16, 96)
    assert set(spec.ranks) == {8, 16} and spec.base_fraction == 0
    assert PRESET.engine == {}  # the engine's defaults, nothing overridden
    [goal] = PRESET.goals
    assert goal.metric == "lora_over_base_seconds" and goal.at_most and goal.value == 1.10
    smoke = lora_overhead.workload_spec(PRESET, smoke=True, requests=None)
    assert (smoke.num_requests, smoke.num_adapters, smoke.output_len) == (4, 4, (8, 8))


def test_an_at_most_goal_is_met_at_or_below_its_value():
    goal = Goal(metric="m", value=1.10, at_most=True)
    assert goal.met_by(1.10) and goal.met_by(0.9) and not goal.met_by(1.11)
    assert goal.relation == "≤"
    assert not Goal(metric="m", value=1.10, at_most=True, strict=True).met_by(1.10)
    assert Goal(metric="m", value=2.0).met_by(2.0) and Goal(metric="m", value=2.0).relation == "≥"


def test_the_ratio_is_the_median_pair_with_best_and_median_runs_beside_it():
    runs = [
        _run("base", 10.0),
        _run("lora", 11.5, adapter_reloads=3),
        _run("base", 9.0),
        _run("lora", 10.8, adapter_reloads=2, preemptions=1),
        _run("base", 12.0),
        _run("lora", 10.0),
    ]
    summary = lora_overhead.summarize(runs)
    assert summary["best_seconds"] == {"base": 9.0, "lora": 10.0}
    assert summary["lora_over_base_seconds"] == pytest.approx(1.15, abs=1e-4)  # median pair
    assert summary["best_lora_over_base_seconds"] == pytest.approx(10.0 / 9.0, abs=1e-4)
    assert summary["median_lora_over_base_seconds"] == pytest.approx(10.8 / 10.0, abs=1e-4)
    assert summary["pair_ratios"] == [1.15, 1.2, pytest.approx(0.8333, abs=1e-4)]
    assert summary["counter_totals"]["lora"]["adapter_reloads"] == 5
    assert summary["counter_totals"]["lora"]["preemptions"] == 1
    assert summary["counter_totals"]["base"]["adapter_reloads"] == 0

    [goal] = lora_overhead.judge(PRESET, summary, runs, unjudged=None)
    assert goal["met"] is False and goal["verdict"] == "not met"  # 1.11 > 1.10
    [goal] = lora_overhead.judge(PRESET, summary, runs, unjudged="the smoke form")
    assert goal["met"] is None and goal["verdict"].startswith("not judged")


def test_counters_come_from_stats_residency():
    residency = SimpleNamespace(
        preemptions=2, adapter_evictions=5, adapter_reloads=4, adapter_room_wait_steps=7
    )
    engine = SimpleNamespace(stats=lambda: SimpleNamespace(residency=residency))
    assert lora_overhead.read_counters(engine) == {
        "preemptions": 2,
        "adapter_evictions": 5,
        "adapter_reloads": 4,
        "adapter_room_wait_steps": 7,
    }


@pytest.mark.parametrize(
    "argv",
    [
        ["lora-overhead", "--no-baseline"],
        ["lora-overhead", "--driver", "http"],
        ["lora-overhead", "--sweep", "load"],
        ["lora-overhead", "--repeats", "0"],
        ["lora-overhead", "--prepare-only"],
        ["cpu-smoke", "--repeats", "2"],
    ],
)
def test_options_that_do_not_apply_are_refused(argv):
    with pytest.raises(SystemExit) as exit_info:
        study(argv[0]).parse(argv[1:])
    assert exit_info.value.code == 2


def test_the_smoke_reports_both_kinds_of_run_with_their_counters(tmp_path):
    command = [sys.executable, "-m", "loramux.platform.cli", "bench", "lora-overhead"]
    done = subprocess.run(
        [*command, "--smoke", "--out", str(tmp_path)],
        cwd=REPO_ROOT,
        # One torch thread: the smoke's times mean nothing, and on a 2-core machine that
        # other work keeps busy two OpenMP threads wait on each other for minutes.
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "bench_lora-overhead-smoke.json").read_text())
    assert report["smoke"] is True and report["repeats"] == 1
    assert [run["kind"] for run in report["runs"]] == ["base", "lora"]
    for run in report["runs"]:
        assert run["requests"] == 4 and run["failed"] == 0 and run["short"] == 0
        assert run["tokens"] == 4 * 8  # fixed length: every request its 8 tokens
        assert run["seconds"] > 0 and run["cores_used"] > 0
        assert run["cached_prompt_tokens"] == 0  # each run's prompts are its own
        assert set(run["counters"]) == set(lora_overhead.COUNTERS)
        assert all(isinstance(v, int) for v in run["counters"].values())
    assert [a["rank"] for a in report["adapters"]] == [8, 16, 8, 16]
    assert report["lora_over_base_seconds"] > 0
    assert report["engine_config"]["device"] == "cpu" and report["engine_config"]["kv_blocks_total"]
    [goal] = report["goals"]
    assert goal["met"] is None and goal["verdict"].startswith("not judged")
    assert report["command"].startswith("loramux bench lora-overhead --smoke")

    markdown = (tmp_path / "bench_lora-overhead-smoke.md").read_text()
    assert markdown in done.stdout
    assert "| preemptions | adapter evictions | adapter re-loads |" in markdown
    assert "**lora / base = " in markdown and "**Goal: lora / base seconds ≤ 1.1" in markdown
    assert "differences of engine.stats().residency" in markdown
    assert (tmp_path / "bench_lora-overhead-smoke_seconds.png").stat().st_size > 10_000
