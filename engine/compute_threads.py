"""The engine's CPU threads: as many as the machine actually gives this process.

``os.cpu_count()`` is the host's cores, not this process's: a container limited by a CPU
quota, or a process pinned to some cores (``taskset``, Kubernetes' CPU manager), runs
fewer. torch would start one OpenMP thread per host core, and OpenMP threads that outnumber
the cores they can run on, or that share them with another busy process, wait for each
other at every parallel region's end. With libgomp's default, an active wait (spinning), a
waiting thread burns the time slice the late one needs: beside another process busy on one
of two cores, a 12-request prefill took 67 s with 2 threads and 8.7 s with 1. So:

* :func:`available_cores` counts what the process may use: its CPU affinity, capped by its
  cgroup's quota;
* :func:`apply_compute_threads` sets torch's intra-op threads to the engine's setting, or
  else to ``OMP_NUM_THREADS`` where the environment has it, or else to that count, and says
  what it chose and whether OpenMP waits passively;
* OpenMP's wait policy is read once, when the runtime loads with torch, so it is set in the
  environment before (``OMP_WAIT_POLICY=PASSIVE``, by the ``loramux`` command:
  ``platform/process_env.py``); a process that imported torch itself keeps its own, and
  the start-up log says which it has.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max ..."


@dataclass(frozen=True)
class ThreadChoice:
    threads: int  # torch's intra-op threads now
    available: int  # cores this process may run on
    requested: int | None  # the setting (None: the available cores)
    passive_wait: bool  # OpenMP threads sleep while they wait, instead of spinning

    def describe(self) -> str:
        how = "the setting" if self.requested is not None else "by default"
        wait = (
            "OpenMP waits passively"
            if self.passive_wait
            else "OpenMP threads spin while they wait (OMP_WAIT_POLICY is not PASSIVE: a busy "
            "neighbour process can slow steps several-fold; set it before the process starts)"
        )
        return (
            f"Compute threads: {self.threads} ({how}; {self.available} core(s) available to "
            f"this process); {wait}"
        )


def available_cores(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """Cores this process may run on: its CPU affinity, capped by its cgroup's CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_quota(cpu_max)
    if quota is not None:
        cores = min(cores, quota)
    return max(1, cores)


def _cgroup_quota(cpu_max: Path) -> int | None:
    """The cgroup's CPU quota in whole cores (rounded up), or None without one."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(1, math.ceil(int(quota) / int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def passive_wait() -> bool:
    """Whether OpenMP's threads were told to sleep while they wait (read at torch's load)."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


def default_compute_threads(*, shares_process: bool = False) -> int:
    """``OMP_NUM_THREADS`` where the environment sets it; else the available cores, less
    :func:`platform_reserve` of them for an engine in the platform's process."""
    cores = available_cores()
    reserve = platform_reserve(cores) if shares_process else 0
    return _omp_num_threads() or max(1, cores - reserve)


def platform_reserve(cores: int) -> int:
    """Cores an engine in the platform's process leaves to the platform (event loop,
    tokenizer, database): an eighth, none below 8. On a small machine the engine's threads
    wait passively, so the platform's bursts cost a step little, where keeping one core of
    two from the engine would halve its prefill for good."""
    return cores // 8


def apply_compute_threads(requested: int | None) -> ThreadChoice:
    """Set torch's intra-op threads to ``requested``, or to :func:`default_compute_threads`."""
    threads = requested if requested is not None else default_compute_threads()
    torch.set_num_threads(threads)
    return ThreadChoice(torch.get_num_threads(), available_cores(), requested, passive_wait())


def _omp_num_threads() -> int | None:
    try:
        value = int(os.environ.get("OMP_NUM_THREADS", "").split(",")[0])
    except ValueError:
        return None
    return value if value > 0 else None
