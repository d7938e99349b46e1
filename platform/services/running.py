"""The requests this process is serving, so that a shutdown can end them in bounded time.

Each running request registers a ``stop`` callable: calling it ends the request early but
cleanly (its engine work is aborted, the client gets what was generated with finish reason
``abort``, and it is billed for what it delivered). ``stop_all`` is what a shutdown calls
once its grace period is over (``loramux.platform.serving``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable


class RunningRequests:
    """Stop handles of the running requests; used from one event loop."""

    def __init__(self) -> None:
        self._stops: dict[int, Callable[[], None]] = {}
        self._ids = itertools.count()
        self.stopping = False  # set by stop_all: a request starting later stops at once

    def __len__(self) -> int:
        return len(self._stops)

    def add(self, stop: Callable[[], None]) -> int:
        """Register a running request by its ``stop``; the handle ``discard`` takes."""
        handle = next(self._ids)
        self._stops[handle] = stop
        if self.stopping:  # it got past the shutdown's stop_all (it was still being prepared)
            stop()
        return handle

    def discard(self, handle: int) -> None:
        """The request ended."""
        self._stops.pop(handle, None)

    def stop_all(self) -> int:
        """Stop every running request, and any that starts from now on; how many ran."""
        self.stopping = True
        stops = list(self._stops.values())
        for stop in stops:
            stop()
        return len(stops)
