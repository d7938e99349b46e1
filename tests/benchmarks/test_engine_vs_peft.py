"""``loramux bench engine-vs-peft`` end to end on the tiny model: this checkout's engine and
HEAD's (``--before``) against transformers + PEFT, with ``--repeats 2`` and ``--profile``.
The figures of so small a run mean nothing; what is asserted is that every part ran and
that the report keeps every key of the recorded results, so old and new results compare.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.benchmarks.commands import REPO_ROOT, loramux
from tests.benchmarks.recorded import RESULTS, key_paths, missing_keys


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir) -> tuple[dict, str, Path]:
    out = tmp_path_factory.mktemp("engine_vs_peft")
    command = ["bench", "engine-vs-peft", "--quick", "--requests", "3", "--adapters", "2"]
    command += ["--max-tokens", "4", "--repeats", "2", "--peft-batch-sizes", "3,2"]
    command += ["--before", "HEAD", "--profile", "--model", str(tiny_model_dir)]
    done = loramux(*command, "--cache-dir", str(out / "cache"), "--out", str(out))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    # Another model's results are named after its folder, beside the preset's.
    stem = "engine_vs_peft_cpu_quick_" + re.sub(r"[^a-z0-9]+", "-", tiny_model_dir.name.lower())
    report = json.loads((out / f"{stem}.json").read_text())
    return report, (out / f"{stem}.md").read_text(), out


def test_the_report_keeps_every_key_of_the_recorded_results(run):
    report, _, _ = run
    missing = missing_keys("engine_vs_peft_cpu.json", report)
    assert not missing, sorted(missing)
    recorded = json.loads((RESULTS / "engine_vs_peft_cpu.json").read_text())
    for peft_run, recorded_run in zip(report["peft_runs"], recorded["peft_runs"], strict=True):
        assert not key_paths(recorded_run) - key_paths(peft_run)


def test_every_system_served_every_request_in_every_repeat(run):
    report, _, _ = run
    engines = (report["engine"], report["engine_before"])
    for entry in (*engines, *report["peft_runs"]):
        assert entry["requests"] == 3 and entry["tokens"] == 3 * 4
        assert len(entry["all_runs"]) == 2 and entry["tokens_per_s"] > 0
        assert entry["cores_used"] > 0
    assert [r["label"] for r in report["peft_runs"]] == ["PEFT batch 3", "PEFT batch 2"]
    assert report["baseline"] in {"PEFT batch 3", "PEFT batch 2"}
    for engine in engines:
        assert engine["preemptions"] == 0 and engine["ttft_max_s"] >= engine["ttft_median_s"]
    before = report["engine_before"]
    assert Path(before["imported_from"]).name == "__init__.py"
    assert (
        before["sha"]
        == subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, text=True).strip()
    )
    agree = before["agreement_with_after"]
    assert agree["requests"] == 3 and 0 <= agree["identical_requests"] <= 3


def test_the_markdown_has_every_row_and_the_profile_is_written(run):
    report, markdown, out = run
    assert f"| loramux engine (before, {report['engine_before']['sha'][:7]}) |" in markdown
    assert "| loramux engine (after) |" in markdown
    assert "| transformers + PEFT (baseline) |" in markdown
    assert "**Engine after / before: " in markdown and report["command"] in markdown
    profile = (out / report["engine_profile"]).read_text()
    assert "engine run under cProfile" in profile and "by cumulative time" in profile
