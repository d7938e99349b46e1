"""The engine's CPU threads: the cores the process may use (affinity, cgroup quota), the
setting that overrides them, OMP_NUM_THREADS, and what the start-up log says."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from loramux.engine import SamplingParams
from loramux.engine.compute_threads import (
    ThreadGovernor,
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
    assert "OpenMP's default wait" in lines[0]


class FakeMachine:
    """``/proc/stat`` and ``/proc/self/stat`` as files, and a clock, that a test advances:
    each ``tick`` the process uses ``own`` core-seconds and other processes ``others``."""

    TICKS = os.sysconf("SC_CLK_TCK")

    def __init__(self, tmp_path, cpus):
        self.cpus, self.now, self.busy, self.own = sorted(cpus), 0.0, 0.0, 0.0
        self.proc_stat, self.self_stat = tmp_path / "stat", tmp_path / "self_stat"
        self._write()

    def tick(self, seconds: float, own: float, others: float) -> None:
        self.now += seconds
        self.own += own * seconds
        self.busy += (own + others) * seconds
        self._write()

    def _write(self) -> None:
        per_cpu = int(self.busy * self.TICKS / len(self.cpus))
        lines = ["cpu  0 0 0 0 0 0 0 0 0 0"] + [
            f"cpu{c} {per_cpu} 0 0 1000000 0 0 0 0 0 0" for c in self.cpus
        ]
        self.proc_stat.write_text("\n".join(lines) + "\n")
        own = int(self.own * self.TICKS)
        self.self_stat.write_text(f"42 (python (x)) S {' '.join(['0'] * 10)} {own} 0 0 0\n")


def test_the_governor_leaves_the_cores_other_processes_take(tmp_path):
    machine = FakeMachine(tmp_path, {0, 1})
    applied = []
    governor = ThreadGovernor(
        2,
        clock=lambda: machine.now,
        proc_stat=machine.proc_stat,
        self_stat=machine.self_stat,
        set_threads=applied.append,
        cpus={0, 1},
    )
    assert governor.enabled and governor.adjust() == 2
    machine.tick(0.6, own=2.0, others=0.1)  # quiet: both threads busy, a sliver of others
    assert governor.adjust() == 2 and applied == []
    machine.tick(0.6, own=1.0, others=1.0)  # a neighbour spins on one core
    assert governor.adjust() == 1 and applied == [1]
    machine.tick(0.2, own=1.0, others=0.0)  # read at most every interval
    assert governor.adjust() == 1
    machine.tick(0.6, own=1.0, others=0.2)  # it went: both cores again
    assert governor.adjust() == 2 and applied == [1, 2]
    machine.tick(0.6, own=0.0, others=5.0)  # never below one thread
    assert governor.adjust() == 1


def test_the_engine_on_the_cpu_is_governed_unless_it_has_one_thread(
    tiny_model_dir, restore_threads
):
    one = build_engine(tiny_model_dir, compute_threads=1)
    assert one.governor is not None and not one.governor.enabled
    assert not one.threads.governed and "fewer" not in one.threads.describe()
    two = build_engine(tiny_model_dir, compute_threads=2)
    assert two.governor.enabled and two.threads.governed
    assert "fewer while other processes take cores" in two.threads.describe()
    two.generate(["Hello"], SamplingParams(max_tokens=2))  # adjusts between steps
