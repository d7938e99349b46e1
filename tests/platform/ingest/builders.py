"""Builders for hostile and honest uploads: tar.gz and zip archives, malicious pickles."""

from __future__ import annotations

import io
import pickle
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class Zeros:
    """A readable stream of ``size`` zero bytes, produced lazily (bombs stay cheap)."""

    def __init__(self, size: int) -> None:
        self.left = size

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        self.left -= n
        return bytes(n)


@dataclass
class Member:
    """One tar member: a regular file by default, or any tarfile type with a link name."""

    name: str
    data: bytes = b""
    type: bytes = tarfile.REGTYPE
    linkname: str = ""
    zeros: int = 0  # when set, the member is this many zero bytes, streamed


def adapter_members(adapter_dir: Path, folder: str = "") -> list[Member]:
    prefix = f"{folder}/" if folder else ""
    return [Member(prefix + name, (adapter_dir / name).read_bytes()) for name in ADAPTER_FILES]


def write_tar(path: Path, members: list[Member], *, gz: bool = True) -> Path:
    with tarfile.open(path, "w:gz" if gz else "w") as tar:
        for member in members:
            info = tarfile.TarInfo(member.name)
            info.type = member.type
            info.linkname = member.linkname
            info.mode = 0o755 if member.type == tarfile.DIRTYPE else 0o644
            if member.type in (tarfile.REGTYPE, tarfile.XHDTYPE):
                info.size = member.zeros or len(member.data)
                source = Zeros(member.zeros) if member.zeros else io.BytesIO(member.data)
                tar.addfile(info, source)
            else:
                tar.addfile(info)
    return path


def write_zip(path: Path, members: dict[str, bytes | int]) -> Path:
    """A zip of name -> bytes, or name -> a count of zero bytes written streaming."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, content in members.items():
            if isinstance(content, int):
                with archive.open(name, "w", force_zip64=True) as out:
                    for _ in range(content // (1 << 20)):
                        out.write(bytes(1 << 20))
            else:
                archive.writestr(name, content)
    return path


def adapter_zip_members(adapter_dir: Path, folder: str = "") -> dict[str, bytes | int]:
    prefix = f"{folder}/" if folder else ""
    return {prefix + name: (adapter_dir / name).read_bytes() for name in ADAPTER_FILES}


class _TouchOnUnpickle:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def malicious_pickle(marker: Path) -> bytes:
    """A pickle that creates ``marker`` when it is unpickled."""
    return pickle.dumps({"lora_A": _TouchOnUnpickle(marker)})
