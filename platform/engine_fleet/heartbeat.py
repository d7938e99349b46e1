"""An engine process's heartbeat: its registry record, published on time every heartbeat.

The record's load and resident adapters are read on the engine thread, which answers
between steps. A long step (a big prefill on a busy CPU) must not silence the heartbeat:
the record would expire and every platform would stop routing to an engine that is merely
busy. So a beat waits for fresh figures at most half a heartbeat, then publishes the last
ones again with a new time. An engine thread silent for ``STALE_HEARTBEATS`` heartbeats is
taken as hung: the beats stop, the record expires, and the platforms route elsewhere.

Beats keep to a schedule (one per ``heartbeat_s``, however long each took) rather than
sleeping a heartbeat after each, and one that comes more than two heartbeats after the
previous is logged: the process was starved, and its record nearly expired.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

from loramux.platform.engine_fleet.registry import EngineRecord, EngineRegistry

logger = logging.getLogger(__name__)

STALE_HEARTBEATS = 10  # beats that may carry old figures before the engine is taken as hung


class Heartbeat:
    """Publishes ``read_record()``'s record to ``registry`` (see the module docstring)."""

    def __init__(
        self, registry: EngineRegistry, read_record: Callable[[], Awaitable[EngineRecord]]
    ):
        self.registry = registry
        self._read_record = read_record
        self.last_beat: float | None = None  # time.monotonic() of the last one Redis took
        self._record: EngineRecord | None = None  # the last fresh one
        self._fresh_at = 0.0  # time.monotonic() when it was read
        self._reading: asyncio.Future | None = None  # at most one read queued on the engine
        self._hung_reported = False

    async def beat(self, *, patient: bool = False) -> None:
        """Publish the record once (raises what Redis raises). ``patient``: wait for fresh
        figures however long they take (the first beat, which has no earlier ones)."""
        record = await self._current(patient)
        if record is None:
            return
        await self.registry.publish(record)
        now = time.monotonic()
        if self.last_beat is not None and now - self.last_beat > 2 * self.registry.heartbeat_s:
            logger.warning(
                "engine %s: heartbeat %.1f s after the previous one (records expire after "
                "%g s): the process was starved of CPU",
                record.engine_id,
                now - self.last_beat,
                self.registry.ttl_s,
            )
        self.last_beat = now

    async def run(self) -> None:
        """Beat every ``heartbeat_s`` until cancelled; a failed beat is logged, not fatal
        (a Redis blip must not unregister the engine for good)."""
        period = self.registry.heartbeat_s
        due = time.monotonic()
        while True:
            due = max(due + period, time.monotonic())  # after a stall: on time, no burst
            await asyncio.sleep(due - time.monotonic())
            try:
                await self.beat()
            except Exception:
                logger.exception("heartbeat failed")

    async def _current(self, patient: bool) -> EngineRecord | None:
        """Fresh figures if the engine thread gives them in half a heartbeat; else the last
        ones with a new time; None once they are too old to vouch for a live engine."""
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read_record())
        try:
            if patient:
                record = await asyncio.shield(self._reading)
            else:
                record = await asyncio.wait_for(
                    asyncio.shield(self._reading), self.registry.heartbeat_s / 2
                )
        except TimeoutError:
            return self._stale()
        except BaseException:
            if self._reading.done():
                self._reading = None  # it failed: the next beat reads again
            raise
        self._reading = None
        self._record, self._fresh_at = record, time.monotonic()
        self._hung_reported = False
        return record

    def _stale(self) -> EngineRecord | None:
        if self._record is None:
            return None
        silent_s = time.monotonic() - self._fresh_at
        if silent_s > STALE_HEARTBEATS * self.registry.heartbeat_s:
            if self._hung_reported:
                return None
            self._hung_reported = True
            logger.error(
                "engine %s: the engine thread has not answered for %.0f s; the heartbeat "
                "stops, so platforms route elsewhere until it does",
                self._record.engine_id,
                silent_s,
            )
            return None
        return dataclasses.replace(self._record, heartbeat_at=time.time())
