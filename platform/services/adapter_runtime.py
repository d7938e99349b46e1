"""Getting a ready adapter version into the engine, from the object store.

The engine knows an adapter version by its id (``AdapterVersion.id``), never by the
tenant's name for it: names are per tenant and re-uploads make new versions. The
files are read back from the store (checksums verified) into a temporary folder,
loaded (the engine copies the weights into its pool), and the folder is removed.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from starlette.concurrency import run_in_threadpool

from loramux.engine.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from loramux.platform.context import PlatformContext
from loramux.platform.db.models import AdapterStatus, AdapterVersion


class AdapterNotServable(RuntimeError):
    """The version is not ready, or its files could not be loaded."""


class AdapterRuntime:
    """Loads adapter versions into one engine, once each, whatever the concurrency.

    It remembers what it loaded rather than asking the engine on every request: the engine
    drops an adapter only when told to (``unload``), and this is the only caller that tells.
    """

    def __init__(self, context: PlatformContext):
        self._context = context
        self._locks: dict[str, asyncio.Lock] = {}
        self._loaded: set[str] = set()

    @staticmethod
    def engine_name(version: AdapterVersion) -> str:
        return version.id

    async def ensure_loaded(self, version: AdapterVersion) -> str:
        """The engine's name for ``version``, loading it first if needed."""
        engine = self._context.engine
        if engine is None:
            raise AdapterNotServable("no engine is running in this process")
        if version.status != AdapterStatus.READY:
            raise AdapterNotServable(f"adapter version {version.id} is {version.status}")
        name = self.engine_name(version)
        if name in self._loaded:
            return name
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            if name in self._loaded:  # another request loaded it while this one waited
                return name
            with tempfile.TemporaryDirectory(prefix="loramux-adapter-") as folder:
                await run_in_threadpool(self._fetch, version, Path(folder))
                await engine.add_adapter(name, folder)
            self._loaded.add(name)
        return name

    async def unload(self, version: AdapterVersion) -> None:
        engine = self._context.engine
        name = self.engine_name(version)
        if engine is not None and name in self._loaded:
            self._loaded.discard(name)
            self._locks.pop(name, None)
            await engine.remove_adapter(name)

    def _fetch(self, version: AdapterVersion, folder: Path) -> None:
        if not version.weights_store_key or not version.config_store_key:
            raise AdapterNotServable(f"adapter version {version.id} has no stored files")
        store = self._context.store
        store.read_to(version.config_store_key, folder / CONFIG_FILE)
        store.read_to(version.weights_store_key, folder / WEIGHTS_FILE)
