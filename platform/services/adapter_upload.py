"""An adapter upload's life: uploading → validating → ready | failed.

``upload_adapter`` runs in the request (through the thread pool):

1. the HTTP layer has written the received files to the upload's private folder (under
   ``<data dir>/tmp/uploads``, ``loramux.platform.services.upload_workspace``);
2. a new ``AdapterVersion`` is recorded as *uploading* (committed), held under the request's
   lease (``upload_leases``), and an archive, if one was sent, is unpacked with its path,
   link and size checks;
3. then, depending on where tasks run:

   * **inline** (no Celery broker, the embedded default): the folder is validated against
     the base model, and only an adapter that passes is put into the object store and
     marked *ready*. A refused upload answers 422 and leaves nothing: its version row (and
     the adapter row, if no other version has it) is deleted, nothing was stored.
   * **queued** (a broker is configured): the two files are put into the object store, the
     version is marked *validating* with their keys and handed to the queue's lease, and
     ``loramux.validate_adapter`` is queued (expiring with that lease); the request answers
     at once. A worker runs ``validate_stored_version``: it takes the version over, reads
     the files back (verified against their digests), validates them and marks the version
     *ready*, or *failed* with the reason, deleting the files no other version shares. The
     failed row stays, so the tenant can read why.

A version names its files before they are put, so a crash at any point leaves no object
that no version names; ``upload_cleanup`` removes what a dead owner left.

Parallel uploads of one name each become a version, numbered in the order they were
recorded (1, 2, 3…): recording one takes the database's write lock on SQLite and the
adapter's row lock on PostgreSQL, and a race to create a new adapter is retried. Only if the
database stays busy past :data:`BEGIN_ATTEMPTS` tries does an upload answer 409
``adapter_upload_conflict`` (nothing kept; try again). A store outage answers 503
``store_unavailable`` and a broker outage 503 ``task_queue_unavailable``, keeping nothing.

Every function here is blocking. Functions that write commit before returning.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from loramux.engine import CONFIG_FILE, WEIGHTS_FILE, ModelConfig
from loramux.platform.db.models import Adapter, AdapterStatus, AdapterVersion
from loramux.platform.db.types import utc_now
from loramux.platform.errors import Conflict, Invalid, Unavailable
from loramux.platform.ingest import (
    AdapterInfo,
    UploadRejected,
    unpack_adapter_archive,
    validate_adapter_dir,
)
from loramux.platform.services.adapters import AdapterView, check_adapter_name
from loramux.platform.services.upload_cleanup import (
    delete_unshared,
    drop_files_of_failed,
    named_keys,
    remove_version,
)
from loramux.platform.services.upload_leases import (
    QUEUE_OWNER,
    QUEUED_LEASE,
    REQUEST_LEASE,
    WORKER_LEASE,
    LeaseKeeper,
    LeaseLost,
    is_contention,
    lease_until,
    lock_for_writing,
    queued_or_validating_by_worker,
    release,
    update_if_held,
    worker_owner,
    write_if_held,
)
from loramux.platform.store import (
    ChecksumMismatch,
    ObjectNotFound,
    ObjectStore,
    StoredObject,
    StoreError,
    key_for,
)

logger = logging.getLogger(__name__)

REJECTED_PREFIX = "Adapter rejected: "


@dataclass(frozen=True)
class ReceivedUpload:
    """What arrived over HTTP: the adapter's two files in ``folder``, or one ``archive``
    (then ``folder`` is the upload's private folder, where the archive is unpacked)."""

    folder: Path
    archive: Path | None = None


@dataclass(frozen=True)
class ValidationTarget:
    """What an adapter is checked against; JSON-able, so a queued task carries it whole.

    The platform sends its own base model's ``config.json`` and limits with each task, so
    a worker checks an upload against exactly the model the platform serves.
    """

    base_model_id: str
    base_model_config: dict[str, Any]  # the base model's config.json
    max_rank: int
    max_bytes: int

    @classmethod
    def for_model_dir(
        cls, model_dir: Path, *, base_model_id: str, max_rank: int, max_bytes: int
    ) -> ValidationTarget:
        return cls(base_model_id, _read_config_json(model_dir), max_rank, max_bytes)

    def to_json(self) -> dict[str, Any]:
        return {
            "base_model_id": self.base_model_id,
            "base_model_config": self.base_model_config,
            "max_rank": self.max_rank,
            "max_bytes": self.max_bytes,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ValidationTarget:
        return cls(**raw)

    def validate(self, adapter_dir: Path) -> AdapterInfo:
        """``validate_adapter_dir`` against this target; raises ``UploadRejected``."""
        return validate_adapter_dir(
            adapter_dir,
            ModelConfig.from_hf_dict(self.base_model_config),
            base_model_id=self.base_model_id,
            max_rank=self.max_rank,
            max_bytes=self.max_bytes,
        )


@functools.lru_cache(maxsize=4)
def _read_config_json(model_dir: Path) -> dict[str, Any]:
    """The base model's config.json, read once per model directory (not per upload)."""
    return json.loads((model_dir / "config.json").read_text())


# The queue the upload hands a staged version's id and target to (``None``: validate inline).
EnqueueValidation = Callable[[str, ValidationTarget], None]


# --- the request's part ----------------------------------------------------------------------

BEGIN_ATTEMPTS = 6  # tries to record a new version against other writers
BEGIN_BACKOFF_S = 0.02  # first pause between tries; doubled each time, with jitter

STORE_UNAVAILABLE = (
    "The adapter store is unavailable, so the upload was not kept. Try again shortly."
)
QUEUE_UNAVAILABLE = (
    "The adapter could not be queued for validation (task broker unreachable); "
    "nothing was kept. Try again shortly."
)
LEASE_LOST = (
    "The upload could not record its progress in time and was cancelled; nothing was kept. "
    "Try again."
)


class _QueueUnavailable(Exception):
    """Sending the validation task failed."""


class _SameBytes(Exception):  # a signal between two functions, not an error
    """The upload's files are a ready version's of the same adapter and base model."""

    def __init__(self, version_id: str):
        super().__init__(version_id)
        self.version_id = version_id


def upload_adapter(
    sessions: sessionmaker[Session],
    store: ObjectStore,
    target: ValidationTarget,
    tenant_id: str,
    name: str,
    received: ReceivedUpload,
    *,
    owner: str,
    enqueue: EnqueueValidation | None = None,
) -> AdapterView:
    """Record the upload as the next version of ``name`` and validate or queue it; files a
    ready version of ``name`` already holds are that version (``AdapterView.reused``).

    ``owner`` is the lease owner of this platform replica's requests
    (``UploadWorkspace.owner``). Uses its own sessions: the upload's states are committed
    one by one, whatever the request's session does. Raises ``Invalid`` with the reason
    when the upload is refused in the request, ``Conflict`` when the database stays too
    busy to record it, ``Unavailable`` when the store or the task broker is down; nothing
    is kept.
    """
    check_adapter_name(name, base_model_id=target.base_model_id)
    version_id = _begin(sessions, tenant_id, name, target.base_model_id, owner)
    put: list[str] = []  # objects this upload put into the store
    try:
        with LeaseKeeper(sessions, version_id, owner, REQUEST_LEASE):
            _check_and_store(sessions, store, target, version_id, owner, received, put, enqueue)
            if enqueue is not None:
                _hand_to_queue(sessions, enqueue, version_id, target, owner)
    except UploadRejected as exc:
        _give_up(sessions, store, version_id, owner, put)
        raise Invalid(f"{REJECTED_PREFIX}{exc}", code="invalid_adapter") from exc
    except StoreError as exc:
        _give_up(sessions, store, version_id, owner, put)
        logger.warning("upload of adapter %r: the object store failed: %s", name, exc)
        raise Unavailable(STORE_UNAVAILABLE, code="store_unavailable") from exc
    except _QueueUnavailable as exc:
        _give_up(sessions, store, version_id, owner, put)
        raise Unavailable(QUEUE_UNAVAILABLE, code="task_queue_unavailable") from exc
    except _SameBytes as same:  # nothing was put: the new row goes, the old version answers
        _give_up(sessions, store, version_id, owner, put)
        return _view(sessions, same.version_id, reused=True)
    except LeaseLost as exc:  # swept: the sweep removes it, with what it put
        raise Unavailable(LEASE_LOST, code="upload_interrupted") from exc
    except BaseException:
        _give_up(sessions, store, version_id, owner, put)
        raise
    return _view(sessions, version_id)


def _begin(
    sessions: sessionmaker[Session], tenant_id: str, name: str, base_model_id: str, owner: str
) -> str:
    """A new *uploading* version of the tenant's adapter ``name`` (created if new), held by
    ``owner``, committed; its id. Retries races with other writers, then answers 409."""
    for attempt in range(BEGIN_ATTEMPTS):
        try:
            with sessions.begin() as session:
                return _insert_next_version(session, tenant_id, name, base_model_id, owner)
        except SQLAlchemyError as exc:
            if not is_contention(exc):
                raise
            logger.info(
                "upload of adapter %r: try %d met another writer: %s", name, attempt + 1, exc
            )
            conflict = exc
            time.sleep(random.uniform(0.5, 1.0) * BEGIN_BACKOFF_S * 2**attempt)
    raise Conflict(
        f"Too many uploads of adapter {name!r} at once; nothing was kept. Try again.",
        code="adapter_upload_conflict",
    ) from conflict


def _insert_next_version(
    session: Session, tenant_id: str, name: str, base_model_id: str, owner: str
) -> str:
    lock_for_writing(session)
    adapter = session.scalar(
        select(Adapter)
        .where(Adapter.tenant_id == tenant_id, Adapter.name == name, Adapter.deleted_at.is_(None))
        .with_for_update()
    )
    if adapter is None:  # PostgreSQL: a parallel first upload may win this insert; retried
        adapter = Adapter(tenant_id=tenant_id, name=name)
        session.add(adapter)
        session.flush()
    last = session.scalar(
        select(func.max(AdapterVersion.version)).where(AdapterVersion.adapter_id == adapter.id)
    )
    version = AdapterVersion(
        adapter=adapter,
        version=(last or 0) + 1,
        status=AdapterStatus.UPLOADING.value,
        base_model=base_model_id,
        lease_owner=owner,
        lease_expires_at=lease_until(REQUEST_LEASE),
    )
    session.add(version)
    session.flush()
    return version.id


def _check_and_store(
    sessions: sessionmaker[Session],
    store: ObjectStore,
    target: ValidationTarget,
    version_id: str,
    owner: str,
    received: ReceivedUpload,
    put: list[str],
    enqueue: EnqueueValidation | None,
) -> None:
    """Unpack, validate (inline), name the files on the version, then put them."""
    adapter_dir = _adapter_dir(received, target.max_bytes)
    write_if_held(sessions, version_id, owner, status=AdapterStatus.VALIDATING.value)
    info = target.validate(adapter_dir) if enqueue is None else None
    files = _digests(adapter_dir, target.max_bytes)
    if (same := _ready_twin(sessions, version_id, files)) is not None:
        raise _SameBytes(same)
    # Named before they exist: a crash after any put leaves no object that no version names.
    write_if_held(sessions, version_id, owner, **_file_columns(files))
    for file_name, expected in files.items():
        stored = store.put_file(adapter_dir / file_name, max_bytes=target.max_bytes)
        put.append(stored.key)
        if stored.key != expected.key:
            raise RuntimeError(f"{file_name} changed while it was being stored")
    if info is not None:
        write_if_held(sessions, version_id, owner, **release(**_ready_columns(info)))


def _ready_twin(
    sessions: sessionmaker[Session], version_id: str, files: dict[str, StoredObject]
) -> str | None:
    """The id of a ready version of the same adapter with these very files, validated
    against the same base model, if there is one: a re-upload of it is that version."""
    with sessions() as session:
        new = session.get(AdapterVersion, version_id)
        if new is None:  # swept from under the request: its next write says so
            return None
        columns = _file_columns(files)
        return session.scalar(
            select(AdapterVersion.id).where(
                AdapterVersion.adapter_id == new.adapter_id,
                AdapterVersion.id != version_id,
                AdapterVersion.status == AdapterStatus.READY.value,
                AdapterVersion.base_model == new.base_model,
                AdapterVersion.sha256 == columns["sha256"],
                AdapterVersion.config_sha256 == columns["config_sha256"],
            )
        )


def _adapter_dir(received: ReceivedUpload, max_bytes: int) -> Path:
    if received.archive is None:
        return received.folder
    return unpack_adapter_archive(
        received.archive, received.folder / "adapter", max_total_bytes=max_bytes
    )


def _digests(adapter_dir: Path, max_bytes: int) -> dict[str, StoredObject]:
    """What the store will name the two files, from their bytes (without storing them)."""
    digests = {}
    for file_name in (CONFIG_FILE, WEIGHTS_FILE):
        path = adapter_dir / file_name
        if not path.is_file() or path.is_symlink():
            raise UploadRejected(f"{file_name} is missing from the upload")
        size = path.stat().st_size
        if size > max_bytes:
            raise UploadRejected(f"{file_name} is larger than the limit of {max_bytes} bytes")
        with path.open("rb") as handle:
            sha256 = hashlib.file_digest(handle, "sha256").hexdigest()
        digests[file_name] = StoredObject(key=key_for(sha256), sha256=sha256, size=size)
    return digests


def _file_columns(files: dict[str, StoredObject]) -> dict[str, str]:
    config, weights = files[CONFIG_FILE], files[WEIGHTS_FILE]
    return {
        "config_store_key": config.key,
        "config_sha256": config.sha256,
        "weights_store_key": weights.key,
        "sha256": weights.sha256,
    }


def _ready_columns(info: AdapterInfo) -> dict[str, Any]:
    return {
        "status": AdapterStatus.READY.value,
        "rank": info.rank,
        "target_modules": list(info.target_modules),
        "size_bytes": info.size_bytes,
    }


def _hand_to_queue(
    sessions: sessionmaker[Session],
    enqueue: EnqueueValidation,
    version_id: str,
    target: ValidationTarget,
    owner: str,
) -> None:
    """Give the version to the queue's lease, then send the task (a worker may start it at
    once, and takes over only from the queue); take it back if the task cannot be sent."""
    queued = lease_until(QUEUED_LEASE)
    write_if_held(sessions, version_id, owner, lease_owner=QUEUE_OWNER, lease_expires_at=queued)
    try:
        enqueue(version_id, target)
    except Exception as exc:
        back = lease_until(REQUEST_LEASE)
        write_if_held(sessions, version_id, QUEUE_OWNER, lease_owner=owner, lease_expires_at=back)
        raise _QueueUnavailable(str(exc)) from exc


def _give_up(
    sessions: sessionmaker[Session], store: ObjectStore, version_id: str, owner: str, put: list[str]
) -> None:
    """Remove a refused or failed upload: the objects it put that no other version shares,
    then its version row and its adapter if no version is left.

    When the store cannot delete them now, the row stays (still naming them) with its lease
    ended, so the next sweep finishes the job once the store answers. Never raises: what is
    left then is the sweep's once the lease runs out."""
    try:
        with sessions() as session:
            version = session.get(AdapterVersion, version_id)
            named_only = [k for k in named_keys(version) if k not in put] if version else []
            delete_unshared(session, store, put, besides=[version_id])
            # Never put by this upload, so almost surely absent: not worth keeping the row.
            with contextlib.suppress(StoreError):
                delete_unshared(session, store, named_only, besides=[version_id])
    except StoreError:
        logger.warning(
            "upload %s: the store could not delete its files; the sweep will", version_id
        )
        _end_lease_now(sessions, version_id, owner)
        return
    except Exception:
        logger.exception("upload %s: could not clean up; the sweep will", version_id)
        return
    try:
        remove_version(sessions, version_id, owner)
    except Exception:
        logger.exception("upload %s: could not remove its rows; the sweep will", version_id)


def _end_lease_now(sessions: sessionmaker[Session], version_id: str, owner: str) -> None:
    try:
        with sessions.begin() as session:
            update_if_held(session, version_id, owner, lease_expires_at=utc_now())
    except Exception:
        logger.exception("upload %s: could not end its lease; it runs out by itself", version_id)


def _view(sessions: sessionmaker[Session], version_id: str, reused: bool = False) -> AdapterView:
    with sessions() as session:
        version = session.get(AdapterVersion, version_id)
        if version is None:  # swept between its last write and here
            raise Unavailable(LEASE_LOST, code="upload_interrupted")
        return AdapterView(session.get(Adapter, version.adapter_id), version, reused)


# --- the worker's part -----------------------------------------------------------------------


def validate_stored_version(
    sessions: sessionmaker[Session],
    store: ObjectStore,
    version_id: str,
    target: ValidationTarget,
    *,
    scratch_dir: Path | None = None,
) -> str:
    """Validate a queued version's files from the store; returns its status after.

    The files are read into a folder made in ``scratch_dir`` (a worker's, in its data
    directory: ``WorkerScratch``; None: the system's temporary directory) and removed after.

    The worker takes the version over from the queue (or from an earlier worker whose task
    was redelivered) and holds it under its own lease while it works. Idempotent: a version
    no longer validating (done already, failed by the sweep, or removed) is left as it is.
    The store's errors other than missing or corrupt files propagate, so the task is retried
    rather than the upload failed for an outage.
    """
    owner = worker_owner()
    keys = _take_over(sessions, version_id, owner)
    if keys is None:
        return _status(sessions, version_id)
    with LeaseKeeper(sessions, version_id, owner, WORKER_LEASE):
        info, reason = _check_stored(store, keys, target, scratch_dir)
    done = _ready_columns(info) if info is not None else _failed_columns(reason)
    try:
        write_if_held(sessions, version_id, owner, **release(**done))
    except LeaseLost:  # swept while it worked: the sweep's verdict stands
        return _status(sessions, version_id)
    if info is None:  # a failed version keeps no files (the sweep retries if this fails)
        drop_files_of_failed(sessions, store, version_id)
    return done["status"]


def _take_over(
    sessions: sessionmaker[Session], version_id: str, owner: str
) -> dict[str, str | None] | None:
    """Hold the validating version as ``owner``; its files' keys, or ``None`` if it is not
    there to validate (finished, swept, or still in its request)."""
    with sessions.begin() as session:
        taken = session.execute(
            update(AdapterVersion)
            .where(
                AdapterVersion.id == version_id,
                AdapterVersion.status == AdapterStatus.VALIDATING.value,
                queued_or_validating_by_worker(AdapterVersion.lease_owner),
            )
            .values(lease_owner=owner, lease_expires_at=lease_until(WORKER_LEASE))
            .execution_options(synchronize_session=False)
        )
        if taken.rowcount != 1:
            return None
        version = session.get(AdapterVersion, version_id)
        return {CONFIG_FILE: version.config_store_key, WEIGHTS_FILE: version.weights_store_key}


def _check_stored(
    store: ObjectStore,
    keys: dict[str, str | None],
    target: ValidationTarget,
    scratch_dir: Path | None,
) -> tuple[AdapterInfo | None, str | None]:
    """(what validation found, None) or (None, why it was refused)."""
    with tempfile.TemporaryDirectory(prefix="loramux-validate-", dir=scratch_dir) as work:
        try:
            for file_name, key in keys.items():
                if key is None:
                    raise UploadRejected(f"{file_name} was never stored")
                store.read_to(key, Path(work) / file_name)
            return target.validate(Path(work)), None
        except (UploadRejected, ObjectNotFound, ChecksumMismatch) as exc:
            return None, f"{REJECTED_PREFIX}{exc}"


def _failed_columns(reason: str | None) -> dict[str, Any]:
    return {"status": AdapterStatus.FAILED.value, "failure_reason": reason}


def _status(sessions: sessionmaker[Session], version_id: str) -> str:
    with sessions() as session:
        status = session.scalar(
            select(AdapterVersion.status).where(AdapterVersion.id == version_id)
        )
    return "gone" if status is None else status
