"""``loramux bench prefill-cpu``: one short prefill of the embedded default in a worker
process, so CI keeps the benchmark working (its figures on so short a prompt mean nothing
and are not asserted)."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.commands import loramux


def test_a_prefill_is_timed_in_a_worker_and_reported(tmp_path):
    command = ["bench", "prefill-cpu", "--lengths", "64", "--threads", "1", "--repeats", "2"]
    result = loramux(*command, "--out", str(tmp_path), timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads((tmp_path / "prefill_cpu.json").read_text())
    [row] = report["rows"]
    assert row["engine"].startswith("loramux (after, ")
    assert (row["threads"], row["length"], row["batch"], len(row["seconds"])) == (1, 64, 1, 2)
    assert (row["hog"], row["wait"]) == (False, "default")
    assert row["tokens_per_s"] == pytest.approx(64 / row["median_s"], rel=0.01)
    assert (tmp_path / "prefill_cpu.png").stat().st_size > 0
    assert "| loramux (after, " in (tmp_path / "prefill_cpu.md").read_text()
