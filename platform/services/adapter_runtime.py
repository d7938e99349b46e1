"""Making a ready adapter version servable by the engine, from the object store.

The engine knows an adapter version by its id (``AdapterVersion.id``), never by the
tenant's name for it: names are per tenant and re-uploads make new versions. A version
is *registered* with the engine on its first request, with a source that reads its two
files from the object store (checksums verified): no I/O happens on the request path.
The engine's loader thread fetches it when a request needs it and keeps it in its host
and device tiers while it is used; a fetch that fails (store unreachable, object missing
or corrupt) fails the requests waiting for it, and the next request retries.

Of an adapter's registered versions, those below the highest are *retiring*: an older
version is reached only by a request that names it (``name@3``, ``adapter_refs``) or
that resolved it just before the newer one was registered. A retiring version is
unregistered once no request has asked for it for ``SUPERSEDED_GRACE_S`` (longer than a
request takes from resolving its version to reaching the engine) and none uses it; a
request that names it meanwhile keeps it registered. Without this, every re-upload would
leave one more registration behind for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from loramux.engine import EngineError, UnknownAdapter
from loramux.platform.context import PlatformContext
from loramux.platform.db.models import AdapterStatus, AdapterVersion
from loramux.platform.engine_fleet.stored_adapter import StoredAdapter

logger = logging.getLogger(__name__)

REMOVAL_RETRY_S = 0.5  # how often a deleted adapter still in use is tried again
# How long a superseded version stays registered: longer than a request takes from
# resolving its version to reaching the engine (a few database round trips).
SUPERSEDED_GRACE_S = 30.0


class AdapterNotServable(RuntimeError):
    """The version is not ready, or its files could not be loaded."""


class AdapterRuntime:
    """Registers adapter versions with one engine, once each, whatever the concurrency.

    It remembers what it registered rather than asking the engine on every request: the
    engine forgets an adapter only when told to (``unload``), and this is the only caller
    that tells.
    """

    def __init__(self, context: PlatformContext):
        self._context = context
        self._locks: dict[str, asyncio.Lock] = {}
        self._loaded: set[str] = set()
        self._adapter_of: dict[str, str] = {}  # registered engine name -> its adapter's id
        self._number_of: dict[str, int] = {}  # registered engine name -> its version number
        self._retiring: set[str] = set()  # superseded: still registered, removal pending
        self._asked_at: dict[str, float] = {}  # engine name -> when a request last asked
        self._pending_removals: set[asyncio.Task] = set()  # deletes waiting for requests
        self._kept: set[str] = set()  # pinned on the engines: never retired

    @staticmethod
    def engine_name(version: AdapterVersion) -> str:
        return version.id

    async def ensure_loaded(self, version: AdapterVersion) -> str:
        """The engine's name for ``version``, registering it first if needed."""
        engine = self._context.engine
        if engine is None:
            raise AdapterNotServable("no engine is running in this process")
        if version.status != AdapterStatus.READY:
            raise AdapterNotServable(f"adapter version {version.id} is {version.status}")
        name = self.engine_name(version)
        self._asked_at[name] = time.monotonic()
        if name in self._loaded or name in self._retiring:
            return name
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            if name in self._loaded:  # another request registered it while this one waited
                return name
            if not version.weights_store_key or not version.config_store_key:
                raise AdapterNotServable(f"adapter version {version.id} has no stored files")
            stored = StoredAdapter(
                config_key=version.config_store_key,
                weights_key=version.weights_store_key,
                sha256=version.sha256,
                description=f"version {version.id}",
            )
            await engine.register_stored_adapter(name, stored)
            self._loaded.add(name)
            self._adapter_of[name] = version.adapter_id
            self._number_of[name] = version.version
        self._retire_superseded(engine, version.adapter_id)
        return name

    def _retire_superseded(self, engine, adapter_id: str) -> None:
        """Schedule the removal of the adapter's registered versions below its highest."""
        mine = [n for n, a in self._adapter_of.items() if a == adapter_id]
        newest = max(mine, key=self._number_of.__getitem__)
        for old in mine:
            if old != newest and old not in self._kept:
                self._forget(old)
                self._retiring.add(old)
                self._remove_later(engine, old, delay=SUPERSEDED_GRACE_S, unasked=True)

    def _forget(self, name: str) -> None:
        self._loaded.discard(name)
        self._locks.pop(name, None)
        self._adapter_of.pop(name, None)
        self._number_of.pop(name, None)

    def _remove_later(self, engine, name: str, *, delay: float, unasked: bool = False) -> None:
        """Unregister ``name`` after ``delay`` once no request uses it (``unasked``: and none
        has asked for it for ``delay``)."""
        asked_at = self._asked_at.get if unasked else None
        task = asyncio.create_task(
            self._remove_when_idle(
                engine, name, delay=delay, asked_at=asked_at, kept=self._kept.__contains__
            )
        )
        self._pending_removals.add(task)
        task.add_done_callback(self._pending_removals.discard)
        task.add_done_callback(lambda _: self._retiring.discard(name))
        task.add_done_callback(lambda _: self._asked_at.pop(name, None))

    # --- pins ---------------------------------------------------------------------------
    async def pin(self, version: AdapterVersion) -> str:
        """Register ``version`` and have the engines keep it on the device (never evicted,
        never retired); its engine name."""
        name = await self.ensure_loaded(version)
        self._kept.add(name)
        if name in self._retiring:  # superseded, its removal pending: registered it stays
            self._loaded.add(name)
            self._adapter_of[name] = version.adapter_id
            self._number_of[name] = version.version
        await self._context.engine.keep_adapter(name, True)
        return name

    async def unpin(self, version: AdapterVersion) -> None:
        """Let the engines evict ``version`` again (and retire it, if it is superseded)."""
        engine, name = self._context.engine, self.engine_name(version)
        if engine is None or name not in self._kept:
            return
        self._kept.discard(name)
        with contextlib.suppress(UnknownAdapter):
            await engine.keep_adapter(name, False)
        if name in self._loaded:
            self._retire_superseded(engine, version.adapter_id)

    async def pin_states(self) -> dict[str, str]:
        """Engine name -> how its pin stands on the engines (``pinned``, or why not)."""
        engine = self._context.engine
        return {} if engine is None else await engine.pinned_adapters()

    async def restore_pins(self, versions: list[AdapterVersion]) -> None:
        """Pin ``versions`` (the stored pins) on engines that start without them; one that
        cannot be registered is logged and left: its page says it is not held."""
        for version in versions:
            try:
                await self.pin(version)
            except (AdapterNotServable, EngineError) as exc:
                logger.warning("pinned adapter version %s not restored: %s", version.id, exc)

    async def unload(self, version: AdapterVersion) -> None:
        """Unregister ``version`` from the engine, freeing its memory; if requests still use
        it, once they have ended (no new request can reach a deleted adapter)."""
        engine = self._context.engine
        name = self.engine_name(version)
        self._kept.discard(name)
        if engine is not None and name in self._loaded:
            self._forget(name)
            self._asked_at.pop(name, None)
            try:
                await engine.remove_adapter(name)
            except EngineError:  # in use by running or queued requests
                self._remove_later(engine, name, delay=REMOVAL_RETRY_S)

    @staticmethod
    async def _remove_when_idle(
        engine, name: str, *, delay: float, asked_at=None, kept=lambda _: False
    ) -> None:
        await asyncio.sleep(delay)
        while True:
            if kept(name):  # pinned meanwhile: it stays
                return
            if asked_at is not None:
                quiet = time.monotonic() - asked_at(name, 0.0)
                if quiet < delay:  # asked for again: wait until it has been quiet as long
                    await asyncio.sleep(delay - quiet)
                    continue
            try:
                await engine.remove_adapter(name)
                return
            except UnknownAdapter:  # removed already
                return
            except EngineError:  # in use (AdapterInUse)
                pass
            await asyncio.sleep(REMOVAL_RETRY_S)
