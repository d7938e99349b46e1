"""``engine_vs_peft --before REV``: another revision's engine measured beside this one.

The parts that make it trustworthy, on the tiny model: REV's temporary worktree links its
package folders and is removed again even when the run fails, and each engine worker
imports loramux from the tree it was given (and refuses to run otherwise). The whole
benchmark with ``--before`` on SmolLM2 takes a minute or two, so it is a manual check
(README, benchmarks section).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO_ROOT / "benchmarks"
if str(BENCH_DIR) not in sys.path:  # the benchmarks import their siblings top-level
    sys.path.insert(0, str(BENCH_DIR))

import engine_vs_peft as evp  # noqa: E402


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def _worktrees() -> str:
    return _git("worktree", "list", "--porcelain")


def test_the_revisions_worktree_is_linked_as_loramux_and_removed_on_error(tmp_path):
    head = _git("rev-parse", "HEAD")
    with (
        pytest.raises(RuntimeError, match="the run failed"),
        evp.before_checkout("HEAD", tmp_path) as before,
    ):
        tree = before.root
        assert tree.is_dir() and str(tree) in _worktrees()
        assert before.sha == head and before.label == f"before, {head[:7]}"
        package = before.pkg_root / "loramux"
        assert (package / "engine").resolve() == (tree / "engine").resolve()
        assert (package / "kernels").resolve() == (tree / "kernels").resolve()
        raise RuntimeError("the run failed")
    assert not tree.exists()
    assert str(tree) not in _worktrees()


def test_an_unknown_revision_is_refused_before_any_worktree(tmp_path):
    before = _worktrees()
    with (
        pytest.raises(RuntimeError, match="not a commit"),
        evp.before_checkout("no-such-revision-x", tmp_path),
    ):
        pass
    assert _worktrees() == before and not (tmp_path / "tree").exists()


def test_each_worker_runs_the_engine_of_its_own_tree(tmp_path, tiny_model_dir, make_adapter):
    adapters = [
        evp.AdapterSpec(
            name, make_adapter(tiny_model_dir, rank=rank, targets=targets), rank, targets
        )
        for name, rank, targets in (("a0", 8, evp.QKVO), ("a1", 16, evp.ALL_SEVEN))
    ]
    job = {
        "model_dir": str(tiny_model_dir),
        "adapters": [
            {"name": a.name, "path": str(a.path), "rank": a.rank, "targets": list(a.targets)}
            for a in adapters
        ],
        "prompts": [[5, 6, 7, 8, 9], [10, 11, 12]],
        "names": ["a0", "a1"],
        "max_tokens": 4,
        "requests": 2,
        "threads": 1,
    }
    with evp.before_checkout("HEAD", tmp_path) as before:
        after = evp.after_checkout(tmp_path)
        assert after.label == "after" and after.root == evp.REPO_ROOT
        runs = {c.label: evp.run_engine_worker(c, job, tmp_path) for c in (before, after)}
        # A worker handed a tree its loramux does not come from refuses to run.
        stray = evp.Checkout(root=tmp_path / "elsewhere", pkg_root=after.pkg_root, sha=after.sha)
        (tmp_path / "elsewhere").mkdir()
        with pytest.raises(RuntimeError, match="exited 3"):
            evp.run_engine_worker(stray, job, tmp_path)
    old, new = runs[before.label], runs["after"]
    assert Path(old.extra["imported_from"]).is_relative_to(before.root)
    assert Path(new.extra["imported_from"]).is_relative_to(REPO_ROOT / "engine")
    for run in (old, new):
        assert [len(t) for t in run.tokens] == [4, 4]
        assert run.seconds > 0 and run.clock.cpu_seconds > 0
    assert old.label == f"engine (before, {before.sha[:7]})" and new.label == "engine (after)"
    assert str(before.root) not in _worktrees()
