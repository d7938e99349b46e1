"""The one runner shape (``common/study.py``, ``loramux bench``) and the one report writer
(``common/report.py``) that every benchmark study goes through."""

from __future__ import annotations

import argparse
import json
import pkgutil
import sys
import types

import pytest

import loramux.benchmarks
from loramux.benchmarks import bench
from loramux.benchmarks.common.files import check_sized
from loramux.benchmarks.common.report import Markdown, ms, num, pct, table_lines, write
from loramux.benchmarks.common.study import Study
from loramux.benchmarks.serve.presets import PRESETS


def test_every_study_package_and_every_preset_is_a_loramux_bench_name():
    packages = {
        m.name
        for m in pkgutil.iter_modules(loramux.benchmarks.__path__)
        if m.ispkg and m.name != "common"
    }
    assert {study.runner.split(".")[2] for study in bench.STUDIES.values()} == packages
    assert set(PRESETS) <= set(bench.STUDIES)
    for name, study in bench.STUDIES.items():
        module = study.module()
        assert study.name == name and study.summary
        assert callable(module.add_options) and callable(module.run)
        assert study.parser().prog == f"loramux bench {name}"


def test_the_command_lists_the_studies_and_refuses_an_unknown_one(capsys):
    assert bench.main(["-h"]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {name} " in listed for name in bench.STUDIES)
    assert bench.main(["no-such-study"]) == 2
    assert "no study named 'no-such-study'" in capsys.readouterr().err
    assert bench.main([]) == 2


def _toy_study(ran: list, monkeypatch) -> Study:
    """A study whose runner is a module made here."""
    runner = types.ModuleType("toy_runner", "A toy study.\n\nIts details.")

    def add_options(parser):
        parser.add_argument("--size", type=int, default=3)
        parser.add_argument("--label")

    def check(parser, args):
        if args.size < 1:
            parser.error("--size must be positive")

    def run(args):
        ran.append(args)
        return 7

    runner.add_options, runner.check, runner.run = add_options, check, run
    monkeypatch.setitem(sys.modules, "toy_runner", runner)
    return Study("toy", "a toy study", "toy_runner", {"flavour": "plain"})


def test_a_study_parses_checks_and_runs_with_its_command_line(monkeypatch):
    ran = []
    study = _toy_study(ran, monkeypatch)
    assert study.parser().description == "A toy study."
    assert study.main(["--size", "5", "--label", "two words"]) == 7
    args = ran[0]
    assert (
        args.size == 5
        and args.flavour == "plain"
        and args.argv == ["--size", "5", "--label", "two words"]
    )
    assert args.command_line == "loramux bench toy --size 5 --label 'two words'"
    with pytest.raises(SystemExit) as refused:
        study.parse(["--size", "0"])
    assert refused.value.code == 2 and not ran[1:]


def test_formatters_say_missing_values_with_a_dash():
    assert num(1234.567) == "1,234.6" and num(None) == "–"
    assert ms(0.0123) == "12" and ms(None) == "–"
    assert pct(0.257) == "26%" and pct(None) == "–"


def test_tables_align_names_left_and_numbers_right_unless_told():
    assert table_lines(("a", "b", "c"), [(1, 2, 3)]) == [
        "| a | b | c |",
        "|---|---:|---:|",
        "| 1 | 2 | 3 |",
    ]
    assert table_lines(("a", "b"), [], "rl")[1] == "|---:|---|"


def test_the_writer_renders_parts_in_order_and_writes_both_files(tmp_path, capsys):
    judged = [
        {
            "metric": "x",
            "relation": "≥",
            "value": 2.0,
            "measured": 2.5,
            "verdict": "met",
            "why": "w",
        }
    ]
    doc = (
        Markdown("T")
        .text("para", None, "")
        .table(("k", "v"), [("a", 1)])
        .goals(judged)
        .bullets(["b1"])
        .plots([tmp_path / "p.png"])
        .command("loramux bench t")
    )
    write(tmp_path / "r", {"figure": 1.5}, doc)
    text = (tmp_path / "r.md").read_text()
    assert text.startswith("# T\n\npara\n\n| k | v |")
    assert "| x ≥ 2 | 2.500 | **met** | w |" in text
    assert "- b1" in text and "![p](p.png)" in text
    assert text.endswith("Command: `loramux bench t`\n")
    assert json.loads((tmp_path / "r.json").read_text()) == {"figure": 1.5}
    assert capsys.readouterr().out.strip() == text.strip()
    assert not list(tmp_path.glob("*.tmp"))
    assert "Plots: none" in Markdown("U").plots([]).render()


def test_sized_options_take_the_runs_size_and_must_be_positive(tmp_path, capsys):
    sizes = {"full": {"count": 8, "widths": [1, 4]}, "smoke": {"count": 2, "widths": [1]}}
    parser = argparse.ArgumentParser()
    for name in ("--count", "--threads"):
        parser.add_argument(name, type=int)
    parser.add_argument("--widths", type=int, nargs="+")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=tmp_path)
    args = parser.parse_args(["--smoke"])
    check_sized(parser, args, sizes, ("count", "widths", "threads"))
    assert (args.count, args.widths, args.threads) == (2, [1], None)
    with pytest.raises(SystemExit):
        check_sized(
            parser,
            parser.parse_args(["--count", "0", "--widths", "3", "-1"]),
            sizes,
            ("count", "widths"),
        )
    assert "--count, --widths must be positive" in capsys.readouterr().err
