"""``loramux bench``: a preset served by loramux and by transformers + PEFT, reported.

The engine driver's checks share one run of ``cpu-smoke`` (4 requests) with its baseline
and both sweeps (1 and 4 adapters; 1x and 4x the load): each test checks its part of that
run's report, markdown and plots. The HTTP driver has a run of its own.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.benchmarks.commands import loramux

REQUESTS = 4  # per run: both tenants get some, and each run takes about 2 s of arrivals


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("cpu_smoke")
    done = loramux(
        "bench",
        "cpu-smoke",
        "--requests",
        str(REQUESTS),
        "--sweep",
        "adapters",
        "--sweep",
        "load",
        "--sweep-values",
        "1,4",
        "--out",
        str(out),
    )
    return done, out


@pytest.fixture(scope="module")
def engine_report(engine_run) -> dict:
    done, out = engine_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "bench_cpu-smoke.json").read_text())


def test_a_gpu_preset_without_a_gpu_says_so():
    done = loramux("bench", "slora-s2")
    assert done.returncode == 2, done.stderr
    assert "needs a CUDA GPU" in done.stderr and "not measured yet" in done.stderr


def test_cpu_smoke_reports_both_systems_and_their_ratio(engine_run, engine_report):
    done, out = engine_run
    report = engine_report
    assert report["loramux"]["driver"] == "engine"
    for system in ("loramux", "baseline"):
        figures = report[system]
        assert figures["requests"] == {"total": REQUESTS, "ok": REQUESTS, "failed": 0}
        assert figures["output_tokens_per_s"] > 0 and figures["ttft_s"]["p50"] > 0
    assert report["ratios"]["output_tokens_per_s"] > 0
    assert report["workload"]["seed"] == 0 and report["workload"]["num_requests"] == REQUESTS
    markdown = (out / "bench_cpu-smoke.md").read_text()
    assert "loramux / transformers + PEFT:" in markdown and markdown in done.stdout
    for plot in ("latency_cdf", "tenant_share"):
        assert (out / f"bench_cpu-smoke_{plot}.png").stat().st_size > 10_000


def test_cpu_smoke_over_http(tmp_path):
    """The same preset through a real platform server and the openai client, streaming."""
    done = loramux(
        "bench",
        "cpu-smoke",
        "--requests",
        str(REQUESTS),
        "--driver",
        "http",
        "--no-baseline",
        "--out",
        str(tmp_path),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "bench_cpu-smoke.json").read_text())
    assert report["loramux"]["requests"] == {"total": REQUESTS, "ok": REQUESTS, "failed": 0}
    assert report["loramux"]["itl_s"]["p50"] > 0
    assert "loramux (http)" in (tmp_path / "bench_cpu-smoke.md").read_text()


def test_throughput_against_adapters_sweep(engine_run, engine_report):
    _, out = engine_run
    sweep = engine_report["sweeps"]["adapters"]
    assert [p["num_adapters"] for p in sweep["points"]] == [1, 4]
    assert all(p["figures"]["requests"]["ok"] == REQUESTS for p in sweep["points"])
    plot = out / "bench_cpu-smoke_throughput_vs_adapters.png"
    assert plot.stat().st_size > 10_000


def test_ttft_against_offered_load_sweep(engine_run, engine_report):
    _, out = engine_run
    report = engine_report
    sweep = report["sweeps"]["load"]
    assert sweep["kind"] == "load" and sweep["values"] == [1.0, 4.0]
    rate = report["workload"]["rate"]
    assert [p["offered_rate"] for p in sweep["points"]] == [rate, 4 * rate]
    for point in sweep["points"]:
        figures = point["figures"]
        assert point["num_adapters"] == report["workload"]["num_adapters"]
        assert figures["requests"] == {"total": REQUESTS, "ok": REQUESTS, "failed": 0}
        assert figures["ttft_s"]["p50"] > 0 and figures["ttft_s"]["p99"] >= figures["ttft_s"]["p50"]
        assert "samples" not in figures
    markdown = (out / "bench_cpu-smoke.md").read_text()
    assert "## Sweep: load (loramux, engine driver)" in markdown
    assert f"| {4 * rate:.2f} |" in markdown
    assert (out / "bench_cpu-smoke_ttft_vs_load.png").stat().st_size > 10_000
