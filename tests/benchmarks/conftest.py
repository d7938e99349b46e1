"""What several benchmark test modules share: one run of ``make gpu-check``'s smoke.

``python -m loramux.benchmarks.gpu_check --smoke --bundle`` runs, among its sections,
``python -m loramux.benchmarks.kernels_gpu --smoke``: the very command the kernel
benchmark's smoke tests (test_kernels_gpu_smoke.py) check. Both modules read this one run
(test_gpu_check_smoke.py the orchestration and the bundle, test_kernels_gpu_smoke.py the
kernels section's results, unpacked from the bundle), so the Triton interpreter's slow
smoke grid runs once per session rather than twice.
"""

from __future__ import annotations

import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.benchmarks.commands import gpu_check


@dataclass(frozen=True)
class GpuCheckSmoke:
    done: subprocess.CompletedProcess[str]
    out: Path  # what gpu_check wrote: gpu_check.{json,md,log} and the results' bundle
    results: Path  # the bundle's results/ unpacked (outside ``out``; empty without a bundle)


@pytest.fixture(scope="session")
def gpu_check_smoke(tmp_path_factory) -> GpuCheckSmoke:
    out = tmp_path_factory.mktemp("gpu_check_smoke")
    done = gpu_check("--smoke", "--out", str(out), "--bundle")
    unpacked = tmp_path_factory.mktemp("gpu_check_results")
    bundle = out / "gpu_check_results.tar.gz"
    if bundle.is_file():
        with tarfile.open(bundle) as packed:
            packed.extractall(unpacked, filter="data")
    return GpuCheckSmoke(done, out, unpacked / "results")
