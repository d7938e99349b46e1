"""An engine's heartbeat in a real Redis: a busy engine stays registered, a hung one leaves,
and a reader never forgets an engine that beat again while it read.

The engine thread's answer is a coroutine the test holds back (a long step, or a hung
thread), so the timings are the heartbeat's, not the machine's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import redis.asyncio

from loramux.platform.engine_fleet.heartbeat import STALE_HEARTBEATS, Heartbeat
from loramux.platform.engine_fleet.registry import EngineRecord, EngineRegistry

HEARTBEAT_S = 0.2  # records expire after 0.6 s

RECORD = EngineRecord(
    engine_id="engine-h",
    url="http://127.0.0.1:9",
    model_id="tiny",
    boot_id="boot",
    capacity=8,
    running=0,
    waiting=0,
    max_model_len=512,
)


class EngineThread:
    """Answers the heartbeat's reads with a record counting them; ``busy()`` holds the
    answers back as a long step would, ``free()`` lets them through."""

    def __init__(self):
        self.reads = 0
        self._free = asyncio.Event()
        self._free.set()

    async def read_record(self) -> EngineRecord:
        self.reads += 1
        await self._free.wait()
        return replace(RECORD, running=self.reads)

    def busy(self) -> None:
        self._free.clear()

    def free(self) -> None:
        self._free.set()


def _registry(redis_url: str, namespace: str, client=None) -> EngineRegistry:
    return EngineRegistry(
        client or redis.asyncio.from_url(redis_url), HEARTBEAT_S, namespace=namespace
    )


async def _live(registry: EngineRegistry) -> dict[str, EngineRecord]:
    return {r.engine_id: r for r in await registry.live()}


@contextlib.asynccontextmanager
async def beating(redis_url: str) -> AsyncIterator[tuple[EngineRegistry, EngineThread]]:
    """An engine thread's heartbeat running in a registry of its own, for the block."""
    registry = _registry(redis_url, f"hb-{uuid.uuid4().hex[:8]}")
    thread = EngineThread()
    heartbeat = Heartbeat(registry, thread.read_record)
    await heartbeat.beat(patient=True)
    task = asyncio.create_task(heartbeat.run())
    try:
        yield registry, thread
    finally:
        task.cancel()


def test_a_busy_engine_keeps_beating_with_its_last_figures(redis_url):
    async def go():
        async with beating(redis_url) as (registry, thread):
            await asyncio.sleep(2 * HEARTBEAT_S)
            before = (await _live(registry))["engine-h"]
            reads = thread.reads
            thread.busy()  # a step five heartbeats long: past the records' 0.6 s life
            seen = []
            for _ in range(5):
                await asyncio.sleep(HEARTBEAT_S)
                seen.append((await _live(registry)).get("engine-h"))
            thread.free()
            await asyncio.sleep(3 * HEARTBEAT_S)
            after = (await _live(registry))["engine-h"]
        assert all(record is not None for record in seen), "the busy engine left the registry"
        # The figures of before the step, each beat with a newer time.
        assert {record.running for record in seen} <= {before.running, reads}
        times = [record.heartbeat_at for record in seen]
        assert times == sorted(times) and times[-1] > before.heartbeat_at
        assert thread.reads <= reads + 1 + 3  # one read waited out the step, not one a beat
        assert after.running > reads  # fresh figures once the step ended

    asyncio.run(go())


def test_an_engine_thread_silent_too_long_leaves_the_registry(redis_url, caplog):
    async def go():
        async with beating(redis_url) as (registry, thread):
            thread.busy()
            await asyncio.sleep((STALE_HEARTBEATS + 5) * HEARTBEAT_S)
            gone = "engine-h" not in await _live(registry)
            thread.free()
            await asyncio.sleep(3 * HEARTBEAT_S)
            back = "engine-h" in await _live(registry)
        return gone, back

    with caplog.at_level(logging.ERROR, logger="loramux.platform.engine_fleet.heartbeat"):
        gone, back = asyncio.run(go())
    assert gone, "a hung engine must leave the registry"
    assert back, "the engine must come back once its thread answers"
    hung = [r for r in caplog.records if "has not answered" in r.getMessage()]
    assert len(hung) == 1, caplog.text  # said once, not every beat


class BeatAfterRead(redis.asyncio.Redis):
    """A real Redis client on which, right after a reader's MGET, the engine beats again:
    the interleaving a busy machine makes between a reader's two round trips."""

    on_read = None

    async def mget(self, *args, **kwargs):
        values = await super().mget(*args, **kwargs)
        if self.on_read is not None:
            hook, self.on_read = self.on_read, None
            await hook()
        return values


def test_a_reader_never_forgets_an_engine_that_beat_while_it_read(redis_url):
    async def go():
        namespace = f"hb-{uuid.uuid4().hex[:8]}"
        engine_side = _registry(redis_url, namespace)
        reader_client = BeatAfterRead.from_url(redis_url)
        reader = _registry(redis_url, namespace, reader_client)
        await engine_side.publish(RECORD)
        await asyncio.sleep(engine_side.ttl_s + 0.2)  # a late heartbeat: the record expired

        async def beat_again():
            await engine_side.publish(replace(RECORD, running=1))

        reader_client.on_read = beat_again
        first = await _live(reader)  # read before the beat: not listed this time...
        second = await _live(reader)  # ...but kept in the set, so listed from the next read
        return first, second

    first, second = asyncio.run(go())
    assert "engine-h" not in first
    assert "engine-h" in second and second["engine-h"].running == 1
