"""``loramux bench adapter-churn --smoke``: both runs (churn and all resident) on the tiny
model with a few dozen adapters, in seconds, so CI keeps the runner (adapter writing, the
arrival-driven step loop, the figures, the report) working. Its times mean nothing and are
not asserted; the counts are, and the report keeps the recorded results' keys.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.benchmarks.commands import loramux
from tests.benchmarks.recorded import missing_keys

RUNS = ("churn", "resident")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, tiny_model_dir) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("adapter_churn")
    command = ["bench", "adapter-churn", "--smoke", "--model", str(tiny_model_dir)]
    result = loramux(*command, "--cache-dir", str(out / "cache"), "--out", str(out), timeout=300)
    return result, out


@pytest.fixture(scope="module")
def report(smoke_run) -> dict:
    result, out = smoke_run
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return json.loads((out / "adapter_churn_cpu_smoke.json").read_text())


def test_both_runs_have_itl_percentiles_and_served_every_request(report):
    requests = report["config"]["requests"]
    for name in RUNS:
        run = report[name]
        assert run["requests"] == requests
        assert run["failed_or_short"] == 0
        assert run["tokens"] == requests * report["config"]["max_tokens"]
        itl = run["itl"]
        assert itl["samples"] == requests * (report["config"]["max_tokens"] - 1)
        assert 0 < itl["p50_ms"] <= itl["p90_ms"] <= itl["p99_ms"] <= itl["max_ms"]
        assert run["queue"]["samples"] == requests and run["queue"]["p50_ms"] >= 0
    assert report["ratio_itl_p99"] > 0
    assert isinstance(report["verdict_met"], bool)


def test_adapter_lookups_add_up(report):
    requests = report["config"]["requests"]
    for name in RUNS:
        a = report[name]["adapters"]
        # Every request looks its adapter up on the device; each device miss in host RAM.
        assert a["device_hits"] + a["device_misses"] == requests
        assert a["host_hits"] + a["host_misses"] == a["device_misses"]
    resident, churn = report["resident"]["adapters"], report["churn"]["adapters"]
    assert resident["device_hits"] == requests
    assert resident["loads"] == 0 and resident["device_evictions"] == 0
    # The churn run's tiers hold far fewer adapters than the trace uses.
    assert churn["loads"] >= report["config"]["distinct_adapters_used"]
    assert churn["device_evictions"] > 0 and churn["host_evictions"] > 0
    assert report["churn"]["steps"]["device_loads"] > 0
    assert report["resident"]["steps"]["with_device_load"]["samples"] == 0


def test_the_report_keeps_every_key_of_the_recorded_results(report):
    # lora_forms counts each step by the adapters it served, under names that changed with
    # the engine's LoRA path; what is counted is kept, the names are the engine's.
    missing = {k for k in missing_keys("adapter_churn_cpu.json", report) if ".lora_forms." not in k}
    assert not missing, sorted(missing)


def test_markdown_has_the_verdict_line(smoke_run, report):
    _, out = smoke_run
    markdown = (out / "adapter_churn_cpu_smoke.md").read_text()
    verdict = re.search(
        r"\*\*Verdict: churn ITL P99 / all-resident ITL P99 = ([0-9.]+)x "
        r"\(target <= 1\.2x\): (met|not met)\.\*\*",
        markdown,
    )
    assert verdict is not None, markdown
    assert verdict[2] == ("met" if report["verdict_met"] else "not met")
    assert report["command"] in markdown
