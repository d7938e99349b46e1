"""One timed engine run of ``engine_vs_peft``, in a process of its own (``--before``).

    python benchmarks/engine_vs_peft_worker.py JOB.json RESULT.json

``engine_vs_peft --before REV`` starts this once per run and engine with ``PYTHONPATH``
pointing at a folder whose ``loramux/`` links a checkout's ``engine/``, ``kernels/``, ...
(a temporary ``git worktree`` of REV, or this checkout for the *after* engine), so
``import loramux`` here is that checkout's, not the editable install's. The job names the
checkout it must come from (``expect_root``); the worker refuses to run (exit 3) when
``loramux.engine`` or ``loramux.kernels`` was imported from anywhere else.

The measurement is ``engine_vs_peft``'s own (``build_engine``, ``run_engine``: a warm-up,
then every request at once under ``Clock``), so both engines are timed by the same code;
only the imported engine differs. The result holds the greedy tokens per request, the
clock and the run's extra figures, and the files the engine was imported from.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import engine_vs_peft as bench
import torch


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
    files = imported_from()
    print(f"worker: loramux.engine from {files['loramux.engine']}", flush=True)
    stray = {name: f for name, f in files.items() if not Path(f).is_relative_to(expect)}
    if stray:
        print(f"worker: expected loramux from {expect}, got {stray}", file=sys.stderr)
        return 3
    torch.set_num_threads(job["threads"])
    adapters = [
        bench.AdapterSpec(a["name"], Path(a["path"]), a["rank"], tuple(a["targets"]))
        for a in job["adapters"]
    ]
    engine = bench.build_engine(Path(job["model_dir"]), adapters, job["requests"])
    run = bench.run_engine(engine, job["prompts"], job["names"], job["max_tokens"])
    result = {
        "tokens": run.tokens,
        "clock": run.clock.to_json(),
        "batch": run.batch,
        "extra": run.extra,
        "imported_from": files,
        "torch_threads": torch.get_num_threads(),
    }
    bench.write_atomic(result_path, json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
