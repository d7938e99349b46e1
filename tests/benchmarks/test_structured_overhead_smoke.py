"""``python -m loramux.benchmarks.structured_overhead``, briefly on the tiny model: one pair of
runs at batch 1 writes a report with the recorded one's keys, every request made its tokens
and the constrained run timed its masks. Times mean nothing here and are not asserted."""

from __future__ import annotations

import json

from loramux.benchmarks.bench import study
from tests.benchmarks.recorded import missing_keys


def test_a_short_run_writes_the_recorded_report(tmp_path, tiny_model_dir):
    argv = ["--model", str(tiny_model_dir), "--out", str(tmp_path), "--tokens", "4"]
    assert study("structured-overhead").main([*argv, "--repeats", "1", "--batch-sizes", "1"]) == 0
    report = json.loads((tmp_path / "structured_overhead.json").read_text())
    assert not missing_keys("structured_overhead.json", report)
    (batch,) = report["batches"]
    constrained = batch["pairs"][0]["constrained"]
    assert constrained["finish_reasons"] == ["length"]
    assert constrained["mask_fill_ms_per_step"]["steps"] > 0
    assert "| batch | unconstrained ms/token |" in (tmp_path / "structured_overhead.md").read_text()
