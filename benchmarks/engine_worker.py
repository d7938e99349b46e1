"""One timed engine run of ``loramux bench engine-vs-peft --before``, in a process of its own.

    python -m loramux.benchmarks.engine_worker JOB.json RESULT.json

Started by ``revisions.run_in_worker`` with ``PYTHONPATH`` leading to a checkout's
``loramux/`` (a worktree of the before revision, or this checkout for the after engine).
The job names the tree loramux must come from (``expect_root``); the worker exits 3 when
``loramux.engine`` or ``loramux.kernels`` was imported from anywhere else. The run itself
is ``engine_vs_peft.serve_engine``, the same code as without ``--before``; the result
holds the greedy tokens per request, the clock, the run's figures and the files the
engine was imported from.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def imported_from() -> dict[str, str]:
    import loramux.engine
    import loramux.kernels

    return {
        "loramux.engine": str(Path(loramux.engine.__file__).resolve()),
        "loramux.kernels": str(Path(loramux.kernels.__file__).resolve()),
    }


def main(argv: list[str]) -> int:
    job_path, result_path = (Path(a) for a in argv)
    job = json.loads(job_path.read_text())
    expect = Path(job["expect_root"]).resolve()
    files = imported_from()  # before anything of the benchmarks imports the engine
    print(f"worker: loramux.engine from {files['loramux.engine']}", flush=True)
    stray = {name: f for name, f in files.items() if not Path(f).is_relative_to(expect)}
    if stray:
        print(f"worker: expected loramux from {expect}, got {stray}", file=sys.stderr)
        return 3
    from loramux.benchmarks.engine_vs_peft import run_job
    from loramux.benchmarks.files import write_atomic

    result = {**run_job(job), "imported_from": files}
    write_atomic(result_path, json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
