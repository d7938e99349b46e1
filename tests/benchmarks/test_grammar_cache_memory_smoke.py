"""``python -m loramux.benchmarks.grammar_cache_memory``, briefly on the tiny model: two
scenarios of three small schemas each, in their own processes, write a report with the
recorded one's keys; the default budgets keep what the unbounded scenario keeps."""

from __future__ import annotations

import json

from loramux.benchmarks.bench import study
from loramux.benchmarks.grammar_cache_memory import runner as grammar_cache_memory
from tests.benchmarks.recorded import missing_keys


def test_a_short_run_writes_the_recorded_report(tmp_path, tiny_model_dir):
    argv = ["--model", str(tiny_model_dir), "--out", str(tmp_path), "--schemas", "3"]
    argv += ["--values", "200", "--scenarios", "unbounded", "one-tenant"]
    assert study("grammar-cache-memory").main(argv) == 0
    report = json.loads((tmp_path / "grammar_cache_memory.json").read_text())
    assert not missing_keys("grammar_cache_memory.json", report)
    unbounded, one_tenant = report["scenarios"]
    for scenario in (unbounded, one_tenant):
        assert scenario["cache"]["entries"] == 4  # the warm-up's and the three schemas'
        assert scenario["schema_bytes"]["min"] > 0 and scenario["rss_after_mib"] > 0
    assert unbounded["budget_bytes"] == grammar_cache_memory.UNBOUNDED_BYTES
    assert one_tenant["budget_bytes"] == 256 << 20
    assert one_tenant["tenant_budget_bytes"] == 64 << 20
    text = (tmp_path / "grammar_cache_memory.md").read_text()
    assert "| unbounded | none (64 GiB) | 1 |" in text
