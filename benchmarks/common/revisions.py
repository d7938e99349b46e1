"""Another git revision's engine measured beside this checkout's (``--before REV``).

REV is checked out into a temporary ``git worktree`` (removed again on the way out, also
when the run fails or gets SIGTERM). Each engine run, before and after alike, is a worker
process (``python -m loramux.benchmarks.common.revisions JOB.json RESULT.json``) whose
``PYTHONPATH`` starts with a folder whose ``loramux/`` links the tree's package folders as
its ``pyproject.toml``'s ``package-dir`` maps them; the worker checks that
``loramux.engine`` and ``loramux.kernels`` came from that tree (exit 3 otherwise), then
runs the job's ``runner`` module's ``run_job`` (``engine_vs_peft``'s by default). The
benchmarks are not linked: both engines are measured by this install's
``loramux.benchmarks``. "After" is this working tree, uncommitted changes included
(``modified`` says whether ``engine/`` or ``kernels/`` had any).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loramux.benchmarks.common.files import CHECKOUT, write_atomic

NO_CHECKOUT = "--before needs the source checkout (a git repository); this loramux is installed"


@dataclass(frozen=True)
class Checkout:
    """A source tree whose engine a worker runs: ``pkg_root`` holds a ``loramux/`` that
    links the tree's package folders, to put first on the worker's PYTHONPATH."""

    root: Path
    pkg_root: Path
    sha: str
    rev: str | None = None  # as given to --before; None for this checkout (after)
    modified: bool = False  # engine/ or kernels/ differ from ``sha`` (uncommitted changes)

    @property
    def label(self) -> str:
        return "after" if self.rev is None else f"before, {self.sha[:7]}"


def _git(*args: str) -> str:
    if CHECKOUT is None:
        raise RuntimeError(NO_CHECKOUT)
    done = subprocess.run(["git", *args], cwd=CHECKOUT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def resolve_commit(rev: str) -> str:
    """The full sha of commit ``rev``; a RuntimeError naming it when there is none."""
    if CHECKOUT is None:
        raise RuntimeError(NO_CHECKOUT)
    try:
        return _git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except RuntimeError:
        raise RuntimeError(f"--before {rev!r} is not a commit of this repository") from None


def link_package(tree: Path, dest: Path) -> Path:
    """``dest/loramux/<name>`` -> each folder ``tree``'s pyproject maps ``loramux.<name>``
    to, but the benchmarks (always this install's); ``dest``, for the worker's PYTHONPATH."""
    pyproject = tomllib.loads((tree / "pyproject.toml").read_text())
    mapping = pyproject["tool"]["setuptools"]["package-dir"]
    package = dest / "loramux"
    package.mkdir(parents=True)
    for name, folder in mapping.items():
        top, _, sub = name.partition(".")
        linked = top == "loramux" and sub not in ("", "benchmarks") and "." not in sub
        if linked and (tree / folder).is_dir():
            (package / sub).symlink_to((tree / folder).resolve(), target_is_directory=True)
    if not (package / "engine").is_dir():
        raise RuntimeError(f"{tree}'s pyproject maps no loramux.engine folder")
    return dest


def after_checkout(workdir: Path) -> Checkout:
    """This working tree, as the after engine's source."""
    assert CHECKOUT is not None  # resolve_commit ran first
    return Checkout(
        root=CHECKOUT,
        pkg_root=link_package(CHECKOUT, workdir / "after"),
        sha=_git("rev-parse", "HEAD"),
        modified=bool(_git("status", "--porcelain", "--", "engine", "kernels")),
    )


@contextlib.contextmanager
def before_checkout(rev: str, workdir: Path) -> Iterator[Checkout]:
    """Revision ``rev`` in a temporary ``git worktree`` under ``workdir``, removed on exit."""
    sha = resolve_commit(rev)
    tree = workdir / "tree"
    _git("worktree", "add", "--detach", "--quiet", str(tree), sha)
    try:
        yield Checkout(root=tree, pkg_root=link_package(tree, workdir / "before"), sha=sha, rev=rev)
    finally:
        try:
            _git("worktree", "remove", "--force", str(tree))
        except RuntimeError as exc:
            print(f"{exc}; deleting {tree} and pruning", file=sys.stderr)
            shutil.rmtree(tree, ignore_errors=True)
            _git("worktree", "prune")


@contextlib.contextmanager
def before_and_after(rev: str) -> Iterator[tuple[Checkout, Checkout, Path]]:
    """(after, before, a scratch folder for the workers' files), cleaned up on the way out;
    SIGTERM is turned into an exit so that the worktree goes on a kill too."""

    def terminate(signum, frame) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)  # main thread only, as main() runs
    try:
        with tempfile.TemporaryDirectory(prefix="loramux-before-") as tmp:
            workdir = Path(tmp)
            with before_checkout(rev, workdir) as before:
                yield after_checkout(workdir), before, workdir
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_in_worker(checkout: Checkout, job: dict, workdir: Path) -> dict:
    """The worker's result for ``job``, run on ``checkout``'s loramux."""
    job_path, result_path = workdir / "job.json", workdir / "result.json"
    result_path.unlink(missing_ok=True)
    write_atomic(job_path, json.dumps({**job, "expect_root": str(checkout.root.resolve())}))
    paths = [str(checkout.pkg_root), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    command = [sys.executable, "-m", __name__, str(job_path), str(result_path)]
    done = subprocess.run(command, env=env, cwd=workdir, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {checkout.label} engine's worker exited {done.returncode}")
    return json.loads(result_path.read_text())


def imported_from() -> dict[str, str]:
    import loramux.engine
    import loramux.kernels

    return {
        name: str(Path(m.__file__).resolve())
        for name, m in (("loramux.engine", loramux.engine), ("loramux.kernels", loramux.kernels))
    }


def worker(job_path: Path, result_path: Path) -> int:
    """One engine run of the job in this process, which must import the job's tree's loramux."""
    job = json.loads(job_path.read_text())
    expect = Path(job["expect_root"]).resolve()
    files = imported_from()  # before anything of the benchmarks imports the engine
    print(f"worker: loramux.engine from {files['loramux.engine']}", flush=True)
    stray = {name: f for name, f in files.items() if not Path(f).is_relative_to(expect)}
    if stray:
        print(f"worker: expected loramux from {expect}, got {stray}", file=sys.stderr)
        return 3
    module = importlib.import_module(job.get("runner", "loramux.benchmarks.engine_vs_peft.runner"))
    write_atomic(result_path, json.dumps({**module.run_job(job), "imported_from": files}))
    return 0


if __name__ == "__main__":
    sys.exit(worker(*(Path(a) for a in sys.argv[1:])))
