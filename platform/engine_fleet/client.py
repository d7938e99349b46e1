"""The one interface the platform reaches engines through, and its in-process form.

:class:`EngineClient` is what routes and services may call. :class:`LocalEngine` is the
embedded default's: the engine in this process, on its own thread (``AsyncEngine``), its
adapters read from this platform's store. ``loramux.platform.engine_fleet.remote`` has the
other, engines in their own processes behind the same methods.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry

from loramux.engine import AsyncEngine, Engine, EngineStats, RequestOutput, SamplingParams
from loramux.platform.engine_fleet.stored_adapter import StoredAdapter
from loramux.platform.store import ObjectStore


@dataclass(frozen=True)
class EngineRequest:
    """One engine request as the platform hands it to an engine client: one sequence of a
    job (``services/inference_job.Job``), its id unique while it runs."""

    request_id: str
    prompt: str | Seq[int]  # text, or token ids
    params: SamplingParams
    adapter: str | None = None  # the engine's name of the adapter version; None: the base
    priority: int = 0  # the tenant's priority class
    tenant: str | None = None  # whose fair share it counts against
    # Several adapters weighted (engine names and weights; the engine's lora/mix.py), in
    # place of ``adapter``
    mix: tuple[tuple[str, float], ...] | None = None

    @property
    def adapters(self) -> tuple[str, ...]:
        """The engine names of every adapter it uses."""
        if self.mix is not None:
            return tuple(name for name, _ in self.mix)
        return () if self.adapter is None else (self.adapter,)


@dataclass(frozen=True)
class EngineReport:
    """One engine as the platform sees it: its snapshot, or why it has none."""

    engine_id: str
    url: str | None  # None for the engine in this process
    capacity: int  # requests it runs at once
    heartbeat_age_s: float | None  # seconds since its last registry heartbeat (None: local)
    stats: EngineStats | None
    error: str | None = None  # why there are no stats (unreachable, skipped)


class EngineClient(Protocol):
    """What the platform may ask of its engine(s).

    ``stream`` raises ``EngineError`` when a request is refused and ``AsyncEngineError``
    (or a subclass) when the engine could not finish it; leaving its loop early aborts the
    request on the engine. ``abort`` aborts one by id and answers with its final output
    (finish reason ``abort``; its metrics say how much of the prompt was prefilled), or None
    when no such request runs. ``remove_adapter`` raises ``AdapterInUse`` (an ``EngineError``)
    while requests use the adapter.
    """

    @property
    def tokenizer(self): ...  # the base model's tokenizer (prompt counting, chat templates)

    @property
    def max_model_len(self) -> int: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def not_ready_reason(self) -> str | None: ...  # None when requests can be served

    def capacity(self) -> int: ...  # requests run at once, all engines together (now)

    def stream(self, request: EngineRequest) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> RequestOutput | None: ...

    async def register_stored_adapter(self, name: str, adapter: StoredAdapter) -> None: ...

    async def remove_adapter(self, name: str) -> None: ...

    # Pin a registered adapter on the device of every engine, or unpin it; each pin's state.
    async def keep_adapter(self, name: str, keep: bool = True) -> None: ...

    async def pinned_adapters(self) -> dict[str, str]: ...

    async def set_tenant_weight(self, tenant: str | None, weight: float) -> None: ...

    async def set_tenant_priority(self, tenant: str | None, priority: int) -> int: ...

    async def stats(self) -> EngineStats: ...  # every engine's, merged

    async def engine_reports(self) -> list[EngineReport]: ...  # each engine's own

    async def adapter_residency(self) -> dict[str, str]: ...

    # The in-process engine's metrics, or routing's (engine processes serve their own).
    def metrics_registry(self) -> CollectorRegistry | None: ...


class LocalEngine(AsyncEngine):
    """The engine in the platform's process; adapters come from the platform's store."""

    def __init__(self, engine: Engine, store: ObjectStore):
        super().__init__(engine)
        self._store = store

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def not_ready_reason(self) -> str | None:
        return None if self.is_running else "the engine loop is not running"

    def stream(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        return self.generate(
            request.prompt,
            request.params,
            adapter=request.adapter,
            priority=request.priority,
            tenant=request.tenant,
            request_id=request.request_id,
            mix=request.mix,
        )

    def capacity(self) -> int:
        return self.engine.config.max_num_seqs

    async def register_stored_adapter(self, name: str, adapter: StoredAdapter) -> None:
        await self.register_adapter(name, adapter.source(self._store))

    def metrics_registry(self) -> CollectorRegistry:
        return self.engine.metrics.registry

    async def engine_reports(self) -> list[EngineReport]:
        return [
            EngineReport(
                engine_id="local",
                url=None,
                capacity=self.engine.config.max_num_seqs,
                heartbeat_age_s=None,
                stats=await self.stats(),
            )
        ]
