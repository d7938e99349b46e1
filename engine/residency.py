"""When memory, not compute, limits the engine: residency counts, their recent rates, and a
warning when adapters thrash.

Four things happen when the KV + adapter budget is too small for the work: running
requests are preempted (their KV recomputed later), idle adapters are evicted from the
device, evicted adapters are loaded again (a *re-load*: the same adapter back on the device
after an eviction), and waiting requests sit out steps because their adapter finds no device
room. The engine counts each (Prometheus counters in ``metrics.py``, since the process
started); :class:`ResidencyWatch` keeps their recent history so ``Engine.stats()`` can say
how many happened in the last minute, and logs a warning, at most once a minute, while
re-loads run at ``THRASH_RELOADS_PER_MIN`` or more.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

WINDOW_S = 60.0  # rates are counts over the last minute
# Re-loads in the last minute from which adapters are said to thrash: one every two seconds,
# sustained. A re-load is an adapter the device had and gave up; at this rate the working set
# of adapters does not fit beside the KV cache.
THRASH_RELOADS_PER_MIN = 30
WARN_EVERY_S = 60.0


class ResidencyCounts(NamedTuple):
    """Cumulative counts since the engine started."""

    preemptions: int = 0
    adapter_evictions: int = 0  # adapters evicted from the device
    adapter_reloads: int = 0  # device loads of adapters evicted before
    adapter_room_wait_steps: int = 0  # steps in which a request waited for adapter room


@dataclass(frozen=True)
class ResidencyStats:
    """``EngineStats.residency``: cumulative counts and the same over the last ``window_s``
    seconds (since the start, for a younger engine), as counts per minute."""

    preemptions: int = 0
    adapter_evictions: int = 0
    adapter_reloads: int = 0
    adapter_room_wait_steps: int = 0
    preemptions_per_min: float = 0.0
    adapter_evictions_per_min: float = 0.0
    adapter_reloads_per_min: float = 0.0
    adapter_room_wait_steps_per_min: float = 0.0
    window_s: float = WINDOW_S
    # Re-loads per minute at or over the thrash threshold: memory, not compute, is the limit.
    thrashing: bool = False


class ResidencyWatch:
    """The counts' recent history (to the second) and the thrash warning."""

    def __init__(
        self,
        *,
        advice: str,
        log: logging.Logger,
        window_s: float = WINDOW_S,
        thrash_reloads_per_min: float = THRASH_RELOADS_PER_MIN,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.window_s = window_s
        self.thrash_reloads_per_min = thrash_reloads_per_min
        self._advice = advice  # what the warning says to do
        self._log = log
        self._clock = clock
        # (time, counts): the counts as they stood then. The first entry is the newest one at
        # or before the window's start (or the engine's start, all zeros).
        self._history: deque[tuple[float, ResidencyCounts]] = deque([(clock(), ResidencyCounts())])
        self._last_warning: float | None = None
        self.warnings = 0

    def observe(self, counts: ResidencyCounts) -> None:
        """Record the counts after a step; warn if adapters thrash."""
        now = self._clock()
        self._record(now, counts)
        stats = self._stats(now, counts)
        if stats.thrashing and (
            self._last_warning is None or now - self._last_warning >= WARN_EVERY_S
        ):
            self._last_warning = now
            self.warnings += 1
            self._log.warning(
                "adapters are thrashing: per minute over the last %.0f s, %.0f adapter "
                "re-loads (adapters evicted from the device and loaded again), %.0f device "
                "evictions, %.0f steps in which a request waited for adapter room, %.0f "
                "preemptions; device memory, not compute, limits this engine: %s",
                self.window_s,
                stats.adapter_reloads_per_min,
                stats.adapter_evictions_per_min,
                stats.adapter_room_wait_steps_per_min,
                stats.preemptions_per_min,
                self._advice,
            )

    def stats(self, counts: ResidencyCounts) -> ResidencyStats:
        now = self._clock()
        self._record(now, counts)
        return self._stats(now, counts)

    def _record(self, now: float, counts: ResidencyCounts) -> None:
        last_time, last = self._history[-1]
        if counts != last:
            if len(self._history) > 1 and int(last_time) == int(now):
                self._history[-1] = (last_time, counts)  # same second: keep one entry
            else:
                self._history.append((now, counts))
        start = now - self.window_s
        while len(self._history) > 1 and self._history[1][0] <= start:
            self._history.popleft()

    def _stats(self, now: float, counts: ResidencyCounts) -> ResidencyStats:
        base = self._history[0][1]
        per_min = 60.0 / self.window_s
        rates = [round((c - b) * per_min, 1) for c, b in zip(counts, base, strict=True)]
        return ResidencyStats(
            *counts,
            *rates,
            window_s=self.window_s,
            thrashing=rates[2] >= self.thrash_reloads_per_min,
        )
