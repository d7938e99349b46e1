"""Shared test set-up: fixtures from tests/fixtures, and the CI rule that a skip fails.

Under ``CI=true`` the suite must not go green by skipping: a test that skips for any
reason other than needing what CI machines do not have (a GPU; llama.cpp's Python binding,
which ``make llama-cpp`` builds for the llama.cpp benchmarks) is reported as a failure.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.fixtures.ci import _in_ci
from tests.fixtures.engine_budget import set_test_budget

# Markers of tests that may skip under CI: they need what CI machines lack.
ALLOWED_SKIPS = frozenset({"gpu", "llama_cpp"})

pytest_plugins = [
    "tests.fixtures.triton_interpreter",  # first: before any test module imports a kernel
    "tests.fixtures.services",
    "tests.fixtures.models",
    "tests.fixtures.browser",
]


def pytest_configure(config):
    # Engines the tests start keep a small explicit budget (not one sized to the machine).
    set_test_budget()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # `make test`'s two workers share the machine's two cores: one torch thread each,
        # and in the processes they start. Two threads each, OpenMP's waiting threads of
        # one worker took the cores from the other (a file of engine tests ran 3x slower).
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _in_ci() and not ALLOWED_SKIPS.intersection(item.keywords):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"skipped under CI=true (skips count as failures): {reason}"
