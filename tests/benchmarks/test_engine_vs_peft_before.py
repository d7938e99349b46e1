"""``loramux bench engine-vs-peft --before REV``: another revision's engine beside this one.

The parts that make it trustworthy, on the tiny model: REV's temporary worktree links its
package folders (not its benchmarks: both engines are measured by this install's) and is
removed again even when the run fails, and each engine worker imports loramux's engine
from the tree it was given (and refuses to run otherwise).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from loramux.benchmarks.common import revisions
from loramux.benchmarks.common.files import CHECKOUT
from loramux.benchmarks.engine_vs_peft import runner as engine_vs_peft


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=CHECKOUT, capture_output=True, text=True, check=True
    ).stdout.strip()


def _worktrees() -> str:
    return _git("worktree", "list", "--porcelain")


def test_the_revisions_worktree_is_linked_as_loramux_and_removed_on_error(tmp_path):
    head = _git("rev-parse", "HEAD")
    with (
        pytest.raises(RuntimeError, match="the run failed"),
        revisions.before_checkout("HEAD", tmp_path) as before,
    ):
        tree = before.root
        assert tree.is_dir() and str(tree) in _worktrees()
        assert before.sha == head and before.label == f"before, {head[:7]}"
        package = before.pkg_root / "loramux"
        assert (package / "engine").resolve() == (tree / "engine").resolve()
        assert (package / "kernels").resolve() == (tree / "kernels").resolve()
        assert not (package / "benchmarks").exists()
        raise RuntimeError("the run failed")
    assert not tree.exists()
    assert str(tree) not in _worktrees()


def test_an_unknown_revision_is_refused_before_any_worktree(tmp_path):
    before = _worktrees()
    with (
        pytest.raises(RuntimeError, match="not a commit"),
        revisions.before_checkout("no-such-revision-x", tmp_path),
    ):
        pass
    assert _worktrees() == before and not (tmp_path / "tree").exists()


def test_each_worker_runs_the_engine_of_its_own_tree(tmp_path, tiny_model_dir):
    argv = ["--requests", "2", "--adapters", "2", "--max-tokens", "4"]
    argv += ["--model", str(tiny_model_dir), "--cache-dir", str(tmp_path / "cache")]
    argv += ["--out", str(tmp_path / "out")]
    with revisions.before_checkout("HEAD", tmp_path) as before:
        after = revisions.after_checkout(tmp_path)
        assert after.label == "after" and after.root == CHECKOUT
        runs = {c.label: engine_vs_peft.serve_in_worker(c, argv, tmp_path) for c in (before, after)}
        # A worker handed a tree its loramux does not come from refuses to run.
        stray = revisions.Checkout(root=tmp_path / "elsewhere", pkg_root=after.pkg_root, sha="x")
        (tmp_path / "elsewhere").mkdir()
        with pytest.raises(RuntimeError, match="exited 3"):
            revisions.run_in_worker(stray, {"argv": argv, "threads": 1}, tmp_path)
    old, new = runs[before.label], runs["after"]
    assert Path(old.extra["imported_from"]).is_relative_to(before.root)
    assert Path(new.extra["imported_from"]).is_relative_to(CHECKOUT / "engine")
    for run in (old, new):
        assert {i: len(t) for i, t in run.tokens.items()} == {0: 4, 1: 4}
        assert run.seconds > 0 and run.clock.cpu_seconds > 0
    assert old.label == f"engine (before, {before.sha[:7]})" and new.label == "engine (after)"
    assert str(before.root) not in _worktrees()
