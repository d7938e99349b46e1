"""The local-directory object store: the embedded default.

Layout under ``root``: each object is the file ``root/<key>`` (``root/sha256/ab/ab…``);
puts in progress are files in ``root/tmp/``. A put writes a fresh temporary file there,
fsyncs it, ``os.replace``-s it onto the object's path (an atomic rename: ``tmp/`` is on the
same filesystem) and fsyncs the object's directory, so an object path only ever holds a
complete file. A put that fails removes its temporary file; only a process killed mid-put can
leave one behind in ``tmp/`` (safe to delete when no put is running).

Putting content that is already stored replaces the file with the identical new copy (the
rename is atomic), which also repairs a copy that had been corrupted on disk.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from loramux.platform.store.base import (
    ContentHasher,
    ObjectNotFound,
    ObjectStore,
    Source,
    StoredObject,
    StoreUnavailable,
    VerifyingReader,
    fsync_directory,
    iter_chunks,
    sha256_of_key,
    write_atomically,
)

TMP_DIR = "tmp"
"""Subdirectory of the root holding puts in progress."""


class LocalObjectStore(ObjectStore):
    """Objects as files under ``root`` (created on the first put)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"LocalObjectStore({str(self.root)!r})"

    def path_of(self, key: str) -> Path:
        """Where the object with ``key`` lives (whether or not it exists)."""
        sha256_of_key(key)  # validates: no key can point outside the root
        return self.root / key

    @contextlib.contextmanager
    def _disk_errors(self) -> Iterator[None]:
        """Report the filesystem's errors as :class:`StoreUnavailable` naming the root."""
        try:
            yield
        except OSError as exc:
            raise StoreUnavailable(f"local object store at {self.root} failed: {exc}") from exc

    def put_stream(self, source: Source, *, max_bytes: int | None = None) -> StoredObject:
        hasher = ContentHasher(max_bytes)

        def copy(out: BinaryIO) -> Path:
            for chunk in iter_chunks(source):  # the source's own errors pass through
                hasher.update(chunk)
                with self._disk_errors():
                    out.write(chunk)
            return self.root / hasher.result().key

        write_atomically(self.root / TMP_DIR, "put-", copy, disk_errors=self._disk_errors)
        return hasher.result()

    def open(self, key: str) -> VerifyingReader:
        path = self.path_of(key)
        try:
            handle = path.open("rb", buffering=0)
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFound(key) from None
        except OSError as exc:
            raise StoreUnavailable(f"local object store at {self.root} failed: {exc}") from exc
        return VerifyingReader(key, handle)

    def exists(self, key: str) -> bool:
        return self.path_of(key).is_file()

    def size(self, key: str) -> int:
        path = self.path_of(key)
        try:
            return path.stat().st_size
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFound(key) from None
        except OSError as exc:
            raise StoreUnavailable(f"local object store at {self.root} failed: {exc}") from exc

    def delete(self, key: str) -> None:
        path = self.path_of(key)
        with self._disk_errors():
            try:
                path.unlink()
            except (FileNotFoundError, NotADirectoryError):
                return
            fsync_directory(path.parent)
