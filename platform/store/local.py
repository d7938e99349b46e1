"""The local-directory object store: the embedded default.

Layout under ``root``: each object is the file ``root/<key>`` (``root/sha256/ab/ab…``, or
``root/billing/…`` for a named object); puts in progress are files in ``root/tmp/``. A put writes a fresh temporary file there,
fsyncs it, ``os.replace``-s it onto the object's path (an atomic rename: ``tmp/`` is on the
same filesystem) and fsyncs the object's directory, so an object path only ever holds a
complete file. A put that fails removes its temporary file; only a process killed mid-put can
leave one behind in ``tmp/`` (safe to delete when no put is running).

Putting content that is already stored replaces the file with the identical new copy (the
rename is atomic), which also repairs a copy that had been corrupted on disk. A named put
goes the same way, renamed onto ``root/<name>``: a reader never sees a half-written file.
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
    check_key,
    check_named_key,
    check_sha256,
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
        """Where the object with ``key`` (a content address or a name) lives, if it exists."""
        check_key(key)  # validates: no key can point outside the root
        return self.root / key

    def _unavailable(self, exc: OSError) -> StoreUnavailable:
        self.failures += 1
        return StoreUnavailable(f"local object store at {self.root} failed: {exc}")

    @contextlib.contextmanager
    def _disk_errors(self) -> Iterator[None]:
        """Report the filesystem's errors as :class:`StoreUnavailable` naming the root."""
        try:
            yield
        except OSError as exc:
            raise self._unavailable(exc) from exc

    def _put(self, source: Source, max_bytes: int | None, name: str | None) -> StoredObject:
        """Write ``source`` to a temporary file, then rename it onto its key's path."""
        hasher = ContentHasher(max_bytes)

        def copy(out: BinaryIO) -> Path:
            for chunk in iter_chunks(source):  # the source's own errors pass through
                hasher.update(chunk)
                with self._disk_errors():
                    out.write(chunk)
            return self.root / hasher.result(name).key

        write_atomically(self.root / TMP_DIR, "put-", copy, disk_errors=self._disk_errors)
        return hasher.result(name)

    def put_stream(self, source: Source, *, max_bytes: int | None = None) -> StoredObject:
        return self._put(source, max_bytes, None)

    def put_named(self, key: str, source: Source, *, max_bytes: int | None = None) -> StoredObject:
        return self._put(source, max_bytes, check_named_key(key))

    def _reader(self, key: str, sha256: str | None) -> VerifyingReader:
        path = self.root / key  # the caller validated the key
        try:
            handle = path.open("rb", buffering=0)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFound(key) from None
        except OSError as exc:
            raise self._unavailable(exc) from exc
        try:
            return VerifyingReader(key, handle, sha256)
        except BaseException:
            handle.close()
            raise

    def open(self, key: str) -> VerifyingReader:
        sha256_of_key(key)
        return self._reader(key, None)

    def open_named(self, key: str, sha256: str) -> VerifyingReader:
        return self._reader(check_named_key(key), check_sha256(sha256))

    def exists(self, key: str) -> bool:
        return self.path_of(key).is_file()

    def size(self, key: str) -> int:
        path = self.path_of(key)
        try:
            return path.stat().st_size
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFound(key) from None
        except OSError as exc:
            raise self._unavailable(exc) from exc

    def delete(self, key: str) -> None:
        path = self.path_of(key)
        with self._disk_errors():
            try:
                path.unlink()
            except (FileNotFoundError, NotADirectoryError):
                return
            fsync_directory(path.parent)
