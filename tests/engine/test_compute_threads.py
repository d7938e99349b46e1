"""The engine's CPU threads: the cores the process may use (affinity, cgroup quota), the
setting that overrides them, OMP_NUM_THREADS, and what the start-up log says."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from loramux.engine.compute_threads import (
    available_cores,
    default_compute_threads,
    platform_reserve,
)
from tests.engine.factories import build_engine


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_cgroup_quota_caps_the_cores(tmp_path):
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("max 100000\n")
    unlimited = available_cores(cpu_max)
    assert unlimited == len(os.sched_getaffinity(0))
    cpu_max.write_text("50000 100000\n")  # half a core: one thread, not none
    assert available_cores(cpu_max) == 1
    cpu_max.write_text("not a quota\n")
    assert available_cores(cpu_max) == unlimited
    assert available_cores(tmp_path / "missing") == unlimited


def test_a_process_pinned_to_one_core_defaults_to_one_thread():
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))});"
        "from loramux.engine.compute_threads import apply_compute_threads;"
        "print(apply_compute_threads(None).threads)"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "1"


def test_omp_num_threads_and_the_platform_reserve_shape_the_default(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert default_compute_threads(shares_process=True) == 1
    monkeypatch.delenv("OMP_NUM_THREADS")
    cores = available_cores()
    assert default_compute_threads() == cores
    assert default_compute_threads(shares_process=True) == max(1, cores - cores // 8)
    assert [platform_reserve(c) for c in (1, 2, 7, 8, 16, 64)] == [0, 0, 0, 1, 2, 8]


def test_the_engine_sets_its_threads_and_logs_the_choice(
    tiny_model_dir, caplog, restore_threads, monkeypatch
):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    torch.set_num_threads(2)
    with caplog.at_level(logging.INFO, logger="loramux.engine.engine"):
        engine = build_engine(tiny_model_dir, compute_threads=1)
    assert torch.get_num_threads() == 1
    assert engine.threads.threads == 1 and engine.threads.requested == 1
    lines = [r.getMessage() for r in caplog.records if "Compute threads" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    assert lines[0].startswith("Compute threads: 1 (the setting;")
    assert "spin" in lines[0] and "OMP_WAIT_POLICY" in lines[0]  # this process never set it


def test_the_loramux_command_makes_openmp_wait_passively():
    # Set before torch loads (it reads the policy once), and inherited by what it starts.
    code = (
        "import os, sys; from loramux.platform.process_env import prefer_passive_openmp;"
        "print(prefer_passive_openmp(), os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["True", "PASSIVE", "False"]
    env["OMP_WAIT_POLICY"] = "active"  # the operator's choice stays
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "active", "False"]
