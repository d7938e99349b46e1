"""The adapter object store: durable, content-addressed blobs, verified when read back.

Semantics every backend keeps (``tests/platform/store`` runs one contract suite on all):

* **Keys are content addresses.** An object's key is ``sha256/<hex[:2]>/<hex>`` where
  ``hex`` is the lowercase SHA-256 of its bytes (:func:`key_for`). :meth:`ObjectStore.put_stream`
  puts bytes and is told the key. Keys of any other shape raise :class:`InvalidKey` (so a
  key can never escape the store, e.g. with ``..``).
* **Named objects** are the one exception: :meth:`ObjectStore.put_named` stores bytes under
  a key the caller chooses (:func:`check_named_key`: lowercase path segments such as
  ``billing/2026-11-24.by-request.csv``, nothing under ``sha256/`` or ``tmp/``), for files
  people look for by name (billing exports). The put keeps every guarantee below: it
  streams, is all or nothing, and an object already under the name is replaced whole (a
  reader sees the old bytes or the new ones, never a mix). The key names no digest, so the
  caller records the returned ``sha256`` and reads back with
  :meth:`ObjectStore.open_named`, which verifies against it. ``exists``, ``size`` and
  ``delete`` take either kind of key.
* **Puts stream.** :meth:`ObjectStore.put_stream` takes an iterable of ``bytes`` chunks or a
  binary file object and passes the bytes to the backend while hashing them; memory stays
  bounded by a chunk (local) or an upload part (S3), whatever the object's size.
* **Puts are all or nothing.** The object becomes visible under its key only once complete;
  if the source raises, the size limit is hit, or the backend fails, nothing is left behind:
  no object, no temporary file or object, no pending multipart upload.
* **Size limit.** With ``max_bytes`` set, content longer than that raises
  :class:`ObjectTooLarge` as soon as the limit is passed (the rest is not read).
* **Idempotent.** Putting content that is already stored returns the same
  :class:`StoredObject` and leaves one complete copy under the key. Identical content from
  different uploads shares one object, so deleting is the metadata layer's decision (it must
  know no other adapter still refers to the key).
* **Reads verify.** :meth:`ObjectStore.open` returns a binary file object that hashes what
  it reads and raises :class:`ChecksumMismatch` when the end of the object is reached and the
  digest differs from the key. A reader closed before the end verifies nothing.
  :meth:`ObjectStore.read_to` copies an object to a local path through such a reader,
  into a temporary file next to the destination that is renamed into place only after the
  check passes: on a mismatch nothing is left at (or next to) the destination.
* **Errors.** :class:`ObjectNotFound` for a missing key (reads and :meth:`~ObjectStore.size`;
  :meth:`~ObjectStore.delete` of a missing key is a no-op and :meth:`~ObjectStore.exists`
  answers False); :class:`StoreUnavailable` when the backend cannot be reached or cannot do
  the I/O (S3 endpoint down, bucket missing, credentials refused, local directory unusable),
  with a message naming the endpoint or directory. All are :class:`StoreError`. Exceptions
  raised by the caller's source iterator propagate unchanged (after the clean-up).
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import io
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

CHUNK_SIZE = 1024 * 1024
"""Bytes read from a file-like source, or copied to a destination, at a time."""

_KEY_RE = re.compile(r"sha256/([0-9a-f]{2})/([0-9a-f]{64})")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
# Segments of lowercase letters, digits, '.', '_' and '-' that start with a letter or digit:
# no '.' or '..' segment, no leading '/', nothing a filesystem or S3 reads specially.
_NAMED_KEY_RE = re.compile(r"[a-z0-9][a-z0-9._-]*(?:/[a-z0-9][a-z0-9._-]*)*")
NAMED_KEY_MAX_LENGTH = 512
RESERVED_PREFIXES = ("sha256/", "tmp/")
"""Where named objects may not go: content addresses, and the backends' puts in progress."""


# --- errors ------------------------------------------------------------------------------------


class StoreError(Exception):
    """Base of every error the object store raises."""


class InvalidKey(StoreError, ValueError):
    """A key that is neither a content address nor a valid name (see :func:`check_named_key`)."""

    def __init__(self, key: str, want: str = "sha256/<hex[:2]>/<hex>") -> None:
        super().__init__(f"not an object store key (want {want}): {key!r}")
        self.key = key


class ObjectNotFound(StoreError):
    """No object is stored under the key."""

    def __init__(self, key: str) -> None:
        super().__init__(f"no object stored under {key}")
        self.key = key


class ObjectTooLarge(StoreError):
    """The content put is longer than the ``max_bytes`` the caller allowed."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(f"object is larger than the limit of {max_bytes} bytes")
        self.max_bytes = max_bytes


class ChecksumMismatch(StoreError):
    """The bytes read back do not hash to the key they are stored under (corruption)."""

    def __init__(self, key: str, actual_sha256: str, actual_size: int) -> None:
        super().__init__(
            f"object {key} is corrupt: its {actual_size} bytes hash to sha256 {actual_sha256}"
        )
        self.key = key
        self.actual_sha256 = actual_sha256
        self.actual_size = actual_size


class StoreUnavailable(StoreError):
    """The backend cannot be reached or cannot do the I/O; the message names where."""


# --- values and keys ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredObject:
    """What a put stored: the content address, its digest and the length in bytes."""

    key: str  # sha256/<hex[:2]>/<hex>
    sha256: str  # lowercase hex digest of the content
    size: int  # bytes


def key_for(sha256_hex: str) -> str:
    """The key content with this (lowercase hex) SHA-256 digest is stored under."""
    if not _SHA256_RE.fullmatch(sha256_hex):
        raise ValueError(f"not a lowercase hex sha256 digest: {sha256_hex!r}")
    return f"sha256/{sha256_hex[:2]}/{sha256_hex}"


def sha256_of_key(key: str) -> str:
    """The digest a key names; :class:`InvalidKey` for anything not made by :func:`key_for`."""
    match = _KEY_RE.fullmatch(key) if isinstance(key, str) else None
    if match is None or not match.group(2).startswith(match.group(1)):
        raise InvalidKey(str(key))
    return match.group(2)


_NAMED_KEY_SHAPE = "lowercase segments like billing/2026-11-24.csv, not under sha256/ or tmp/"


def check_named_key(key: str) -> str:
    """``key`` if :meth:`ObjectStore.put_named` may use it, else :class:`InvalidKey`.

    A name is ``/``-separated segments of ``a-z 0-9 . _ -``, each starting with a letter or
    digit (so no ``.`` or ``..`` segment, no absolute path), at most
    :data:`NAMED_KEY_MAX_LENGTH` characters, outside :data:`RESERVED_PREFIXES`.
    """
    if (
        not isinstance(key, str)
        or len(key) > NAMED_KEY_MAX_LENGTH
        or not _NAMED_KEY_RE.fullmatch(key)
        or key.startswith(RESERVED_PREFIXES)
    ):
        raise InvalidKey(str(key), _NAMED_KEY_SHAPE)
    return key


def is_content_key(key: str) -> bool:
    """Whether ``key`` is a content address (as opposed to a name, or nothing valid)."""
    try:
        sha256_of_key(key)
    except InvalidKey:
        return False
    return True


def check_key(key: str) -> str:
    """``key`` if it is a content address or a valid name; :class:`InvalidKey` otherwise."""
    if is_content_key(key):
        return key
    try:
        return check_named_key(key)
    except InvalidKey:
        raise InvalidKey(str(key), f"sha256/<hex[:2]>/<hex>, or {_NAMED_KEY_SHAPE}") from None


def check_sha256(sha256_hex: str) -> str:
    """``sha256_hex`` if it is a lowercase hex SHA-256 digest; ``ValueError`` otherwise."""
    if not isinstance(sha256_hex, str) or not _SHA256_RE.fullmatch(sha256_hex):
        raise ValueError(f"not a lowercase hex sha256 digest: {sha256_hex!r}")
    return sha256_hex


# --- streaming helpers shared by the backends --------------------------------------------------


class _Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


Source = Iterable[bytes] | BinaryIO
"""What a put accepts: an iterable of bytes-like chunks or a binary file object."""


def iter_chunks(source: Source, chunk_size: int = CHUNK_SIZE) -> Iterator[bytes]:
    """Yield the bytes of ``source`` in chunks, skipping empty ones.

    A file object (anything with ``read``) is read ``chunk_size`` bytes at a time; a lone
    bytes-like object is one chunk (iterating it would yield ints); any other iterable is
    passed through chunk by chunk.
    """
    if isinstance(source, bytes | bytearray | memoryview):
        if source:
            yield bytes(source)
        return
    read = getattr(source, "read", None)
    if read is not None:
        while chunk := read(chunk_size):
            yield chunk
        return
    for chunk in source:
        if chunk:
            yield chunk


class ContentHasher:
    """Hashes and counts the bytes of one put, enforcing its ``max_bytes``."""

    def __init__(self, max_bytes: int | None) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be None or >= 0, got {max_bytes}")
        self._max_bytes = max_bytes
        self._sha256 = hashlib.sha256()
        self.size = 0

    def update(self, chunk: bytes) -> None:
        """Count and hash ``chunk``; :class:`ObjectTooLarge` once the total passes the limit."""
        self.size += len(chunk)
        if self._max_bytes is not None and self.size > self._max_bytes:
            raise ObjectTooLarge(self._max_bytes)
        self._sha256.update(chunk)

    def result(self, key: str | None = None) -> StoredObject:
        """What was put: under ``key`` (a named put), or under the content's address."""
        digest = self._sha256.hexdigest()
        return StoredObject(key=key or key_for(digest), sha256=digest, size=self.size)


class VerifyingReader(io.RawIOBase):
    """A read-only binary stream over a stored object that checks its digest at the end.

    Wraps the backend's raw stream (anything with ``read(n)`` and ``close()``). Reaching the
    end of the stream with a digest other than the expected one (``sha256``, by default the
    one the content key names) raises :class:`ChecksumMismatch` (from that read and every
    later one). Subclasses override :meth:`_read_raw` to translate backend errors.
    """

    def __init__(self, key: str, raw: _Readable, sha256: str | None = None) -> None:
        super().__init__()
        self.key = key
        self._expected = sha256_of_key(key) if sha256 is None else check_sha256(sha256)
        self._raw = raw
        self._sha256 = hashlib.sha256()
        self._size = 0
        self._mismatch: ChecksumMismatch | None = None
        self._at_end = False

    def readable(self) -> bool:
        return True

    def _read_raw(self, size: int) -> bytes:
        return self._raw.read(size)

    def readinto(self, buffer) -> int:  # type: ignore[override]
        if self._mismatch is not None:
            raise self._mismatch
        if self._at_end:
            return 0
        view = memoryview(buffer).cast("B")
        data = self._read_raw(len(view)) if len(view) else b""
        if data:
            self._sha256.update(data)
            self._size += len(data)
            view[: len(data)] = data
            return len(data)
        if len(view):
            self._at_end = True
            actual = self._sha256.hexdigest()
            if actual != self._expected:
                self._mismatch = ChecksumMismatch(self.key, actual, self._size)
                raise self._mismatch
        return 0

    def close(self) -> None:
        if not self.closed:
            try:
                self._raw.close()  # type: ignore[attr-defined]
            finally:
                super().close()


def fsync_directory(path: Path) -> None:
    """Make a rename in ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomically(
    directory: Path,
    prefix: str,
    write: Callable[[BinaryIO], Path],
    *,
    disk_errors: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> Path:
    """Write a file durably under the name ``write`` picks, or leave nothing.

    ``write(out)`` fills a temporary file in ``directory`` and returns where the file belongs
    (it may decide only once it has seen the bytes: a content address). The file is then
    fsynced, renamed there and the rename made durable. On any failure the temporary file is
    removed. ``disk_errors`` wraps this function's own file operations (not ``write``'s), so
    a backend can report them its way.
    """
    with disk_errors():
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=".part")
    tmp_path = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            final = write(out)
            with disk_errors():
                out.flush()
                os.fsync(out.fileno())
        with disk_errors():
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp_path, final)
            fsync_directory(final.parent)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    return final


# --- the interface -----------------------------------------------------------------------------


class ObjectStore(abc.ABC):
    """Durable content-addressed storage of adapter files (see the module docstring)."""

    # StoreUnavailable errors raised since the store was made (the platform's /metrics)
    failures: int = 0

    @abc.abstractmethod
    def put_stream(self, source: Source, *, max_bytes: int | None = None) -> StoredObject:
        """Store the bytes of ``source`` under their content address; all or nothing."""

    @abc.abstractmethod
    def put_named(self, key: str, source: Source, *, max_bytes: int | None = None) -> StoredObject:
        """Store the bytes of ``source`` under the name ``key`` (:func:`check_named_key`).

        All or nothing, like :meth:`put_stream`; an object already under ``key`` is replaced
        whole once the new one is complete. Returns ``key`` with the content's digest and
        size: record the digest to read the object back with :meth:`open_named`.
        """

    @abc.abstractmethod
    def open(self, key: str) -> VerifyingReader:
        """A binary reader of the object that raises :class:`ChecksumMismatch` at its end."""

    @abc.abstractmethod
    def open_named(self, key: str, sha256: str) -> VerifyingReader:
        """A reader of the named object that raises :class:`ChecksumMismatch` at its end
        unless its bytes hash to ``sha256`` (what :meth:`put_named` returned)."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object is stored under ``key`` (a content address or a name)."""

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """Length in bytes of the object; :class:`ObjectNotFound` if there is none."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object (content address or name); a missing one is not an error."""

    def put_file(
        self, path: str | os.PathLike[str], *, max_bytes: int | None = None
    ) -> StoredObject:
        """Store a local file's content; a file known to exceed ``max_bytes`` is not read."""
        with open(path, "rb") as handle:
            if max_bytes is not None and os.fstat(handle.fileno()).st_size > max_bytes:
                raise ObjectTooLarge(max_bytes)
            return self.put_stream(handle, max_bytes=max_bytes)

    def read_to(self, key: str, dest: str | os.PathLike[str]) -> StoredObject:
        """Copy the object to ``dest``, verified; the file appears there only if it checks out.

        The bytes go to a temporary file in ``dest``'s directory, fsynced and renamed over
        ``dest`` after the digest matched. On any failure (:class:`ChecksumMismatch`,
        :class:`ObjectNotFound`, I/O) the temporary file is removed and ``dest`` is untouched.
        """
        dest = Path(dest)
        size = 0

        def copy(out: BinaryIO) -> Path:
            nonlocal size
            while chunk := reader.read(CHUNK_SIZE):  # raises ChecksumMismatch at the end
                out.write(chunk)
                size += len(chunk)
            return dest

        with self.open(key) as reader:
            write_atomically(dest.parent, f".{dest.name}.", copy)
        return StoredObject(key=key, sha256=sha256_of_key(key), size=size)
