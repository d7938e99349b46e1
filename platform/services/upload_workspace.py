"""A platform replica's room for uploads in progress, inside its own data directory.

* ``<data dir>/tmp/uploads/`` holds one private folder per upload in progress (the files
  received, or an archive and what it unpacks to), removed when its request ends. A killed
  process cannot clean up, so the platform empties this folder when it starts; nothing else
  of the data directory is touched.
* ``<data dir>/instance-id`` is a random id made on the first start: the platform's
  requests hold their versions' leases as ``platform:<id>``
  (``loramux.platform.services.upload_leases``), so a platform restarted on its data
  directory knows which unfinished versions were its own and removes them at once.

Both are safe with several platform replicas on one database because each replica has a
data directory of its own (the Helm chart gives every platform pod its own ``emptyDir``;
compose runs one platform): nothing else writes there, so at start nothing in it belongs to
a live upload, and no other replica holds leases under its id. Replicas must never share a
data directory.

Starlette spools the multipart parts it parses into anonymous temporary files (unlinked at
once, so the system reclaims them even after a kill) before the route copies them here.

A Celery worker validating queued uploads reads each version's files into
``<data dir>/tmp/validate/<host>-<pid>/`` (:class:`WorkerScratch`): one folder per worker
process, removed with its validation. A worker killed mid-validation cannot remove it, so
each worker process, when it starts using the data directory, removes the folders of the
processes of its host that are gone. Several workers may share a data directory: the host
in each name keeps one host's workers from judging another's processes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from loramux.platform.services.upload_leases import request_owner

SCRATCH_DIR = Path("tmp") / "uploads"
VALIDATION_SCRATCH_DIR = Path("tmp") / "validate"
INSTANCE_ID_FILE = "instance-id"


@dataclass(frozen=True)
class UploadWorkspace:
    scratch_root: Path  # <data dir>/tmp/uploads
    owner: str  # the lease owner of this replica's requests: platform:<instance id>

    @classmethod
    def in_data_dir(cls, data_dir: Path) -> UploadWorkspace:
        """The workspace of ``data_dir`` (its instance id made on first use)."""
        return cls(data_dir / SCRATCH_DIR, request_owner(_instance_id(data_dir)))

    def new_folder(self) -> Path:
        """A fresh private folder for one upload; the caller removes it when done."""
        self.scratch_root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="upload-", dir=self.scratch_root))

    def clear(self) -> int:
        """Remove everything left in the scratch folder (at start); how many entries."""
        if not self.scratch_root.is_dir():
            return 0
        removed = 0
        for entry in self.scratch_root.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed += 1
        return removed


@dataclass(frozen=True)
class WorkerScratch:
    """A worker process's room for the validations it runs (see the module docstring)."""

    root: Path  # <data dir>/tmp/validate
    host: str = field(default_factory=socket.gethostname)

    @classmethod
    def in_data_dir(cls, data_dir: Path) -> WorkerScratch:
        return cls(data_dir / VALIDATION_SCRATCH_DIR)

    def folder(self) -> Path:
        """This process's folder (made if needed); each validation works in a folder in it."""
        folder = self.root / f"{self.host}-{os.getpid()}"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def remove_dead(self) -> int:
        """Remove the folders of this host's processes that are gone; how many."""
        if not self.root.is_dir():
            return 0
        removed = 0
        for entry in self.root.iterdir():
            host, _, pid = entry.name.rpartition("-")
            if host == self.host and pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(entry, ignore_errors=True)
                removed += 1
        return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _instance_id(data_dir: Path) -> str:
    path = data_dir / INSTANCE_ID_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{INSTANCE_ID_FILE}.{os.getpid()}")
    # Private, like the data directory's other files.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(uuid.uuid4().hex + "\n")
    try:
        with contextlib.suppress(FileExistsError):  # should two race, the first id is kept
            os.link(tmp, path)
    finally:
        tmp.unlink()
    return path.read_text().strip()
