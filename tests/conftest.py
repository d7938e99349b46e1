"""Shared test set-up: fixtures from tests/fixtures, and the CI rule that a skip fails.

Under ``CI=true`` the suite must not go green by skipping: a test that skips for any
reason other than needing a GPU is reported as a failure.
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.ci import _in_ci
from tests.fixtures.engine_budget import set_test_budget

pytest_plugins = [
    "tests.fixtures.triton_interpreter",  # first: before any test module imports a kernel
    "tests.fixtures.services",
    "tests.fixtures.models",
    "tests.fixtures.browser",
]


def pytest_configure(config):
    # Engines the tests start keep a small explicit budget (not one sized to the machine).
    set_test_budget()


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
    if report.skipped and _in_ci() and "gpu" not in item.keywords:
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"skipped under CI=true (skips count as failures): {reason}"
