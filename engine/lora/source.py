"""Where an adapter's two PEFT files come from, and a bounded local-disk copy of them.

The engine never reads a path a tenant chose: the platform hands it an
:class:`AdapterSource` per adapter. A source only produces a folder holding
``adapter_config.json`` and ``adapter_model.safetensors`` for the duration of a
``with`` block; parsing and validating the files is :func:`load_adapter`'s job.

- :class:`LocalDirectorySource`: a folder already on disk (tests, ``Engine.add_adapter``).
- :class:`CallableSource`: a ``fetch(dest)`` function (the platform's object store)
  writing the files into a private temporary folder that is removed afterwards.
- :class:`DiskCachedSource`: another source with a content id, served from an
  :class:`AdapterDiskCache` (bounded in bytes, least recently used evicted first).

Rules of the disk cache:

- An entry becomes visible only by renaming a complete staging folder into place, so
  a partial or failed copy is never served; leftovers of a crash are removed on the
  first use of the cache.
- An entry is never deleted while a ``materialize`` block is reading it; the cache may
  exceed its budget until those readers finish, and evicts then.
- An adapter larger than the whole budget is served straight from its source, uncached.
- Several threads asking for the same missing key fetch it once; the others wait and
  then read the entry (if that fetch failed, each waiter tries the source itself).
- One process owns a cache root (each engine process gets its own).
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from loramux.engine.lora.adapter import (
    CONFIG_FILE,
    PICKLE_FILE,
    WEIGHTS_FILE,
    LoRAWeights,
    load_adapter,
)
from loramux.engine.model.config import ModelConfig

ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)


class AdapterFetchError(RuntimeError):
    """The adapter's files could not be fetched (missing, corrupt, store unreachable).

    The message says which adapter source and why.
    """


class AdapterSource(abc.ABC):
    """Where one adapter's two PEFT files come from.

    The engine never reads a path a tenant chose; the platform gives it a
    store-backed source.
    """

    description: str  # for messages: store keys or a folder path
    cache_key: str | None  # a content id (e.g. the weights' sha256) if known, else None

    @abc.abstractmethod
    def materialize(self) -> contextlib.AbstractContextManager[Path]:
        """A folder holding ``adapter_config.json`` and ``adapter_model.safetensors``.

        The folder exists for the ``with`` block's duration (fetched into a private
        temporary folder if needed, removed after). Raises :class:`AdapterFetchError`
        when the files cannot be had; exceptions raised inside the block pass through.
        """

    def load(
        self, model_config: ModelConfig, *, name: str, max_rank: int, dtype: torch.dtype
    ) -> LoRAWeights:
        """The adapter's weights on the CPU, checked against ``model_config``: its files
        fetched (``materialize``) and parsed (``load_adapter``). A simulated source
        (``engine/simulation/adapters.py``) gives weights of the adapter's shapes instead,
        at the simulated time a fetch would take."""
        with self.materialize() as folder:
            return load_adapter(
                folder, model_config, name=name, max_rank=max_rank, dtype=dtype, device="cpu"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.description!r})"


def _check_files(folder: Path, description: str) -> None:
    """Raise AdapterFetchError naming the first adapter file missing from ``folder``."""
    for filename in ADAPTER_FILES:
        if (folder / filename).is_file():
            continue
        hint = ""
        if filename == WEIGHTS_FILE and (folder / PICKLE_FILE).exists():
            hint = f" ({PICKLE_FILE} is a pickle file and is refused; save with safetensors)"
        raise AdapterFetchError(f"{filename} is missing from adapter {description}{hint}")


class LocalDirectorySource(AdapterSource):
    """A folder already on disk; ``materialize`` yields it as is (nothing is copied)."""

    def __init__(self, path: str | Path, *, cache_key: str | None = None):
        self.path = Path(path)
        self.description = str(self.path)
        self.cache_key = cache_key

    @contextlib.contextmanager
    def materialize(self) -> Iterator[Path]:
        if not self.path.is_dir():
            raise AdapterFetchError(f"adapter directory {self.path} does not exist")
        _check_files(self.path, self.description)
        yield self.path


class CallableSource(AdapterSource):
    """Files written by ``fetch(dest)`` into a private temporary folder.

    This is how the platform plugs its object store in without the engine importing
    the platform. Any exception from ``fetch`` becomes an :class:`AdapterFetchError`
    naming this source and the cause. The folder (mode 0700, under ``tmp_root`` or the
    system temporary directory) is removed when the block ends, on error too.
    """

    def __init__(
        self,
        fetch: Callable[[Path], None],
        *,
        description: str,
        cache_key: str | None = None,
        tmp_root: str | Path | None = None,
    ):
        self._fetch = fetch
        self.description = description
        self.cache_key = cache_key
        self._tmp_root = None if tmp_root is None else Path(tmp_root)

    @contextlib.contextmanager
    def materialize(self) -> Iterator[Path]:
        with tempfile.TemporaryDirectory(prefix="loramux-adapter-", dir=self._tmp_root) as tmp:
            dest = Path(tmp)
            try:
                self._fetch(dest)
            except Exception as exc:
                raise AdapterFetchError(
                    f"could not fetch adapter {self.description}: {type(exc).__name__}: {exc}"
                ) from exc
            _check_files(dest, self.description)
            # Outside the try: an exception in the caller's block is not a fetch error.
            yield dest


@dataclass
class _Entry:
    path: Path
    nbytes: int
    readers: int = 0  # materialize blocks reading it now; never evicted while > 0


class AdapterDiskCache:
    """A bounded local-disk copy of adapters' files, keyed by content id, shared by sources.

    Layout: ``root/entries/<sha256 of key>/`` holds the two files; ``root/staging/``
    holds copies in progress. Least recently used entries (by last use; the entry
    folder's mtime carries the order across restarts) are evicted to keep the total
    under ``max_bytes``. Thread-safe. The disk is first read (index rebuilt, leftovers
    removed) on first use, not at construction.
    """

    def __init__(self, root: str | Path, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"disk cache max_bytes must be positive, got {max_bytes}")
        self.root = Path(root)
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recent first
        self._fetching: dict[str, threading.Event] = {}  # key digest -> set when done
        self._scanned = False
        self._bytes_used = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def bytes_used(self) -> int:
        with self._lock:
            self._scan_locked()
            return self._bytes_used

    def __len__(self) -> int:
        with self._lock:
            self._scan_locked()
            return len(self._entries)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            self._scan_locked()
            return _digest(key) in self._entries

    @contextlib.contextmanager
    def materialize(self, key: str, inner: AdapterSource) -> Iterator[Path]:
        """The cached folder for ``key``, filled from ``inner`` on a miss."""
        digest = _digest(key)
        while True:
            with self._lock:
                self._scan_locked()
                entry = self._take_locked(digest)
                if entry is not None:
                    self.hits += 1
                    break
                waiting = self._fetching.get(digest)
                if waiting is None:
                    self.misses += 1
                    done = self._fetching[digest] = threading.Event()
            if waiting is not None:
                waiting.wait()  # another thread is fetching this key: then read its entry
                continue
            try:
                entry, oversized = self._fill(digest, inner)
            finally:
                with self._lock:
                    del self._fetching[digest]
                done.set()
            if oversized is not None:
                stack, folder = oversized
                with stack:  # larger than the whole budget: serve uncached
                    yield folder
                return
            break
        try:
            yield entry.path
        finally:
            with self._lock:
                entry.readers -= 1
                self._evict_locked()

    def _fill(
        self, digest: str, inner: AdapterSource
    ) -> tuple[_Entry | None, tuple[contextlib.ExitStack, Path] | None]:
        """Copy ``inner``'s files into a new entry (returned with a reader held).

        Returns ``(None, (stack, folder))`` with ``inner`` still materialized in
        ``stack`` when the files exceed the whole budget.
        """
        stack = contextlib.ExitStack()
        try:
            folder = stack.enter_context(inner.materialize())
            nbytes = sum((folder / name).stat().st_size for name in ADAPTER_FILES)
            if nbytes > self._max_bytes:
                return None, (stack.pop_all(), folder)
            staging = self.root / "staging" / uuid.uuid4().hex
            try:
                staging.mkdir(parents=True)
                for name in ADAPTER_FILES:
                    _copy_durably(folder / name, staging / name)
                with self._lock:
                    return self._insert_locked(digest, staging, nbytes), None
            except OSError as exc:
                raise AdapterFetchError(
                    f"could not write adapter {inner.description} to the disk cache "
                    f"{self.root}: {exc}"
                ) from exc
            finally:
                shutil.rmtree(staging, ignore_errors=True)  # gone already unless it failed
        finally:
            stack.close()

    def _insert_locked(self, digest: str, staging: Path, nbytes: int) -> _Entry:
        path = self.root / "entries" / digest
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(path, ignore_errors=True)  # a stray, unindexed folder is never served
        os.rename(staging, path)  # the entry appears complete or not at all
        _touch(path)
        entry = self._entries[digest] = _Entry(path=path, nbytes=nbytes, readers=1)
        self._bytes_used += nbytes
        self._evict_locked()
        return entry

    def _take_locked(self, digest: str) -> _Entry | None:
        """The entry, marked most recently used with a reader held; None on a miss."""
        entry = self._entries.get(digest)
        if entry is None:
            return None
        if not all((entry.path / name).is_file() for name in ADAPTER_FILES):
            self._drop_locked(digest)  # deleted behind our back: refetch
            return None
        self._entries.move_to_end(digest)
        entry.readers += 1
        with contextlib.suppress(OSError):
            _touch(entry.path)
        return entry

    def _evict_locked(self) -> None:
        for digest in list(self._entries):
            if self._bytes_used <= self._max_bytes:
                return
            if self._entries[digest].readers == 0:
                self._drop_locked(digest)
                self.evictions += 1

    def _drop_locked(self, digest: str) -> None:
        entry = self._entries.pop(digest)
        self._bytes_used -= entry.nbytes
        shutil.rmtree(entry.path, ignore_errors=True)

    def _scan_locked(self) -> None:
        """Index the entries on disk (oldest mtime first); remove partial leftovers."""
        if self._scanned:
            return
        self._scanned = True
        shutil.rmtree(self.root / "staging", ignore_errors=True)
        entries_dir = self.root / "entries"
        if not entries_dir.is_dir():
            return
        found = []
        for path in entries_dir.iterdir():
            files = [path / name for name in ADAPTER_FILES]
            if not path.is_dir() or not all(f.is_file() for f in files):
                _remove(path)
                continue
            found.append((path.stat().st_mtime_ns, path, sum(f.stat().st_size for f in files)))
        for _, path, nbytes in sorted(found):
            self._entries[path.name] = _Entry(path=path, nbytes=nbytes)
            self._bytes_used += nbytes
        self._evict_locked()  # the budget may have shrunk since the last run


class DiskCachedSource(AdapterSource):
    """Another source served through a shared :class:`AdapterDiskCache`.

    The inner source must have a ``cache_key`` (a content id): a hit yields the cached
    folder without touching the inner source; a miss materializes it once and copies
    the files into the cache.
    """

    def __init__(self, inner: AdapterSource, cache: AdapterDiskCache):
        if inner.cache_key is None:
            raise ValueError(f"{inner!r} has no cache_key; it cannot be disk-cached")
        self.inner = inner
        self.cache = cache
        self.description = inner.description
        self.cache_key = inner.cache_key

    def materialize(self) -> contextlib.AbstractContextManager[Path]:
        return self.cache.materialize(self.cache_key, self.inner)


def _digest(key: str) -> str:
    # Any string may be a key; its hash is a safe, fixed-length folder name.
    return hashlib.sha256(key.encode()).hexdigest()


def _touch(path: Path) -> None:
    # An explicit nanosecond stamp: the kernel's own mtimes are only as fine as a clock
    # tick, which would tie entries used in quick succession.
    now = time.time_ns()
    os.utime(path, ns=(now, now))


def _copy_durably(src: Path, dst: Path) -> None:
    # fsync before the rename, so a crash cannot leave a complete-looking empty entry.
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
        fout.flush()
        os.fsync(fout.fileno())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


__all__ = [
    "ADAPTER_FILES",
    "AdapterDiskCache",
    "AdapterFetchError",
    "AdapterSource",
    "CallableSource",
    "DiskCachedSource",
    "LocalDirectorySource",
]
