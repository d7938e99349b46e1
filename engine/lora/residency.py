"""Adapter residency: one owner for where every adapter is and the policy that moves it.

Adapters live in three tiers (``tiers.py``): registered ones in their source (the object
store, through an optional local disk cache), recently used ones in host RAM, the ones in
use on the device, in rows of the memory they share with the KV cache (``pool.py``). A
request for a cold adapter waits in the queue while a background thread loads it; the
steps go on meanwhile.

Before each step :meth:`AdapterResidency.take_loads` takes finished loads into RAM, and
:meth:`AdapterResidency.prepare` makes device-resident the adapters of the waiting requests
the next step could admit (``Scheduler.admission_candidates``), in admission order, where
there is room that is not promised to requests' KV (``staging.py``). When the first adapter
that found no room is in RAM and its memory is promised, the scheduler is told through
:meth:`waits_for_kv`: its request waits for running ones to finish, and the starvation guard
(scheduler policy 4) stops other admissions once it has waited ``adapter_wait_steps``. When
instead KV blocks in use stand where its rows must go, those blocks are held for it
(``KVCacheManager.hold_from``) and the scheduler is told through :meth:`room_wanted` (it
moves the blocks in use below, and preempts for them once the adapter has waited
``adapter_wait_steps``; scheduler policy 5).
When the next step's KV blocks are short, idle adapters give rows back to KV. After the
step, exactly the running requests' adapters stay pinned.

The scheduler sees only ``is_ready``, ``waits_for_kv`` and ``room_wanted`` (its ``AdapterGate``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from loramux.engine.clock import Clock, WallClock
from loramux.engine.config_parts import LoRAConfig
from loramux.engine.errors import AdapterInUse, EngineError, UnknownAdapter
from loramux.engine.lora.adapter import LoRARequest, load_adapter
from loramux.engine.lora.host_cache import HostAdapterCache, HostCacheFull
from loramux.engine.lora.loader import AdapterLoader
from loramux.engine.lora.pool import LoRAPool
from loramux.engine.lora.source import (
    AdapterDiskCache,
    AdapterSource,
    DiskCachedSource,
    LocalDirectorySource,
)
from loramux.engine.lora.staging import KVPromise
from loramux.engine.lora.tiers import AdapterTiers
from loramux.engine.memory.kv_cache import KVCacheManager
from loramux.engine.metrics import EngineMetrics
from loramux.engine.model.config import ModelConfig
from loramux.engine.residency import ResidencyCounts, ResidencyWatch
from loramux.engine.scheduler import AdapterRoom
from loramux.engine.sequence import Sequence

logger = logging.getLogger("loramux.engine.engine")  # its lines are the engine's


class AdapterResidency:
    """Tiers, device pool, host cache, loads, pins and the room-for-an-adapter policy."""

    def __init__(
        self,
        model_config: ModelConfig,  # the whole model's (adapters are parsed against it)
        pool: LoRAPool,
        kv: KVCacheManager,
        metrics: EngineMetrics,
        lora: LoRAConfig,
        *,
        dtype: torch.dtype,
        pin_memory: bool,  # host copies pinned, for asynchronous copies to a GPU
        advice: str,  # what to change when adapters thrash (the memory plan's)
        clock: Clock | None = None,  # the engine's (its per-minute figures are in its time)
    ):
        self.pool, self.kv, self.metrics = pool, kv, metrics
        self._model_config, self._dtype, self._max_rank = model_config, dtype, lora.max_lora_rank
        self.tiers = AdapterTiers(
            pool,
            HostAdapterCache(lora.adapter_host_bytes),
            AdapterLoader(
                model_config,
                dtype=dtype,
                max_rank=lora.max_lora_rank,
                pin_memory=pin_memory,
                workers=lora.adapter_load_workers,
            ),
            metrics,
        )
        self._disk_cache = None  # sources with a content id cached on local disk
        if lora.adapter_disk_cache_dir is not None:
            self._disk_cache = AdapterDiskCache(
                Path(lora.adapter_disk_cache_dir), lora.adapter_disk_cache_bytes
            )
        self._adapter_ids = itertools.count(1)
        self._room: AdapterRoom | None = None
        # Evictions, re-loads and room waits watched; the thrash warning says what to do.
        self.watch = ResidencyWatch(advice=advice, log=logger, clock=(clock or WallClock()).now)

    # --- the registry ------------------------------------------------------------------
    def add(self, name: str, path: str | Path) -> LoRARequest:
        """The PEFT adapter in folder ``path``, parsed now into the host tier (a bad one is
        refused here, with the reason), servable under ``name``."""
        self._check_new_name(name)
        weights = load_adapter(  # AdapterError (a ValueError) says what is wrong
            path,
            self._model_config,
            name=name,
            max_rank=self._max_rank,
            dtype=self._dtype,
            device="cpu",
        )
        self.tiers.check_fits_device(name, self.pool.rows_for(weights))
        request = self._new(name, LocalDirectorySource(Path(path)))
        try:
            self.tiers.keep_in_host(request.adapter_id, weights)
        except (ValueError, HostCacheFull) as exc:
            self.tiers.unregister(name)
            raise EngineError(f"adapter {name!r} cannot be held in host memory: {exc}") from exc
        return request

    def register(self, name: str, source: AdapterSource) -> LoRARequest:
        """``name`` servable from ``source``, loaded at its first request (through the disk
        cache, when there is one and the source has a content id)."""
        self._check_new_name(name)
        if self._disk_cache is not None and source.cache_key is not None:
            source = DiskCachedSource(source, self._disk_cache)
        return self._new(name, source)

    def remove(self, name: str, users: int) -> None:
        """Forget ``name`` (its device rows and host memory freed); ``users``: the requests
        that use it now, which must be none."""
        if self.tiers.get(name) is None:
            raise UnknownAdapter(f"adapter {name!r} is not loaded")
        if users:
            raise AdapterInUse(
                f"adapter {name!r} is in use by {users} request(s); abort or finish them first"
            )
        self.tiers.unregister(name)

    def get(self, name: str) -> LoRARequest | None:
        return self.tiers.get(name)

    def names(self) -> list[str]:
        return self.tiers.names()

    def residency(self) -> dict[str, str]:
        """Adapter name -> the tier holding it: device, host, loading, store or failed."""
        return self.tiers.residency()

    def keep(self, name: str, keep: bool = True) -> None:
        """Pin ``name`` on the device, or unpin it (``AdapterTiers.keep``)."""
        lora = self.tiers.get(name)
        if lora is None:
            raise UnknownAdapter(f"adapter {name!r} is not loaded")
        self.tiers.keep(lora.adapter_id, keep)

    def pin_states(self) -> dict[str, str]:
        return self.tiers.pin_states()

    def pins_pending(self) -> bool:
        return self.tiers.pins_pending()

    def note_request(self, lora: LoRARequest) -> None:
        """A request for ``lora`` arrived: counted per tier, a cold adapter starts loading."""
        self.tiers.note_request(lora.adapter_id)

    def _check_new_name(self, name: str) -> None:
        if self.tiers.get(name) is not None:
            raise EngineError(f"adapter {name!r} is already loaded; remove it first")

    def _new(self, name: str, source: AdapterSource) -> LoRARequest:
        request = LoRARequest(
            name=name, adapter_id=next(self._adapter_ids), source=source.description
        )
        self.tiers.register(request, source)
        return request

    # --- before a step -------------------------------------------------------------------
    def take_loads(self) -> dict[int, str]:
        """Finished loads into the host tier; adapter id -> error of those that failed."""
        return self.tiers.poll()

    def prepare(
        self,
        candidates: list[Sequence],
        running: list[Sequence],
        next_step: int,
        weights: Mapping[str | None, float],
    ) -> dict[int, str]:
        """Make the adapters of ``candidates`` (the waiting requests the next step could
        admit, in admission order) device-resident where there is room not promised to
        requests' KV (``staging.py``), hold KV blocks for the first that found blocks in use
        in its way, and let idle adapters give rows back when the next step's blocks are
        short. Returns adapter id -> why, for adapters that can never be on the device
        (their requests must fail, not wait forever). ``next_step``: the scheduler's number
        for the coming step (a wait counts from it); ``weights``: the tenants' fair-share
        weights (1 for one not listed)."""
        promise = KVPromise(self.kv, running, candidates, weights)
        never = self.tiers.prepare(candidates, promise)
        self._hold_room(candidates, running, promise, next_step)
        self._give_kv_room(candidates, running)
        return never

    def _hold_room(
        self,
        waiting: list[Sequence],
        running: list[Sequence],
        promise: KVPromise,
        next_step: int,
    ) -> None:
        """Hold the KV blocks where the first adapter that found no device room must go,
        and name the running requests that may be preempted for it: those whose blocks are
        not promised against its first request (``KVPromise.protects``)."""
        blocked = self.tiers.blocked_for_room
        limit = None if blocked is None else self.pool.kv_limit_needed(blocked[1])
        first = None
        if limit is not None:
            first = next((s for s in waiting if blocked[0] in s.adapter_ids), None)
        if first is None:
            self.kv.release_hold()
            self._room = None
        else:
            since = next_step
            if self._room is not None and self._room.adapter_id == blocked[0]:
                since = self._room.since_step
            self.kv.hold_from(limit)
            preemptible = frozenset(
                s.request_id for s in running if not promise.protects(s.priority, s.tenant, first)
            )
            self._room = AdapterRoom(blocked[0], limit, preemptible, since)
        self.metrics.kv_blocks_held.set(self.kv.num_held_blocks)

    def _give_kv_room(self, waiting: list[Sequence], running: list[Sequence]) -> None:
        """Let KV take rows back from idle adapters when the next step's blocks are short:
        the running requests' next tokens plus the first admissible waiting prompt."""
        size = self.kv.block_size
        needed = sum(1 for seq in running if seq.num_computed_tokens % size == 0)
        for seq in waiting:
            if all(self.pool.is_resident(a) for a in seq.adapter_ids):
                needed += -(-seq.num_tokens // size)
                break
        short = needed - self.kv.num_free_blocks
        if short > 0:
            self.pool.release_for_kv(short)

    # --- the scheduler's gate ------------------------------------------------------------
    def is_ready(self, adapter_id: int) -> bool:
        return self.pool.is_resident(adapter_id)

    def not_mixable(self, adapter_id: int) -> str | None:
        """Why the adapter cannot be part of a mix, once it is on the device (None before,
        and for plain LoRA)."""
        return self.pool.not_mixable(adapter_id) if self.pool.is_resident(adapter_id) else None

    def room_wanted(self) -> AdapterRoom | None:
        return self._room

    def waits_for_kv(self, adapter_id: int) -> bool:
        return self.tiers.short_of_kv == adapter_id

    # --- after scheduling ----------------------------------------------------------------
    def pin_running(self, running: Iterable[Sequence]) -> None:
        """Pin exactly the running requests' adapters (finished ones hold theirs no more)."""
        self.tiers.pin_running(a for s in running for a in s.adapter_ids)

    def observe(self, preemptions: int) -> None:
        """Feed the watch this step's counts (the thrash warning reads them)."""
        self.watch.observe(self.counts(preemptions))

    def counts(self, preemptions: int) -> ResidencyCounts:
        return ResidencyCounts(
            preemptions=preemptions,
            adapter_evictions=self.tiers.device_evictions,
            adapter_reloads=self.tiers.reloads,
            adapter_room_wait_steps=self.tiers.room_wait_steps,
        )

    def wait_for_load(self, timeout: float) -> None:
        """With loads in flight, wait up to ``timeout`` for one (nothing else can run)."""
        if self.tiers.loader.pending():
            self.tiers.loader.wait(timeout=timeout)

    def close(self) -> None:
        """Stop the loader threads (queued loads are dropped)."""
        self.tiers.loader.close()
