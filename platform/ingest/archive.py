"""Unpacking an uploaded adapter archive (.tar.gz / .tgz / .zip) without trusting it.

The archive's type comes from its magic bytes, never its file name. Members are read as
a stream and written by this code (never by ``tarfile.extract``), under names taken from
a fixed allow-list, so nothing lands outside ``dest_dir`` whatever the archive says.
Even so, each member is refused outright for:

- an absolute path, a ``..`` component, a link (symbolic or hard), a device or a fifo;
- more members than ``max_members``, or folders deeper than one top-level folder;
- a name outside the allow-list: pickles (``.bin``, ``.pt``, ...) are refused by name,
  before a byte of them is read; nested archives by name or by their magic bytes.

Sizes in headers are not believed: bytes are counted as they come out of the
decompressor, and unpacking stops as soon as they pass ``max_total_bytes`` or grow past
``max_ratio`` times the archive's size on disk (a decompression bomb). On any refusal,
``dest_dir`` is left as empty as it was found.
"""

from __future__ import annotations

import enum
import gzip
import shutil
import stat
import tarfile
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from loramux.engine import CONFIG_FILE, WEIGHTS_FILE
from loramux.platform.ingest.errors import UploadRejected

ADAPTER_FILES = frozenset({CONFIG_FILE, WEIGHTS_FILE})
# Read (and counted) but not written out: the result folder holds only the adapter.
HARMLESS_FILES = frozenset({"README.md", ".gitattributes"})
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"})
ARCHIVE_SUFFIXES = frozenset(
    {".zip", ".tar", ".gz", ".tgz", ".bz2", ".tbz2", ".xz", ".txz", ".zst", ".7z", ".rar"}
)

CHUNK_BYTES = 1 << 20
SNIFF_BYTES = 512  # enough to see a tar's "ustar" at offset 257
RATIO_FLOOR_BYTES = 1 << 20  # below this much output no compression ratio is suspicious
# Tar headers, padding and the end-of-archive record on top of the members' own bytes.
TAR_OVERHEAD_BYTES = 64 << 10
TAR_OVERHEAD_PER_MEMBER = 4 << 10


class ArchiveKind(enum.Enum):
    GZIP = "gzip"
    ZIP = "zip"
    TAR = "tar"
    BZIP2 = "bzip2"
    XZ = "xz"
    ZSTD = "zstd"
    SEVEN_ZIP = "7z"
    RAR = "rar"


_MAGICS = (
    (b"\x1f\x8b", ArchiveKind.GZIP),
    (b"PK\x03\x04", ArchiveKind.ZIP),
    (b"PK\x05\x06", ArchiveKind.ZIP),  # an empty zip
    (b"BZh", ArchiveKind.BZIP2),
    (b"\xfd7zXZ\x00", ArchiveKind.XZ),
    (b"\x28\xb5\x2f\xfd", ArchiveKind.ZSTD),
    (b"7z\xbc\xaf\x27\x1c", ArchiveKind.SEVEN_ZIP),
    (b"Rar!\x1a\x07", ArchiveKind.RAR),
)


def sniff_archive(head: bytes) -> ArchiveKind | None:
    """The archive or compression format that ``head`` (a file's first bytes) starts."""
    for magic, kind in _MAGICS:
        if head.startswith(magic):
            return kind
    if head[257:262] == b"ustar":
        return ArchiveKind.TAR
    return None


@dataclass
class _Budget:
    """Bytes out of a decompressor: refused past ``limit`` or past ``max_ratio`` x input."""

    limit: int
    archive_bytes: int
    max_ratio: float
    what: str  # "files" or "stream", for the message
    used: int = 0

    def take(self, count: int) -> None:
        self.used += count
        if self.used > self.limit:
            raise UploadRejected(
                f"the archive's {self.what} expand past the size limit of {self.limit} bytes"
            )
        if self.used > RATIO_FLOOR_BYTES and self.used > self.max_ratio * self.archive_bytes:
            raise UploadRejected(
                f"the archive expands to more than {self.max_ratio:g} times its compressed "
                f"size of {self.archive_bytes} bytes: refused as a decompression bomb"
            )


class _MeteredReader:
    """A read-only stream that charges every byte it hands out to a budget."""

    def __init__(self, raw: BinaryIO, budget: _Budget) -> None:
        self._raw = raw
        self._budget = budget

    def read(self, size: int = -1) -> bytes:
        # Never an unbounded read: callers (tarfile's stream) loop until they have enough.
        data = self._raw.read(size if size is not None and size >= 0 else CHUNK_BYTES)
        self._budget.take(len(data))
        return data


def _member_parts(name: str) -> list[str]:
    """A member name's path components; refuses absolute paths and ``..``."""
    if not name or "\x00" in name:
        raise UploadRejected(f"archive member {name!r} has an empty or invalid name")
    unified = name.replace("\\", "/")
    if unified.startswith("/") or (len(unified) > 1 and unified[1] == ":"):
        raise UploadRejected(f"archive member {name!r} has an absolute path")
    parts = [part for part in unified.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise UploadRejected(f"archive member {name!r} points outside the archive ('..')")
    return parts


@dataclass
class _Layout:
    """What the archive has held so far: member count, the one folder, names seen."""

    max_members: int
    members: int = 0
    folders: set[str] = field(default_factory=set)  # "" for the top level
    seen: set[str] = field(default_factory=set)

    def count(self) -> None:
        self.members += 1
        if self.members > self.max_members:
            raise UploadRejected(
                f"the archive has more than {self.max_members} members; an adapter archive "
                f"holds {CONFIG_FILE} and {WEIGHTS_FILE}"
            )

    def _use_folder(self, folder: str, name: str) -> None:
        self.folders.add(folder)
        if len(self.folders) > 1:
            raise UploadRejected(
                f"archive member {name!r}: the adapter files must sit at the archive's top "
                f"level or inside one folder"
            )

    def add_dir(self, parts: list[str], name: str) -> None:
        if len(parts) > 1:
            raise UploadRejected(f"archive member {name!r} is a nested folder")
        if parts:
            self._use_folder(parts[0], name)

    def add_file(self, parts: list[str], name: str) -> str | None:
        """The file name to write this member under, or None to read and drop it."""
        if not parts:
            raise UploadRejected(f"archive member {name!r} has no file name")
        if len(parts) > 2:
            raise UploadRejected(f"archive member {name!r} is inside a nested folder")
        base = parts[-1]
        suffix = PurePosixPath(base).suffix.lower()
        if base not in ADAPTER_FILES and base not in HARMLESS_FILES:
            if suffix in PICKLE_SUFFIXES:
                raise UploadRejected(
                    f"archive member {name!r} is a pickle file and is refused unopened; "
                    f"save the adapter with safetensors ({WEIGHTS_FILE})"
                )
            if suffix in ARCHIVE_SUFFIXES:
                raise UploadRejected(f"archive member {name!r} is a nested archive")
            raise UploadRejected(
                f"archive member {name!r} is not expected in an adapter archive (allowed: "
                f"{', '.join(sorted(ADAPTER_FILES | HARMLESS_FILES))})"
            )
        self._use_folder(parts[0] if len(parts) == 2 else "", name)
        if base in self.seen:
            raise UploadRejected(f"archive member {name!r}: {base} appears twice")
        self.seen.add(base)
        return base if base in ADAPTER_FILES else None


def _is_nested_archive(base: str, head: bytes) -> bool:
    if sniff_archive(head) is None:
        return False
    # A safetensors file starts with an 8-byte length that may look like a magic by
    # chance; its JSON header always opens with "{".
    return not (base == WEIGHTS_FILE and head[8:9] == b"{")


def _copy_member(src: BinaryIO, name: str, base: str, target: Path | None, budget: _Budget) -> None:
    """Stream one member into ``target`` (or nowhere), charging its bytes to ``budget``."""
    head = b""
    while len(head) < SNIFF_BYTES:
        chunk = src.read(SNIFF_BYTES - len(head))
        if not chunk:
            break
        head += chunk
    budget.take(len(head))
    if _is_nested_archive(base, head):
        raise UploadRejected(f"archive member {name!r} is a nested archive")
    out = target.open("xb") if target is not None else None
    try:
        if out is not None:
            out.write(head)
        while chunk := src.read(CHUNK_BYTES):
            budget.take(len(chunk))
            if out is not None:
                out.write(chunk)
    finally:
        if out is not None:
            out.close()


def _unpack_tar(stream: BinaryIO, dest: Path, layout: _Layout, files: _Budget) -> None:
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                layout.count()
                parts = _member_parts(member.name)
                if member.issym() or member.islnk():
                    raise UploadRejected(f"archive member {member.name!r} is a link")
                if member.ischr() or member.isblk() or member.isfifo():
                    raise UploadRejected(f"archive member {member.name!r} is a device or fifo")
                if member.isdir():
                    layout.add_dir(parts, member.name)
                    continue
                if not member.isreg():
                    raise UploadRejected(f"archive member {member.name!r} is not a regular file")
                base = layout.add_file(parts, member.name)
                src = tar.extractfile(member)
                if src is None:  # pragma: no cover (regular files always have data)
                    raise UploadRejected(f"archive member {member.name!r} cannot be read")
                target = dest / base if base is not None else None
                _copy_member(src, member.name, parts[-1], target, files)
    except UploadRejected:
        raise
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:  # corrupt data
        raise UploadRejected(f"the upload is not a valid tar archive: {exc}") from exc


_ZIP_ENCRYPTED = 0x1


def _unpack_zip(path: Path, dest: Path, layout: _Layout, files: _Budget) -> None:
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
            if len(infos) > layout.max_members:
                raise UploadRejected(
                    f"the archive has {len(infos)} members, more than the "
                    f"{layout.max_members} allowed"
                )
            for info in infos:
                layout.count()
                parts = _member_parts(info.filename)
                mode = info.external_attr >> 16  # unix mode, when the zip records one
                if stat.S_ISLNK(mode):
                    raise UploadRejected(f"archive member {info.filename!r} is a link")
                if stat.S_IFMT(mode) and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                    raise UploadRejected(
                        f"archive member {info.filename!r} is a device or special file"
                    )
                if info.flag_bits & _ZIP_ENCRYPTED:
                    raise UploadRejected(f"archive member {info.filename!r} is encrypted")
                if info.is_dir():
                    layout.add_dir(parts, info.filename)
                    continue
                base = layout.add_file(parts, info.filename)
                target = dest / base if base is not None else None
                with archive.open(info) as src:
                    _copy_member(src, info.filename, parts[-1], target, files)
    except UploadRejected:
        raise
    except (zipfile.BadZipFile, NotImplementedError, EOFError, OSError, zlib.error) as exc:
        raise UploadRejected(f"the upload is not a valid zip archive: {exc}") from exc


def _unpack(
    archive_path: Path, dest: Path, *, max_total_bytes: int, max_members: int, max_ratio: float
) -> None:
    archive_bytes = archive_path.stat().st_size
    layout = _Layout(max_members=max_members)
    files = _Budget(max_total_bytes, archive_bytes, max_ratio, what="files")
    with archive_path.open("rb") as raw:
        kind = sniff_archive(raw.read(SNIFF_BYTES))
        raw.seek(0)
        if kind is ArchiveKind.ZIP:
            _unpack_zip(archive_path, dest, layout, files)
        elif kind is ArchiveKind.GZIP or kind is ArchiveKind.TAR:
            # The whole decompressed stream (headers included) is metered too, so a tar
            # header claiming a huge pax record cannot make tarfile read it into memory.
            stream_limit = (
                max_total_bytes + TAR_OVERHEAD_BYTES + max_members * TAR_OVERHEAD_PER_MEMBER
            )
            stream = _Budget(stream_limit, archive_bytes, max_ratio, what="contents")
            source = gzip.GzipFile(fileobj=raw, mode="rb") if kind is ArchiveKind.GZIP else raw
            _unpack_tar(_MeteredReader(source, stream), dest, layout, files)
        elif kind is None:
            raise UploadRejected("the upload is not a .tar.gz or .zip archive")
        else:
            raise UploadRejected(
                f"{kind.value} archives are not supported; upload a .tar.gz or .zip"
            )
    missing = sorted(ADAPTER_FILES - layout.seen)
    if missing:
        raise UploadRejected(f"the archive has no {' or '.join(missing)}")


def _empty(dest: Path, *, remove_dir: bool) -> None:
    if remove_dir:
        shutil.rmtree(dest, ignore_errors=True)
        return
    for entry in dest.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def unpack_adapter_archive(
    archive_path: str | Path,
    dest_dir: str | Path,
    *,
    max_total_bytes: int,
    max_members: int = 16,
    max_ratio: float = 100.0,
) -> Path:
    """Unpack an adapter archive into ``dest_dir``; returns the folder holding its files.

    ``dest_dir`` must be empty or absent. The adapter files land directly in it (a single
    top-level folder in the archive is flattened away); README.md and .gitattributes are
    read but not kept. Raises ``UploadRejected`` with a message for the uploader, leaving
    ``dest_dir`` empty (or absent, if this call created it).
    """
    if max_total_bytes < 1 or max_members < 1 or max_ratio <= 0:
        raise ValueError("max_total_bytes, max_members and max_ratio must be positive")
    archive_path, dest = Path(archive_path), Path(dest_dir)
    created = not dest.exists()
    dest.mkdir(parents=True, exist_ok=True)
    if not created and any(dest.iterdir()):
        raise FileExistsError(f"{dest} must be empty to unpack an archive into it")
    try:
        _unpack(
            archive_path,
            dest,
            max_total_bytes=max_total_bytes,
            max_members=max_members,
            max_ratio=max_ratio,
        )
    except BaseException:
        _empty(dest, remove_dir=created)
        raise
    return dest
