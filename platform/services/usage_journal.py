"""The usage journal: what running requests delivered, checkpointed while they run.

Usage used to be written only when a request ended, so a crash (SIGKILL, OOM, power loss)
lost the billing of every token a long stream had already delivered. The journal keeps a
live view of each running request (a callable that builds its ``UsageEvent`` from its
tally: prompt tokens and the completion tokens *delivered* so far) and, from one
background task, every ``interval_s`` writes those that delivered more since their last
checkpoint as provisional usage rows, all in one short transaction
(``Meter.checkpoint``). The request's own end still writes its final record
(``Meter.record``), which takes over the provisional row.

The bound: a crash loses at most the tokens a request delivered since its last checkpoint,
that is over the last ``interval_s`` plus the time one checkpoint write takes. A request
that delivered nothing yet (non-streaming requests deliver only with their response) has
no row, as before. Snapshots are taken on the event loop that mutates the tallies, so
they are consistent; the database write runs in a worker thread, and no session outlives
it. A failing write (database down) is logged and retried at the next tick.

A request that ends while the database is down could not write its final record: the
serving path hands it to :meth:`UsageJournal.write_later`, and each tick tries such
records again (oldest first, stopping at the first failure) until the database takes
them, then settles the request's holds. Each is written once: the final write is
idempotent on the request id, so a try that reached the database before its connection
dropped makes the next one a no-op. They are kept in memory: a platform that stops before
the database is back loses them, as a crash would (a stream keeps its last checkpoint).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from loramux.platform.services.metering import Meter, UsageEvent, database_unavailable

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 1.0


@dataclass
class _Entry:
    snapshot: Callable[[], UsageEvent]  # the request's usage as delivered so far
    written: int = 0  # completion tokens of its last stored checkpoint


@dataclass(frozen=True)
class _Unwritten:
    event: UsageEvent  # a finished request's final usage, refused by the database
    then: Callable[[], None]  # what follows its write (settling the request's holds)


class UsageJournal:
    """Running requests' usage, checkpointed every ``interval_s`` by :meth:`start`'s task.

    ``open`` / ``close`` are called on the event loop the journal runs on;
    ``write_later`` from any thread.
    """

    def __init__(self, meter: Meter, *, interval_s: float = DEFAULT_INTERVAL_S):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self._meter = meter
        self.interval_s = interval_s
        self._open: dict[str, _Entry] = {}
        self._unwritten: dict[str, _Unwritten] = {}  # request id -> final record, oldest first
        self._unwritten_lock = threading.Lock()
        self._task: asyncio.Task | None = None

    def __len__(self) -> int:
        """How many requests are open."""
        return len(self._open)

    def open(self, request_id: str, snapshot: Callable[[], UsageEvent]) -> None:
        """Journal the request ``request_id`` until :meth:`close`."""
        self._open[request_id] = _Entry(snapshot)

    def close(self, request_id: str) -> None:
        """Stop journaling the request (its final record is written by its end)."""
        self._open.pop(request_id, None)

    def write_later(self, event: UsageEvent, then: Callable[[], None]) -> None:
        """``event`` is a finished request's final usage that the database could not take:
        write it at the next ticks until it does, then call ``then``."""
        with self._unwritten_lock:
            self._unwritten[event.request_id] = _Unwritten(event, then)

    @property
    def unwritten(self) -> int:
        """Finished requests whose final record waits for the database."""
        return len(self._unwritten)

    async def start(self) -> None:
        """Checkpoint every ``interval_s`` from a background task, until :meth:`stop`."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="usage-journal")

    async def stop(self) -> None:
        """Stop the task after one last checkpoint of whatever is still open and one last
        try of the final records waiting for the database."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with anyio.CancelScope(shield=True):
            await self.checkpoint()
            await self.write_unwritten()
            if self._unwritten:
                logger.error(
                    "stopping with %d finished request(s) whose usage the database never took: %s",
                    len(self._unwritten),
                    ", ".join(self._unwritten),
                )

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.write_unwritten()
            await self.checkpoint()

    async def write_unwritten(self) -> int:
        """Write the final records the database refused, oldest first, until one fails
        again (the database is still down); how many were written."""
        with self._unwritten_lock:
            waiting = list(self._unwritten.values())
        if not waiting:
            return 0
        return await anyio.to_thread.run_sync(self._write_finals, waiting)

    def _write_finals(self, waiting: list[_Unwritten]) -> int:
        written = 0
        for item in waiting:
            try:
                self._meter.record(item.event)  # None: written already by a try that got through
            except Exception as exc:
                if database_unavailable(exc):  # still down: the rest wait with it
                    logger.warning(
                        "final usage of %d finished request(s) still waits for the database: %s",
                        len(waiting) - written,
                        exc,
                    )
                    break
                # A record the database refuses for good must not hold up the others.
                logger.exception("final usage of %s cannot be written", item.event.request_id)
            else:
                written += 1
            self._done(item)
        return written

    def _done(self, item: _Unwritten) -> None:
        with self._unwritten_lock:
            self._unwritten.pop(item.event.request_id, None)
        try:
            item.then()
        except Exception:  # the record is settled: a failed follow-up must not undo that
            logger.exception("after the final usage of %s", item.event.request_id)

    async def checkpoint(self) -> int:
        """Write every open request that delivered more since its last checkpoint; how
        many rows were written (0 on a failed write, which the next tick retries)."""
        due: list[tuple[_Entry, UsageEvent]] = []
        for entry in list(self._open.values()):
            event = entry.snapshot()
            if event.completion_tokens > entry.written:
                due.append((entry, event))
        if not due:
            return 0
        try:
            written = await anyio.to_thread.run_sync(
                self._meter.checkpoint, [event for _, event in due]
            )
        except Exception:
            logger.exception("usage checkpoint of %d running request(s) failed", len(due))
            return 0
        for entry, event in due:
            entry.written = event.completion_tokens
        return written
