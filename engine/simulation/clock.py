"""Simulated time, which the simulated executor advances by each step's modelled seconds.

The adapter loader's threads run for real and sleep on this clock (``sleep``) for the
time a fetch would take. To keep a run deterministic, the clock never moves while a loader
thread is between events: before it advances, and after waking each sleeper (in the order
of their wake times, the clock set to each one's), it waits until the loader has settled:
every busy thread asleep here and no job waiting while a thread is free
(``AdapterLoader.activity``). Threads then only ever act at simulated instants the engine
thread chose.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable

from loramux.engine.lora.loader import LoaderActivity

SETTLE_POLL_S = 0.0005  # real seconds between looks at the loader while it settles
SETTLE_LIMIT_S = 60.0  # real seconds the loader may take to settle before it is a bug


class EngineStuck(RuntimeError):
    """Requests are left, nothing can run and no event is coming (a policy bug)."""


class LoaderNeverSettled(RuntimeError):
    """The loader's threads did not come to rest (a simulation bug, or a real hang)."""


class SimulatedClock:
    def __init__(self, start: float = 0.0):
        self._now = start
        self._cond = threading.Condition()
        self._wakes: list[tuple[float, int]] = []  # (wake time, ticket) of sleepers
        self._released: set[int] = set()
        self._tickets = itertools.count()
        self._asleep = 0  # sleepers not yet released
        self.activity: Callable[[], LoaderActivity] | None = None  # set by the device

    # --- the engine's Clock --------------------------------------------------------------
    def now(self) -> float:
        return self._now

    def idle(self, wait_for_load: Callable[[float], object], timeout: float) -> None:
        """Nothing to wait for in real time: whoever drives the run advances the clock to
        its next event (``next_wake``, or the next arrival)."""

    # --- moving time -----------------------------------------------------------------------
    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"time runs forward; got {seconds} s")
        self.advance_to(self._now + seconds)

    def advance_to(self, when: float) -> None:
        """Move to ``when``, waking the sleepers due by then in order."""
        with self._cond:
            self._settle()
            while self._wakes and self._wakes[0][0] <= when:
                wake, ticket = heapq.heappop(self._wakes)
                self._now = max(self._now, wake)
                self._released.add(ticket)
                self._asleep -= 1
                self._cond.notify_all()
                self._settle()
            self._now = max(self._now, when)

    def next_wake(self) -> float | None:
        """When the earliest sleeper wakes (None: none sleeps)."""
        with self._cond:
            self._settle()
            return self._wakes[0][0] if self._wakes else None

    def next_event(self, next_arrival: float | None) -> float:
        """When something can change for an engine that could run nothing: the next
        arrival (``next_arrival``, on this clock) or the next fetch to finish; EngineStuck
        when neither is coming."""
        events = [t for t in (self.next_wake(), next_arrival) if t is not None]
        if not events:
            raise EngineStuck("requests are left, nothing can run and no arrival or fetch is due")
        return min(events)

    # --- the loader's side ---------------------------------------------------------------
    def sleep(self, seconds: float) -> None:
        """Block the calling (loader) thread until the clock passes ``seconds`` from now."""
        with self._cond:
            ticket = next(self._tickets)
            heapq.heappush(self._wakes, (self._now + max(seconds, 0.0), ticket))
            self._asleep += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: ticket in self._released)
            self._released.discard(ticket)

    def _settle(self) -> None:
        """Wait (holding the lock only while looking) until the loader is at rest."""
        if self.activity is None:
            return
        deadline = time.monotonic() + SETTLE_LIMIT_S
        while True:
            activity = self.activity()
            free = activity.workers - activity.busy
            if activity.busy == self._asleep and (activity.queued == 0 or free == 0):
                return
            if time.monotonic() > deadline:
                raise LoaderNeverSettled(
                    f"adapter loader not at rest after {SETTLE_LIMIT_S:.0f} s: {activity}, "
                    f"{self._asleep} asleep on the simulated clock"
                )
            self._cond.wait(SETTLE_POLL_S)
