"""The ``loramux`` command and ``make gpu-check`` as the benchmark tests run them: a
subprocess from the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def loramux(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``loramux ARGS``; two torch threads unless the environment says otherwise."""
    command = [sys.executable, "-m", "loramux.platform.cli", *args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    return subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def gpu_check(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m loramux.benchmarks.gpu_check ARGV`` (``make gpu-check``)."""
    return subprocess.run(
        [sys.executable, "-m", "loramux.benchmarks.gpu_check", *argv],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
