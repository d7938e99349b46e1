"""The engine's clock: where every time it records (arrivals, first tokens, step times) and
its idle waits come from.

On a device it is the wall clock (``WallClock``). In simulation (``engine/simulation``) it
is a simulated clock that the simulated executor advances by each step's modelled time, so
the same scheduler, KV manager and adapter residency decide on simulated time. Chosen once,
by the engine's ``Devices``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic clock (only differences mean anything)."""
        ...

    def idle(self, wait_for_load: Callable[[float], object], timeout: float) -> None:
        """Nothing can run until an adapter load finishes: wait for one, at most
        ``timeout`` seconds (``wait_for_load(timeout)`` blocks on the loader)."""
        ...


class WallClock:
    """Real time: ``time.monotonic``, and idle waits that block."""

    def now(self) -> float:
        return time.monotonic()

    def idle(self, wait_for_load: Callable[[float], object], timeout: float) -> None:
        wait_for_load(timeout)
