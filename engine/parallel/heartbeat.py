"""Each rank's heartbeat, and rank 0's watch over them: which rank stopped answering.

A rank that dies closes its connections, and rank 0's next collective fails at once. A rank
that hangs (stopped by a signal, frozen, swapped out) keeps them open: rank 0 would wait in
its collective for the whole collective timeout, and even then not know which rank it waited
for. So every other rank beats: a daemon thread writes a byte to a pipe that rank 0 reads,
ten times per heartbeat timeout. The thread beats while the rank's main thread computes
(torch releases the GIL in its ops, and Python code hands it over every few milliseconds),
so a long step is not taken for a hang; a stopped process beats no more.

Rank 0's watch (a daemon thread of its own) notes when it last read each rank's beat, on its
own clock, and reports a rank silent for longer than the timeout, once. A rank is watched
from its first beat: before it, the rank is still starting, and the join's timeout bounds
that. A rank whose pipe closes has exited; its death is its process's to report.
"""

from __future__ import annotations

import logging
import os
import selectors
import threading
import time
from collections.abc import Callable

__all__ = ["HeartbeatWatch", "beat_interval_s", "start_heartbeat"]

logger = logging.getLogger("loramux.engine.parallel")
BEATS_PER_TIMEOUT = 10


def beat_interval_s(timeout_s: float) -> float:
    """How often a rank beats (and rank 0's watch looks) for a heartbeat timeout."""
    return timeout_s / BEATS_PER_TIMEOUT


def start_heartbeat(fd: int, interval_s: float) -> threading.Thread:
    """This rank's heartbeat: a daemon thread writing a byte to ``fd`` every ``interval_s``."""
    thread = threading.Thread(
        target=_beat, args=(fd, interval_s), name="tensor-parallel heartbeat", daemon=True
    )
    thread.start()
    return thread


def _beat(fd: int, interval_s: float) -> None:
    try:
        while True:
            os.write(fd, b"\0")
            time.sleep(interval_s)
    except OSError:  # rank 0 closed its end: it is gone or closing; its connections tell
        return


class HeartbeatWatch:
    """Rank 0's watch over the other ranks' heartbeats: ``on_silent(rank, silent_s)`` is
    called (from the watch's thread) for a rank silent for longer than ``timeout_s``."""

    def __init__(self, timeout_s: float, on_silent: Callable[[int, float], None]):
        self.timeout_s = timeout_s
        self._on_silent = on_silent
        self._selector = selectors.DefaultSelector()
        self._last_beat: dict[int, float] = {}  # rank -> when its latest beat was read
        self._reported: set[int] = set()
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name="tensor-parallel heartbeat watch", daemon=True
        )

    def pipe(self, rank: int) -> int:
        """A pipe for ``rank``'s heartbeat (before ``start``): the watch reads one end; the
        other, returned, is for the rank's process to inherit and for the caller to close."""
        read_fd, write_fd = os.pipe()
        self._selector.register(read_fd, selectors.EVENT_READ, rank)
        return write_fd

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (idempotent) and close the pipes: a rank still beating stops."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()
        for key in list(self._selector.get_map().values()):
            os.close(key.fd)
        self._selector.close()

    def silent_ranks(self, now: float | None = None) -> dict[int, float]:
        """The ranks silent for longer than the timeout, with the seconds since their last beat."""
        now = time.monotonic() if now is None else now
        silent = {rank: now - beat for rank, beat in list(self._last_beat.items())}
        return {rank: seconds for rank, seconds in silent.items() if seconds > self.timeout_s}

    def _watch(self) -> None:
        tick = beat_interval_s(self.timeout_s)
        previous = time.monotonic()
        while not self._stopping.is_set():
            events = self._selector.select(tick)
            now = time.monotonic()
            if now - previous > self.timeout_s / 2:
                # This thread did not run meanwhile (rank 0, or the whole machine, frozen or
                # suspended): the ranks' silence was not observed, so it counts afresh.
                self._last_beat = dict.fromkeys(self._last_beat, now)
            previous = now
            for key, _ in events:
                if os.read(key.fd, 4096):
                    self._last_beat[key.data] = now
                else:  # the rank's process exited
                    self._selector.unregister(key.fd)
                    os.close(key.fd)
                    self._last_beat.pop(key.data, None)
            for rank, silent_s in self.silent_ranks(now).items():
                if rank not in self._reported:
                    self._reported.add(rank)
                    try:
                        self._on_silent(rank, silent_s)
                    except Exception:  # the watch goes on for the other ranks
                        logger.exception("reporting tensor-parallel rank %d's silence", rank)
