"""``python -m loramux.benchmarks.grammar_engines`` with no engine to measure: the engines not
installed and those not asked for are each reported skipped, and the report is still written
(no table, the reasons). The measurements themselves are the recorded run's."""

from __future__ import annotations

import json

from loramux.benchmarks.bench import study
from loramux.benchmarks.grammar_engines import runner as grammar_engines


def test_engines_not_installed_or_not_asked_for_are_skipped(tmp_path, tokenizer_dir, monkeypatch):
    monkeypatch.setattr(grammar_engines.OutlinesCoreEngine, "module", "no_such_module")
    argv = ["--tokenizer", str(tokenizer_dir), "--out", str(tmp_path)]
    assert study("grammar-engines").main([*argv, "--engines", "outlines-core"]) == 0
    report = json.loads((tmp_path / "grammar_engines.json").read_text())
    assert report["engines"] == {
        "xgrammar": {"skipped": "not asked for (--engines)"},
        "llguidance": {"skipped": "not asked for (--engines)"},
        "outlines-core": {"skipped": "not installed (pip install outlines-core)"},
    }
    text = (tmp_path / "grammar_engines.md").read_text()
    assert "outlines-core: skipped (not installed (pip install outlines-core))" in text
    assert "|" not in text  # no engine, no table


def test_the_recorded_report_renders_a_row_per_measure_and_a_column_per_engine():
    from tests.benchmarks.recorded import RESULTS

    text = grammar_engines.render(json.loads((RESULTS / "grammar_engines.json").read_text()))
    table = [line for line in text.render().splitlines() if line.startswith("|")]
    assert table[0] == "|  | xgrammar | llguidance | outlines-core |"
    rows = 1 + 7 * len(grammar_engines.WORKLOADS) + 4 + 3
    rows += len(grammar_engines.FEATURES) + len(grammar_engines.BAD_SCHEMAS)
    assert len(table) == 2 + rows
    assert (
        "| json_object: valid walk, only EOS at end | yes | yes | no (token 38 refused of 85) |"
        in table
    )
