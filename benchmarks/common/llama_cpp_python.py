"""llama.cpp as a peer of the engine: ``llama-cpp-python`` run by an interpreter of its own.

llama.cpp's Python binding need not be installed beside loramux: a study's
``--llama-cpp-python PY`` names any interpreter that imports ``llama_cpp`` (the project's
venv after ``make llama-cpp``, or a venv of its own). The study hands that interpreter a
script that needs only the standard library, numpy and ``llama_cpp``, a job as JSON in a
file (token ids and file paths: no tokenizer on that side) and reads its result back from
another file. Every figure of llama.cpp in ``benchmarks/results/`` comes from
``llama-cpp-python`` 0.3.36 built from source with ``CMAKE_ARGS``: the CPU features this
kind of machine has, fixed rather than detected (``GGML_NATIVE=OFF``), so that the build is
the same on any x86-64 machine with AVX2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "llama-cpp-python==0.3.36"
CMAKE_ARGS = "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
# How to install it: into the project's venv, or by hand into any venv.
INSTALL = f'`make llama-cpp` (in another venv: `CMAKE_ARGS="{CMAKE_ARGS}" pip install {PACKAGE}`)'
# What the interpreter says about its llama.cpp: the binding's version and the CPU
# features its ggml was built with (llama_print_system_info: "AVX2 = 1 | FMA = 1 | ...").
_PROBE = (
    "import json, llama_cpp; print(json.dumps({'version': llama_cpp.__version__, "
    "'system_info': llama_cpp.llama_print_system_info().decode().strip()}))"
)


@dataclass(frozen=True)
class LlamaCpp:
    """An interpreter whose ``import llama_cpp`` works, and what it imports."""

    python: Path
    version: str
    system_info: str  # llama.cpp's build flags as it prints them

    def to_json(self) -> dict:
        return {
            "python": str(self.python),
            "version": self.version,
            "system_info": self.system_info,
        }


def find_llama_cpp(python: Path | None) -> tuple[LlamaCpp | None, str]:
    """llama.cpp through ``python`` (None: this interpreter), or None and why not."""
    python = Path(sys.executable if python is None else python)
    try:
        done = subprocess.run(
            [str(python), "-c", _PROBE], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{python} could not be run ({exc})"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"{python} cannot import llama_cpp ({last})"
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return LlamaCpp(python, found["version"], found["system_info"]), ""


def run_script(python: Path, script: Path, job: dict, workdir: Path, threads: int) -> dict:
    """``python script JOB.json RESULT.json`` with ``OMP_NUM_THREADS`` = ``threads``; the
    result it wrote. A script that fails raises (its stderr is the caller's)."""
    job_path, result_path = workdir / "llama-job.json", workdir / "llama-result.json"
    result_path.unlink(missing_ok=True)
    job_path.write_text(json.dumps(job))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    command = [str(python), str(script), str(job_path), str(result_path)]
    subprocess.run(command, env=env, check=True)
    return json.loads(result_path.read_text())
