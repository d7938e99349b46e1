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
* :class:`ThreadGovernor` follows what other processes leave free: every
  ``GOVERNOR_INTERVAL_S`` it reads how much of this process's cores the rest of the
  machine used (``/proc/stat`` against this process's own CPU time) and sets torch's
  threads to the cores left, never more than the choice above. OpenMP threads that each
  have a core to themselves lose nothing to waiting, so they keep OpenMP's default short
  spin: sleeping at every parallel region's end instead (``OMP_WAIT_POLICY=PASSIVE``) made
  a quiet 12 x 200-token prefill on 2 cores take twice as long (3.74 against 1.89 s),
  while beside a busy process it held the step to 1.2x of quiet; the governor holds it
  there too, and costs a quiet machine nothing (``benchmarks/results/prefill_cpu_hog.md``).
  An operator's ``OMP_WAIT_POLICY`` is kept, and the start-up log says which wait is on.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max ..."
PROC_STAT = Path("/proc/stat")
SELF_STAT = Path("/proc/self/stat")
GOVERNOR_INTERVAL_S = 0.5  # how often the governor reads the machine's load
# A core counts as taken once other processes use this much of it over an interval.
TAKEN_FRACTION = 0.5


@dataclass(frozen=True)
class ThreadChoice:
    threads: int  # torch's intra-op threads now
    available: int  # cores this process may run on
    requested: int | None  # the setting (None: the available cores)
    passive_wait: bool  # OpenMP threads sleep while they wait, instead of spinning
    governed: bool = False  # fewer while other processes take cores (ThreadGovernor)

    def describe(self) -> str:
        how = "the setting" if self.requested is not None else "by default"
        wait = "OpenMP waits passively" if self.passive_wait else "OpenMP's default wait"
        if self.governed:
            follows = ", fewer while other processes take cores"
        elif self.threads > 1:
            follows = " (fixed: a busy neighbour process can slow steps several-fold)"
        else:
            follows = ""
        return (
            f"Compute threads: {self.threads}{follows} ({how}; {self.available} core(s) "
            f"available to this process); {wait}"
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


class ThreadGovernor:
    """torch's threads, kept to the cores other processes leave this one (call ``adjust``
    between steps; it reads the load at most every ``interval_s``).

    Over an interval, others' use of this process's cores is the busy time ``/proc/stat``
    counts on them less this process's own CPU time (``/proc/self/stat``); each core they
    used at least ``TAKEN_FRACTION`` of is taken. The threads are the cores left, at least
    one and at most ``max_threads``. Only Linux has these files: elsewhere it does nothing.
    """

    def __init__(
        self,
        max_threads: int,
        *,
        interval_s: float = GOVERNOR_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        proc_stat: Path = PROC_STAT,
        self_stat: Path = SELF_STAT,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        cpus: set[int] | None = None,  # default: this process's CPU affinity
    ):
        self.max_threads = max_threads
        self.threads = max_threads
        self.interval_s = interval_s
        self._clock = clock
        self._proc_stat, self._self_stat = proc_stat, self_stat
        self._set_threads = set_threads
        self._cpus = _allowed_cpus() if cpus is None else cpus
        self._last = self._sample()
        self._last_at = clock()
        self.changes = 0  # how often it changed the threads

    @property
    def enabled(self) -> bool:
        return self.max_threads > 1 and self._last is not None

    def adjust(self) -> int:
        """The threads now, changed if the interval has passed and the load says so."""
        if not self.enabled or self._clock() - self._last_at < self.interval_s:
            return self.threads
        sample, now = self._sample(), self._clock()
        if sample is None:
            return self.threads
        (busy, own), (last_busy, last_own) = sample, self._last
        elapsed = now - self._last_at
        self._last, self._last_at = sample, now
        others = max(0.0, (busy - last_busy) - (own - last_own)) / max(elapsed, 1e-9)
        taken = int(others + (1 - TAKEN_FRACTION))  # cores others used enough of
        threads = max(1, min(self.max_threads, len(self._cpus) - taken))
        if threads != self.threads:
            self.threads = threads
            self.changes += 1
            self._set_threads(threads)
        return self.threads

    def _sample(self) -> tuple[float, float] | None:
        """(busy seconds on this process's cores since boot, this process's CPU seconds)."""
        try:
            busy = _busy_seconds(self._proc_stat.read_text(), self._cpus)
            fields = self._self_stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        return busy, (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def _allowed_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _busy_seconds(stat: str, cpus: set[int]) -> float:
    """Seconds the CPUs ``cpus`` were busy since boot, from ``/proc/stat``'s ``cpuN`` lines
    (all but idle and iowait)."""
    ticks = os.sysconf("SC_CLK_TCK")
    busy = 0
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        # user nice system idle iowait irq softirq steal (guest time is in user already)
        values = [int(v) for v in rest.split()[:8]]
        busy += sum(values) - values[3] - values[4]
    return busy / ticks
