"""The platform's engine client in production: requests routed to registered engines.

:class:`RoutedEngines` has the in-process engine's methods (``client.EngineClient``) over
every live ``loramux engine`` process serving this platform's base model. It reads the
registry every half heartbeat and, per request, picks an engine by ``routing.choose``:
adapter affinity within a bound on imbalance, from the registry's loads raised by the
requests this platform has in flight.

``abort`` goes to the engine running the request and answers with its final output.

Engines learn what they need lazily, when a request is first routed to them: the
adapter's store objects (``register_stored_adapter`` only records them) and every
tenant's scheduling. Both are sent again after an engine restarts (a new boot id).

Failures: an engine that refuses the connection, or goes away before the request's first
output, is skipped (until its next heartbeat) and the request goes to another; one that
dies after an output fails only that request (``EngineLost``: the caller bills what was
delivered); its record leaves the registry when it stops beating.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace

import httpx
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter

from loramux.engine import EngineStats, RequestOutput
from loramux.platform.engine_fleet.client import EngineReport, EngineRequest
from loramux.platform.engine_fleet.merge import fastest_tiers, merge_pin_states, merge_stats
from loramux.platform.engine_fleet.registry import EngineRecord, EngineRegistry
from loramux.platform.engine_fleet.remote import (
    AdapterNotRegistered,
    EngineLost,
    EngineUnavailable,
    EngineUnreachable,
    RemoteEngine,
)
from loramux.platform.engine_fleet.routing import COLD, Candidate, affinity, choose
from loramux.platform.engine_fleet.stored_adapter import StoredAdapter

logger = logging.getLogger(__name__)


def build_routed_engines(settings, base_model) -> RoutedEngines:
    """The client ``LORAMUX_ENGINE_MODE=remote`` describes (Redis registry, shared secret)."""
    import redis.asyncio
    from transformers import AutoTokenizer

    from loramux.engine import ModelConfig

    registry = EngineRegistry(
        redis.asyncio.from_url(settings.redis_url), settings.engine_heartbeat_s
    )
    return RoutedEngines(
        registry,
        model_id=base_model.model_id,
        tokenizer=AutoTokenizer.from_pretrained(base_model.path),
        default_max_model_len=ModelConfig.from_pretrained(base_model.path).max_position_embeddings,
        secret=settings.engine_secret.get_secret_value(),
        load_factor=settings.routing_load_factor,
    )


class NoEngineAvailable(EngineUnavailable):
    """No live engine serves the base model (none registered, or every one unreachable)."""


class RoutedEngines:
    def __init__(
        self,
        registry: EngineRegistry,
        *,
        model_id: str,
        tokenizer,
        default_max_model_len: int,
        secret: str,
        load_factor: float,
    ):
        self._registry = registry
        self._model_id = model_id
        self._tokenizer = tokenizer
        self._default_max_model_len = default_max_model_len
        self._secret = secret
        self._load_factor = load_factor
        self._http: httpx.AsyncClient | None = None
        self._records: list[EngineRecord] = []
        self._refresher: asyncio.Task | None = None
        self._inflight: Counter[str] = Counter()  # engine id -> this platform's requests there
        self._running_on: dict[str, EngineRecord] = {}  # request id -> the engine it is on
        self._down: dict[str, float] = {}  # engine id -> heartbeat_at when it failed a connect
        self._boots: dict[str, str] = {}  # engine id -> boot id the two maps below are about
        self._sent: dict[str, set[str]] = {}  # engine id -> adapters registered there
        # engine id -> adapters routed there: affinity from the moment of routing, before
        # the registration is even sent (so concurrent requests agree)
        self._assigned: dict[str, set[str]] = {}
        self._registering: dict[tuple[str, str], asyncio.Lock] = {}
        self._tenants_synced: set[str] = set()  # engines holding every tenant's scheduling
        self._adapters: dict[str, StoredAdapter] = {}  # adapter name -> its store objects
        self._kept: set[str] = set()  # adapters pinned on every engine
        self._kept_on: dict[str, set[str]] = {}  # engine id -> pins it has taken
        self._tenants: dict[str, dict] = {}  # tenant -> {"weight": w, "priority": p}
        self.routed: Counter[tuple[str, str | None]] = Counter()  # (engine, adapter) -> count
        # Requests with an adapter, by how they were routed: "affine" to an engine holding
        # (or already sent) it, "cold" when no engine did, "spill" when the load bound sent
        # it away from one that did.
        self.decisions: Counter[str] = Counter()
        self.metrics = RoutingMetrics()

    # --- lifecycle and the registry ----------------------------------------------------
    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        serving = [r.max_model_len for r in self._serving()]
        return min(serving) if serving else self._default_max_model_len

    async def start(self) -> None:
        self._http = httpx.AsyncClient()
        await self.refresh()
        self._refresher = asyncio.create_task(self._refresh_forever())

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        if self._http is not None:
            await self._http.aclose()

    async def refresh(self) -> None:
        """Read the registry now (the background task does it every half heartbeat)."""
        try:
            self._records = await self._registry.live()
        except Exception:
            self.metrics.registry_errors.inc()
            raise

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self._registry.heartbeat_s / 2)
            try:
                await self.refresh()
                await self._sync_pins()
            except Exception:  # Redis blip: route from the last records meanwhile
                logger.exception("reading the engine registry failed")

    def engines(self) -> list[EngineRecord]:
        """The live engines serving this platform's base model (from the last read)."""
        return self._serving()

    def capacity(self) -> int:
        """The live engines' sequence slots together (as last read from the registry)."""
        return sum(record.capacity for record in self._serving())

    def _serving(self) -> list[EngineRecord]:
        return [r for r in self._records if r.model_id == self._model_id and not self._down_now(r)]

    def _down_now(self, record: EngineRecord) -> bool:
        """Whether routing skips ``record``: it failed since the heartbeat it was read at."""
        return self._down.get(record.engine_id, -1.0) >= record.heartbeat_at

    def not_ready_reason(self) -> str | None:
        if self._http is None:
            return "the engine client is not started"
        if not self._serving():
            return f"no live engine serves {self._model_id} (none registered in Redis)"
        return None

    def metrics_registry(self) -> CollectorRegistry:
        """Routing's own metrics (each engine process serves its engine's on its /metrics)."""
        return self.metrics.registry

    def _remote(self, record: EngineRecord) -> RemoteEngine:
        assert self._http is not None, "RoutedEngines.start() was not called"
        return RemoteEngine(self._http, record.engine_id, record.url, self._secret)

    # --- routing ----------------------------------------------------------------------
    def _route(
        self, adapter: str | None, request_id: str, excluded: set[str]
    ) -> EngineRecord | None:
        records = {r.engine_id: r for r in self._serving() if r.engine_id not in excluded}
        candidates = [
            Candidate(
                engine_id=r.engine_id,
                load=max(r.load, self._inflight[r.engine_id]),
                holds_on_device=adapter is not None and adapter in r.device_adapters,
                holds_in_host=adapter is not None and adapter in r.host_adapters,
                sent_before=adapter is not None and adapter in self._assigned_to(r),
            )
            for r in records.values()
        ]
        chosen = choose(candidates, self._load_factor, adapter or request_id)
        if chosen is None:
            return None
        kind = "base"
        if adapter is not None:
            best = min(map(affinity, candidates))
            kind = "spill" if affinity(chosen) > best else "cold" if best == COLD else "affine"
            self.decisions[kind] += 1
            self._assigned_to(records[chosen.engine_id]).add(adapter)
        self.metrics.decisions.labels(kind).inc()
        return records[chosen.engine_id]

    def _check_boot(self, record: EngineRecord) -> None:
        if self._boots.get(record.engine_id) != record.boot_id:  # new engine, or restarted
            self._boots[record.engine_id] = record.boot_id
            self._sent[record.engine_id] = set()
            self._assigned[record.engine_id] = set()
            self._kept_on[record.engine_id] = set()
            self._tenants_synced.discard(record.engine_id)

    def _sent_to(self, record: EngineRecord) -> set[str]:
        self._check_boot(record)
        return self._sent[record.engine_id]

    def _assigned_to(self, record: EngineRecord) -> set[str]:
        self._check_boot(record)
        return self._assigned[record.engine_id]

    async def _prepare(self, record: EngineRecord, adapters: tuple[str, ...]) -> None:
        """Send the engine what the request needs that it may not have yet."""
        remote = self._remote(record)
        if record.engine_id not in self._tenants_synced:
            for tenant, scheduling in list(self._tenants.items()):
                await remote.set_tenant(tenant, **scheduling)
            self._tenants_synced.add(record.engine_id)
        for adapter in adapters:
            await self._register(record, remote, adapter)

    async def _register(self, record: EngineRecord, remote: RemoteEngine, adapter: str) -> None:
        sent = self._sent_to(record)
        if adapter in sent:
            return
        lock = self._registering.setdefault((record.engine_id, adapter), asyncio.Lock())
        async with lock:  # one registration per engine and adapter, however many requests
            if adapter in sent:
                return
            stored = self._adapters.get(adapter)
            if stored is None:
                raise AdapterNotRegistered(f"unknown adapter {adapter!r}; register it first")
            await remote.register_adapter(adapter, stored)
            sent.add(adapter)

    def _mark_down(self, record: EngineRecord) -> None:
        # Skipped until it beats again (a newer heartbeat than the one we saw).
        self._down[record.engine_id] = record.heartbeat_at

    # --- requests ---------------------------------------------------------------------
    async def stream(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """One request on the engine ``routing`` picks; retried on another engine when the
        first did not answer or went away before the request's first output (nothing had
        reached the caller), or after re-registering the adapter with an engine that had
        forgotten it (it restarted). An engine lost after an output fails the request."""
        # A mix is routed by its first adapter (the engine holding it gets the others).
        request_id, adapters = request.request_id, request.adapters
        adapter = adapters[0] if adapters else None
        excluded: set[str] = set()
        reregistered = delivered = False
        while True:
            record = self._route(adapter, request_id, excluded)
            if record is None:
                raise NoEngineAvailable(
                    f"no engine is available for {self._model_id}: "
                    "none registered, or none reachable"
                )
            self._inflight[record.engine_id] += 1
            self._running_on[request_id] = record
            try:
                await self._prepare(record, adapters)
                stream = self._remote(record).stream(request)
                async with aclosing(stream):
                    async for out in stream:
                        self.routed[(record.engine_id, adapter)] += out.finished
                        delivered = True
                        yield out
                return
            except EngineUnreachable as exc:
                logger.warning("routing elsewhere: %s", exc)
                self._mark_down(record)
                excluded.add(record.engine_id)
                self.metrics.failures.labels(record.engine_id, "unreachable").inc()
                self.metrics.retries.labels("unreachable").inc()
            except EngineLost as exc:  # new requests avoid it until it beats again
                self._mark_down(record)
                self.metrics.failures.labels(record.engine_id, "lost").inc()
                if delivered:  # the caller has part of its answer: this request fails
                    raise
                # Lost before its first output (in prefill, say): nothing reached the
                # caller and the engine's work is gone with it, so another engine starts it.
                logger.warning("routing elsewhere before any output: %s", exc)
                excluded.add(record.engine_id)
                self.metrics.retries.labels("lost_before_output").inc()
            except AdapterNotRegistered:
                if reregistered or adapter is None:
                    raise
                self._sent_to(record).difference_update(adapters)
                reregistered = True
                self.metrics.retries.labels("adapter_reregistered").inc()
            finally:
                self._inflight[record.engine_id] -= 1
                self._running_on.pop(request_id, None)

    async def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request this platform is running, on the engine running it: its final
        output (with the metrics of what it cost), or None if none runs it. (Closing its
        stream aborts it too, with no answer.)"""
        record = self._running_on.get(request_id)
        if record is None:
            return None
        return await self._remote(record).abort(request_id)

    # --- adapters and tenants ----------------------------------------------------------
    async def register_stored_adapter(self, name: str, adapter: StoredAdapter) -> None:
        self._adapters[name] = adapter

    async def remove_adapter(self, name: str) -> None:
        """Unregister ``name`` from every engine it was sent to; ``AdapterInUse`` while one
        still runs requests on it (the caller retries)."""
        for record in self._serving():
            sent = self._sent_to(record)
            if name in sent:
                # Gone, or restarted since (it forgot the adapter): its memory is gone too.
                with contextlib.suppress(EngineUnavailable, AdapterNotRegistered):
                    await self._remote(record).remove_adapter(name)
                sent.discard(name)
            self._kept_on.get(record.engine_id, set()).discard(name)
        self._adapters.pop(name, None)
        self._kept.discard(name)

    async def keep_adapter(self, name: str, keep: bool = True) -> None:
        """Pin ``name`` on every engine (registering it where it was not sent), or unpin
        it; an engine that cannot be reached now, or that starts later, gets the pin at the
        next registry read (``_sync_pins``)."""
        if keep:
            self._kept.add(name)
        else:
            self._kept.discard(name)
        for record in self._serving():
            await self._send_pin(record, name, keep)

    async def _send_pin(self, record: EngineRecord, name: str, keep: bool) -> None:
        kept_on = self._kept_on.setdefault(record.engine_id, set())
        remote = self._remote(record)
        try:
            if keep:
                await self._register(record, remote, name)
            await remote.keep_adapter(name, keep)
        except (EngineUnavailable, AdapterNotRegistered):
            kept_on.discard(name)  # sent again at the next registry read
            self._sent_to(record).discard(name)
            return
        if keep:
            kept_on.add(name)
        else:
            kept_on.discard(name)

    async def _sync_pins(self) -> None:
        """Send each live engine the pins it lacks (a new or restarted one)."""
        for record in self._serving():
            self._check_boot(record)
            for name in self._kept - self._kept_on.get(record.engine_id, set()):
                await self._send_pin(record, name, True)

    async def pinned_adapters(self) -> dict[str, str]:
        """Each pinned adapter's state on the engines (``merge.merge_pin_states``)."""
        return merge_pin_states(await self._gather(lambda remote: remote.pinned_adapters()))

    async def set_tenant_weight(self, tenant: str | None, weight: float) -> None:
        await self._set_tenant(tenant, weight=weight)

    async def set_tenant_priority(self, tenant: str | None, priority: int) -> int:
        return await self._set_tenant(tenant, priority=priority)

    async def _set_tenant(self, tenant: str | None, **scheduling) -> int:
        if tenant is None:
            return 0
        self._tenants.setdefault(tenant, {}).update(scheduling)
        changed = 0
        for record in self._serving():
            try:
                changed += await self._remote(record).set_tenant(tenant, **scheduling)
            except EngineUnavailable:  # it gets everything again when next used
                self._tenants_synced.discard(record.engine_id)
        return changed

    # --- observability ----------------------------------------------------------------
    async def adapter_residency(self) -> dict[str, str]:
        """Each adapter's fastest tier on any engine."""
        return fastest_tiers(await self._gather(lambda remote: remote.residency()))

    async def stats(self) -> EngineStats:
        """All engines' snapshots as one (``merge.merge_stats``)."""
        parts = await self._gather(lambda remote: remote.stats())
        if not parts:
            raise NoEngineAvailable(f"no live engine serves {self._model_id}")
        return merge_stats(parts)

    async def engine_reports(self) -> list[EngineReport]:
        """Every engine of this base model in the last registry read, with its snapshot or
        why it has none (one routing skips, or one that did not answer now)."""
        reports = []
        now = time.time()
        for record in sorted(self._records, key=lambda r: r.engine_id):
            if record.model_id != self._model_id:
                continue
            report = EngineReport(
                engine_id=record.engine_id,
                url=record.url,
                capacity=record.capacity,
                heartbeat_age_s=max(0.0, now - record.heartbeat_at),
                stats=None,
            )
            if self._down_now(record):
                report = replace(
                    report, error="skipped: it failed a request since its last heartbeat"
                )
            else:
                try:
                    report = replace(report, stats=await self._remote(record).stats())
                except EngineUnavailable as exc:
                    logger.warning("engine report: %s", exc)
                    report = replace(report, error="did not answer (details in the log)")
            reports.append(report)
        return reports

    async def _gather(self, call) -> list:
        results = []
        for record in self._serving():
            with contextlib.suppress(EngineUnavailable):
                results.append(await call(self._remote(record)))
        return results


class RoutingMetrics:
    """What routing did, for the platform's ``/metrics`` (a registry per client)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.decisions = PromCounter(
            "loramux_routing_decisions",
            "Requests routed, by kind: affine (to an engine holding or sent the adapter), "
            "cold (no engine held it), spill (the load bound sent it from one that did), "
            "base (no adapter).",
            ["kind"],
            registry=self.registry,
        )
        self.failures = PromCounter(
            "loramux_engine_failures",
            "Engine failures seen by routing: unreachable (did not answer; the request went "
            "elsewhere) or lost (stopped during a request, which failed).",
            ["engine", "kind"],
            registry=self.registry,
        )
        self.retries = PromCounter(
            "loramux_routing_retries",
            "Requests sent again: to another engine (unreachable; lost_before_output: it "
            "went away before the request's first output) or after registering the adapter "
            "again with an engine that restarted (adapter_reregistered).",
            ["reason"],
            registry=self.registry,
        )
        # Known label values start at 0, so a dashboard sees the series before the first.
        for kind in ("affine", "cold", "spill", "base"):
            self.decisions.labels(kind)
        for reason in ("unreachable", "lost_before_output", "adapter_reregistered"):
            self.retries.labels(reason)
        self.registry_errors = PromCounter(
            "loramux_engine_registry_read_errors",
            "Reads of the engine registry in Redis that failed (routing used the last read).",
            registry=self.registry,
        )
