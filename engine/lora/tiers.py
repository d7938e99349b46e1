"""Adapters across three tiers: the store (source) → host RAM → device rows.

``AdapterTiers`` is the engine's registry of adapters and the mover between tiers. It is
used from the engine thread only (the loader thread hands results back through a queue):

* ``register(name, source)`` makes an adapter servable without loading anything;
* ``note_request(adapter_id)`` at a request's arrival counts where the adapter was found
  (hits and misses per tier) and, if it is in neither RAM nor the device, queues it for
  the background loader: adapters load in request arrival order (the prefetch order);
* ``poll()`` at the top of each step takes finished loads into the host cache and returns
  the adapters that failed (the engine fails the requests waiting for them; the adapter
  goes back to the store tier, so the next request retries);
* ``prepare(wanted, promise)`` before scheduling makes the adapters of the requests the
  next step could admit device-resident, in admission order, as far as the device pool has
  room that is not promised to requests' KV (``staging.py``; evicting idle adapters
  LRU-first); a request whose adapter is not on the device is simply not admitted yet, so
  a cold adapter never stalls the step;
* ``pin_running(running)`` after scheduling: the adapters of running requests are pinned
  (never evicted or moved), every other one is evictable.

``prepare`` also records the first adapter in admission order that is in host RAM but found
no room on the device: ``blocked_for_room`` (its id and rows) when KV blocks in use stand
where its rows must go, and the engine holds those blocks for it so that it gets room within
a bounded number of steps; ``short_of_kv`` when the memory it needs is promised to requests,
and it waits for them to finish (the scheduler's starvation guard bounds the wait).

What shows memory to be the limit is counted here (``Engine.stats().residency`` and
``/metrics``): device evictions, *re-loads* (an adapter back on the device after the device
evicted it) and the ``prepare`` passes, one a step, in which an adapter found no room.

Nothing here waits on storage: the only copies on the engine thread are host → device.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from loramux.engine.lora.adapter import LoRARequest
from loramux.engine.lora.host_cache import HostAdapterCache, HostCacheFull
from loramux.engine.lora.loader import AdapterLoader
from loramux.engine.lora.pool import LoRAPool, PoolFull
from loramux.engine.lora.source import AdapterSource
from loramux.engine.lora.staging import KVPromise
from loramux.engine.metrics import EngineMetrics
from loramux.engine.sequence import Sequence


class Tier(enum.StrEnum):
    """Where an adapter is now (the fastest tier holding it)."""

    DEVICE = "device"
    HOST = "host"
    LOADING = "loading"  # being fetched and parsed by the loader
    STORE = "store"  # only its source has it
    FAILED = "failed"  # its last load failed; the next request retries


# How a kept adapter's pin stands (``AdapterTiers.pin_states``); other states say why not.
PIN_HONOURED = "pinned"
PIN_LOADING = "loading"
PIN_WAITING = "waiting for device memory no request is promised"
# The most of the adapter rows pinned adapters may hold together: the rest stays for the
# adapters requests bring, however many pins tenants ask for.
MAX_PINNED_SHARE = 0.5


@dataclass
class RegisteredAdapter:
    request: LoRARequest
    source: AdapterSource
    failure: str | None = None  # the last load's error, until a retry starts


class AdapterTiers:
    def __init__(
        self,
        pool: LoRAPool,
        host: HostAdapterCache,
        loader: AdapterLoader,
        metrics: EngineMetrics,
    ):
        self.pool = pool
        self.host = host
        self.loader = loader
        self.metrics = metrics
        self._by_name: dict[str, RegisteredAdapter] = {}
        self._by_id: dict[int, RegisteredAdapter] = {}
        self._prepared: set[int] = set()  # held on the device for this step's admissions
        self._pinned: set[int] = set()  # used by running requests
        # Kept on the device whether requests use them or not (``keep``): adapter id -> how
        # its pin stands (``PIN_*``, or why it is not honoured).
        self._kept: dict[int, str] = {}
        # The first adapter of the last prepare() that was in RAM but found no device room:
        # (adapter id, rows it needs), or None.
        self.blocked_for_room: tuple[int, int] | None = None
        # The first adapter of the last prepare() in RAM whose room is KV promised to
        # requests (``staging.py``): it waits for requests to finish, holding nothing.
        self.short_of_kv: int | None = None
        # Since the start (for Engine.stats(); the metrics may be shared between engines):
        self.device_evictions = 0
        self.reloads = 0  # device loads of adapters the device had before and evicted
        self.room_wait_steps = 0  # prepare() passes in which an adapter found no room
        self._evicted: set[int] = set()  # evicted from the device, not loaded since
        pool.on_evict = self._device_evicted

    # --- registry ------------------------------------------------------------------------
    def register(self, request: LoRARequest, source: AdapterSource) -> None:
        entry = RegisteredAdapter(request=request, source=source)
        self._by_name[request.name] = entry
        self._by_id[request.adapter_id] = entry

    def unregister(self, name: str) -> LoRARequest:
        """Forget ``name`` and free its device rows and host memory (the caller checks that
        no request uses it)."""
        entry = self._by_name.pop(name)
        adapter_id = entry.request.adapter_id
        del self._by_id[adapter_id]
        self._kept.pop(adapter_id, None)
        self._evicted.discard(adapter_id)
        # No request uses it (the caller checked), so holds from the last step are stale.
        for holds in (self._pinned, self._prepared):
            if adapter_id in holds:
                holds.discard(adapter_id)
                self.pool.unpin(adapter_id)
        if self.pool.is_resident(adapter_id):
            self.pool.unload(adapter_id)
        self.host.remove(adapter_id)
        self._update_gauges()
        return entry.request

    def check_fits_device(self, name: str, rows: int) -> None:
        """``PoolFull`` if an adapter of ``rows`` rank-rows could never be device-resident."""
        if rows > self.pool.capacity:
            raise PoolFull(
                f"adapter {name!r} needs {rows} rows of device memory (its rank, a row "
                "for DoRA's scales if it has them, and those of the embedding and LM-head "
                f"rows it replaces) but at most "
                f"{self.pool.capacity} adapter rows fit beside the KV cache's floor; raise "
                "kv_cache_bytes (or adapter_device_bytes), or lower max_model_len"
            )

    def keep_in_host(self, adapter_id: int, weights) -> None:
        """Put already-parsed weights into the host tier (``Engine.add_adapter``)."""
        evicted = self.host.put(adapter_id, weights)
        self.metrics.adapter_evictions.labels(tier="host").inc(len(evicted))
        self.metrics.adapter_loads.inc()
        self._update_gauges()

    def get(self, name: str) -> LoRARequest | None:
        entry = self._by_name.get(name)
        return None if entry is None else entry.request

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def tier_of(self, adapter_id: int) -> Tier:
        if self.pool.is_resident(adapter_id):
            return Tier.DEVICE
        if adapter_id in self.host:
            return Tier.HOST
        if adapter_id in self.loader.pending():
            return Tier.LOADING
        entry = self._by_id.get(adapter_id)
        return Tier.FAILED if entry is not None and entry.failure else Tier.STORE

    def residency(self) -> dict[str, str]:
        """Adapter name -> the tier holding it (for routers and operators)."""
        return {
            name: self.tier_of(entry.request.adapter_id).value
            for name, entry in sorted(self._by_name.items())
        }

    # --- arrivals and loads --------------------------------------------------------------
    def note_request(self, adapter_id: int) -> None:
        """Count a request's lookup per tier and start loading a cold adapter."""
        m = self.metrics
        if self.pool.is_resident(adapter_id):
            m.adapter_hits.labels(tier="device").inc()
            return
        m.adapter_misses.labels(tier="device").inc()
        if adapter_id in self.host:
            m.adapter_hits.labels(tier="host").inc()
            return
        m.adapter_misses.labels(tier="host").inc()
        self._load(adapter_id)

    def _load(self, adapter_id: int) -> None:
        entry = self._by_id[adapter_id]
        entry.failure = None
        self.loader.submit(adapter_id, entry.source, name=entry.request.name)

    def poll(self) -> dict[int, str]:
        """Take finished loads into the host tier; adapter id -> error of the failed ones."""
        failed: dict[int, str] = {}
        for result in self.loader.poll():
            entry = self._by_id.get(result.adapter_id)
            if entry is None:  # unregistered while it loaded
                continue
            self.metrics.adapter_load_seconds.observe(result.seconds)
            error = result.error
            if error is None:
                try:
                    evicted = self.host.put(result.adapter_id, result.weights)
                except (ValueError, HostCacheFull) as exc:
                    error = f"adapter {entry.request.name!r} cannot be held in host memory: {exc}"
                else:
                    self.metrics.adapter_evictions.labels(tier="host").inc(len(evicted))
                    self.metrics.adapter_loads.inc()
            if error is not None:
                entry.failure = error
                failed[result.adapter_id] = error
        if failed or self.host.bytes_used:
            self._update_gauges()
        return failed

    # --- device residency ----------------------------------------------------------------
    def prepare(self, candidates: Iterable[Sequence], promise: KVPromise) -> dict[int, str]:
        """Make the adapters of ``candidates`` (the requests the next step could admit, in
        admission order) device-resident.

        An adapter may take KV blocks only beyond those ``promise`` keeps
        (``staging.py``): to protected running requests and to the candidates before it
        whose adapters are on the device; rows beyond come from idle adapters.
        An adapter made resident here stays pinned until ``pin_running`` (so a later one in
        the same pass cannot evict it). One missing from the host tier is (re)queued for
        loading. The first adapter in RAM that finds no room stops the pass (later ones
        wait too): ``blocked_for_room`` when blocks in use stand where its rows must go,
        ``short_of_kv`` when the memory is promised. Returns adapter id -> error for
        adapters that can never be on the device (larger than the pool can ever hold):
        their requests must fail, not wait forever.
        """
        never: dict[int, str] = {}
        self.blocked_for_room = None
        self.short_of_kv = None
        staged: set[int] = set()
        for seq in candidates:
            # A mix (lora/mix.py) is promised its blocks once all its parts are staged.
            if all(self._stage(a, seq, promise, never, staged) for a in seq.adapter_ids):
                promise.promise(seq)
        for adapter_id in self._kept:  # after the requests: a pin takes no promised memory
            self._kept[adapter_id] = self._stage_kept(adapter_id, promise, staged)
        if self.blocked_for_room is not None or self.short_of_kv is not None:
            # Its requests (and those of any adapter after it) sit out this step.
            self.room_wait_steps += 1
            self.metrics.adapter_room_wait_steps.inc()
        self._update_gauges()
        return never

    def _stage(
        self,
        adapter_id: int,
        seq: Sequence,
        promise: KVPromise,
        never: dict[int, str],
        staged: set[int],
    ) -> bool:
        """Make one of ``seq``'s adapters resident and pinned for the pass, if it can be
        now (see ``prepare``); whether it is."""
        if adapter_id in staged:
            return True
        if adapter_id not in self._by_id:
            return False
        if self.pool.is_resident(adapter_id):
            self.pool.touch(adapter_id)
        elif self._pass_full:  # an adapter before it found no room: later ones wait too
            return False
        else:
            weights = self.host.get(adapter_id)
            if weights is None:
                if adapter_id not in self.loader.pending() and not self._failed(adapter_id):
                    self._load(adapter_id)  # evicted from RAM while it waited
                return False
            try:
                self.check_fits_device(
                    self._by_id[adapter_id].request.name, self.pool.rows_for(weights)
                )
            except PoolFull as exc:
                never[adapter_id] = str(exc)
                return False
            floor = promise.kv_floor(seq)
            if not self._onto_device(adapter_id, weights, floor):
                if self._promised_away(self.pool.rows_for(weights), floor):
                    self.short_of_kv = adapter_id
                else:
                    self.blocked_for_room = (adapter_id, self.pool.rows_for(weights))
                return False
        self._hold_for_step(adapter_id, staged)
        return True

    @property
    def _pass_full(self) -> bool:
        """Whether an adapter of this ``prepare`` pass found no device room."""
        return self.blocked_for_room is not None or self.short_of_kv is not None

    def _onto_device(self, adapter_id: int, weights, kv_floor: int) -> bool:
        """Load the adapter's host weights onto the device, KV's limit staying at or above
        ``kv_floor``; whether it found room (a re-load is counted)."""
        self.host.pin(adapter_id)
        try:
            resident = self.pool.try_load(adapter_id, weights, kv_floor=kv_floor)
        finally:
            self.host.unpin(adapter_id)
        if resident is None:
            return False
        if adapter_id in self._evicted:
            self._evicted.discard(adapter_id)
            self.reloads += 1
            self.metrics.adapter_reloads.inc()
        return True

    def _hold_for_step(self, adapter_id: int, staged: set[int]) -> None:
        """Pinned until ``pin_running``: no later adapter of the pass evicts it."""
        self.pool.pin(adapter_id)
        self._prepared.add(adapter_id)
        staged.add(adapter_id)

    # --- pins: adapters kept on the device ------------------------------------------------
    def keep(self, adapter_id: int, keep: bool = True) -> None:
        """Keep the adapter on the device whether requests use it or not (``keep``), or no
        longer. A pin is honoured from the next step that finds room no request is
        promised, within ``MAX_PINNED_SHARE`` of the adapter rows; ``pin_states`` says how
        each stands. A kept adapter is never evicted."""
        if not keep:
            self._kept.pop(adapter_id, None)
            return
        if self._kept.get(adapter_id) != PIN_HONOURED:  # new, or tried again after a failure
            self._kept[adapter_id] = PIN_LOADING
            self.note_request(adapter_id)  # starts its load if it is cold

    def pins_pending(self) -> bool:
        """Whether a pin waits for a step to put it on the device (loading, or waiting for
        memory): an idle engine steps until none does."""
        return any(state in (PIN_LOADING, PIN_WAITING) for state in self._kept.values())

    def pin_states(self) -> dict[str, str]:
        """Each kept adapter's name -> ``pinned``, or why its pin is not honoured yet."""
        return {self._by_id[a].request.name: state for a, state in sorted(self._kept.items())}

    def _stage_kept(self, adapter_id: int, promise: KVPromise, staged: set[int]) -> str:
        """Put a kept adapter on the device if it is not, in memory no request is promised
        and within the pins' share; how its pin stands."""
        entry = self._by_id[adapter_id]
        if self.pool.is_resident(adapter_id):
            self.pool.touch(adapter_id)
            return PIN_HONOURED
        if entry.failure is not None:
            return f"failed: {entry.failure}"
        weights = self.host.get(adapter_id)
        if weights is None:
            if adapter_id not in self.loader.pending():
                self._load(adapter_id)  # evicted from RAM while it waited
            return PIN_LOADING
        rows = self.pool.rows_for(weights)
        try:
            self.check_fits_device(entry.request.name, rows)
        except PoolFull as exc:
            return f"too large: {exc}"
        kept_rows = sum(
            self.pool.rows_of(a) for a in self._kept if a != adapter_id and self.pool.is_resident(a)
        )
        share = int(self.pool.capacity * MAX_PINNED_SHARE)
        if kept_rows + rows > share:
            return (
                f"over the pins' share: it needs {rows} adapter rows, pinned adapters hold "
                f"{kept_rows} of the {share} pins may take ({MAX_PINNED_SHARE:.0%} of "
                f"{self.pool.capacity})"
            )
        if not self._onto_device(adapter_id, weights, promise.kv_floor_all()):
            return PIN_WAITING
        self._hold_for_step(adapter_id, staged)
        return PIN_HONOURED

    def _promised_away(self, rows: int, kv_floor: int) -> bool:
        """Whether an adapter of ``rows`` found no room because the KV it would take is
        promised (it would fit without ``kv_floor``, or the KV limit it needs is below it),
        rather than because blocks in use stand in the way."""
        if self.pool.could_fit(rows):
            return True
        limit = self.pool.kv_limit_needed(rows)
        return limit is not None and limit < kv_floor

    def _failed(self, adapter_id: int) -> bool:
        return self._by_id[adapter_id].failure is not None

    def pin_running(self, running_adapter_ids: Iterable[int]) -> None:
        """Pin exactly the adapters of running requests and the kept ones on the device
        (and release this step's holds)."""
        wanted = set(running_adapter_ids)
        wanted.update(a for a in self._kept if self.pool.is_resident(a))
        for adapter_id in self._prepared:
            self.pool.unpin(adapter_id)
        self._prepared = set()
        for adapter_id in wanted - self._pinned:
            self.pool.pin(adapter_id)
        for adapter_id in self._pinned - wanted:
            self.pool.unpin(adapter_id)
        self._pinned = wanted

    # --- bookkeeping ---------------------------------------------------------------------
    def _device_evicted(self, adapter_id: int) -> None:
        self.device_evictions += 1
        self._evicted.add(adapter_id)
        self.metrics.adapter_evictions.labels(tier="device").inc()

    def _update_gauges(self) -> None:
        m = self.metrics
        m.adapters_resident.labels(tier="device").set(len(self.pool.resident_ids()))
        m.adapter_bytes.labels(tier="device").set(self.pool.bytes_used)
        m.adapters_resident.labels(tier="host").set(len(self.host))
        m.adapter_bytes.labels(tier="host").set(self.host.bytes_used)
