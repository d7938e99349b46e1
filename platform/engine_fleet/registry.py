"""The engine registry in Redis: who is serving, where, how loaded, holding which adapters.

Each ``loramux engine`` process writes its :class:`EngineRecord` under
``<namespace>:engine:<id>`` every heartbeat with a time-to-live of three heartbeats, and
adds its id to the set ``<namespace>:engines`` (namespace ``loramux`` unless a deployment
shares its Redis between clusters). An engine that stops beating (killed, hung,
partitioned) disappears when its key expires; a clean shutdown deletes it at once.
Readers list the set, fetch the records in one round trip and drop ids whose record has
expired. Nothing else lives in Redis for routing: each platform replica routes from what
it reads here plus what it sent itself since.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

DEFAULT_NAMESPACE = "loramux"
MISSED_HEARTBEATS = 3  # an engine silent this many heartbeats is gone


@dataclass(frozen=True)
class EngineRecord:
    engine_id: str
    url: str  # where the platform reaches its internal API
    model_id: str  # the base model it serves
    boot_id: str  # new every start: registrations made with an earlier boot are gone
    capacity: int  # requests it runs at once (max_num_seqs)
    running: int
    waiting: int
    max_model_len: int
    device_adapters: tuple[str, ...] = ()  # resident in device memory
    host_adapters: tuple[str, ...] = ()  # parsed in host RAM
    heartbeat_at: float = field(default_factory=time.time)

    @property
    def load(self) -> int:
        return self.running + self.waiting

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> EngineRecord:
        data = json.loads(text)
        data["device_adapters"] = tuple(data.get("device_adapters", ()))
        data["host_adapters"] = tuple(data.get("host_adapters", ()))
        return cls(**data)


# KEYS: the id set, then each expired id's record key; ARGV: those ids.
_FORGET_EXPIRED = """
for i, engine_id in ipairs(ARGV) do
    if redis.call('EXISTS', KEYS[i + 1]) == 0 then
        redis.call('SREM', KEYS[1], engine_id)
    end
end
"""


class EngineRegistry:
    """Reads and writes records through an asyncio Redis client (``redis.asyncio``)."""

    def __init__(self, redis, heartbeat_s: float, *, namespace: str = DEFAULT_NAMESPACE):
        self._redis = redis
        self.heartbeat_s = heartbeat_s
        self._ids_key = f"{namespace}:engines"
        self._record_prefix = f"{namespace}:engine:"

    @property
    def ttl_s(self) -> float:
        return MISSED_HEARTBEATS * self.heartbeat_s

    async def publish(self, record: EngineRecord) -> None:
        """Write (or refresh) ``record``; it expires after :attr:`ttl_s` without another."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(
                self._record_prefix + record.engine_id,
                record.to_json(),
                px=int(self.ttl_s * 1000),
            )
            pipe.sadd(self._ids_key, record.engine_id)
            await pipe.execute()

    async def withdraw(self, engine_id: str) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._record_prefix + engine_id)
            pipe.srem(self._ids_key, engine_id)
            await pipe.execute()

    async def live(self) -> list[EngineRecord]:
        """Every engine whose record has not expired, by id."""
        members = await self._redis.smembers(self._ids_key)
        ids = sorted(i.decode() if isinstance(i, bytes) else i for i in members)
        if not ids:
            return []
        values = await self._redis.mget([self._record_prefix + i for i in ids])
        expired = [i for i, value in zip(ids, values, strict=True) if value is None]
        if expired:
            # Only those still without a record: one may have beaten again since the read.
            keys = [self._ids_key, *(self._record_prefix + i for i in expired)]
            await self._redis.eval(_FORGET_EXPIRED, len(keys), *keys, *expired)
        return [EngineRecord.from_json(value) for value in values if value is not None]
