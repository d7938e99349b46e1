"""The soak's plumbing (``loramux bench soak``, ``benchmarks/soak/runner.py``) for a few seconds.

A real ``loramux serve`` on the tiny random Llama gets the soak's mix of requests and
adapter churn for 8 s, sampled every second, then the billing, database and shutdown
checks run, so CI keeps the script (the server's start and stop, the clients, the churn,
the sampler, the report and the plot) working. The figures of so short a run mean
nothing; what is asserted is that every part ran and that nothing failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def soak(tmp_path_factory, tiny_model_dir) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("soak")
    command = [sys.executable, "-m", "loramux.platform.cli", "bench", "soak"]
    options = {
        "--duration": "8",
        "--sample-interval": "1",
        "--churn-interval": "0.5",
        "--concurrency": "3",
        "--rate": "4",
        # Seconds are too short to judge memory: the first requests' allocations may land
        # after any warm-up, so the RSS check is made lenient (its plumbing still runs).
        "--warmup": "0.5",
        "--rss-tolerance-mib": "200",
        "--model": str(tiny_model_dir),
        "--cache-dir": str(out / "cache"),
        "--out": str(out),
    }
    done = subprocess.run(
        [*command, *(part for pair in options.items() for part in pair)],
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done, out


@pytest.fixture(scope="module")
def report(soak) -> dict:
    done, out = soak
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (path,) = out.glob("soak_*.json")  # soak_cpu, or soak_cuda where a GPU serves
    return json.loads(path.read_text())


def test_every_check_passed(report):
    assert report["verdict"]["passed"], report["verdict"]["checks"]
    assert not report["counts"]["failures"] and not report["sample_errors"]


def test_the_load_mixed_kinds_targets_and_churn(report):
    counts = report["counts"]
    assert counts["requests"] >= 10
    assert counts["by_status"].get("200", 0) >= 10
    assert {"base", "stable"} <= counts["by_target"].keys()
    actions = {event["action"] for event in report["churn_events"]}
    assert actions == {"upload", "version", "delete"}
    billing = report["billing"]
    assert billing["requests_billed"] == billing["requests_returned"] > 0
    assert billing["completed"]["returned"] == billing["completed"]["billed"]


def test_samples_follow_the_server(report):
    samples = report["samples"]
    assert len(samples) >= 5
    for sample in samples:
        assert sample["rss_mib"] > 0 and sample["fds"] > 0 and sample["threads"] > 0
        assert sample["kv_blocks_usable"] > 0 and "registered_adapters" in sample
    assert report["verdict"]["fits"]["rss_mib"] is not None
    assert report["database"]["stuck_versions"] == 0


def test_markdown_and_plot_are_written(soak, report):
    done, out = soak
    (markdown_path,) = out.glob("soak_*.md")
    markdown = markdown_path.read_text()
    assert "**Verdict: passed.**" in markdown and markdown in done.stdout
    assert markdown_path.with_suffix(".png").stat().st_size > 20_000
