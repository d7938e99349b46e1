"""An adapter upload's life: uploading → validating → ready | failed.

``upload_adapter`` runs in the request (through the thread pool):

1. the HTTP layer has written the received files to a private temporary folder;
2. a new ``AdapterVersion`` is recorded as *uploading* (committed) and an archive, if one
   was sent, is unpacked with its path, link and size checks;
3. then, depending on where tasks run:

   * **inline** (no Celery broker, the embedded default): the folder is validated against
     the base model, and only an adapter that passes is put into the object store and
     marked *ready*. A refused upload answers 422 and leaves nothing: its version row (and
     the adapter row, if this upload created it) is deleted, nothing was stored.
   * **queued** (a broker is configured): the two files are put into the object store, the
     version is marked *validating* with their keys, and ``loramux.validate_adapter`` is
     queued; the request answers at once. A worker runs ``validate_stored_version``: it reads
     the files back (verified against their digests), validates them and marks the version
     *ready*, or *failed* with the reason, deleting the files no other version shares. The
     failed row stays, so the tenant can read why.

Every function here is blocking. Functions that write commit before returning.
"""

from __future__ import annotations

import functools
import json
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from loramux.engine.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from loramux.engine.model.config import ModelConfig
from loramux.platform.api.errors import APIError
from loramux.platform.db.models import Adapter, AdapterStatus, AdapterVersion
from loramux.platform.db.types import utc_now
from loramux.platform.ingest import (
    AdapterInfo,
    UploadRejected,
    unpack_adapter_archive,
    validate_adapter_dir,
)
from loramux.platform.services.adapters import (
    AdapterView,
    check_adapter_name,
    latest_version,
)
from loramux.platform.store import ChecksumMismatch, ObjectNotFound, ObjectStore, StoredObject

REJECTED_PREFIX = "Adapter rejected: "


@dataclass(frozen=True)
class ReceivedUpload:
    """What arrived over HTTP: the adapter's two files in ``folder``, or one ``archive``."""

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


def upload_adapter(
    sessions: sessionmaker[Session],
    store: ObjectStore,
    target: ValidationTarget,
    tenant_id: str,
    name: str,
    received: ReceivedUpload,
    *,
    enqueue: EnqueueValidation | None = None,
) -> AdapterView:
    """Record the upload as the next version of ``name`` and validate or queue it.

    Uses its own session: the upload's states are committed one by one, whatever the
    request's session does. Raises ``APIError`` 422 with the reason when the upload is
    refused in the request, 503 when the validation task cannot be queued.
    """
    check_adapter_name(name)
    with sessions() as session:
        adapter, version, created = _begin(session, tenant_id, name, target.base_model_id)
        stored: list[StoredObject] = []
        try:
            with tempfile.TemporaryDirectory(prefix="loramux-unpack-") as work:
                adapter_dir = _adapter_dir(received, Path(work), target.max_bytes)
                version.status = AdapterStatus.VALIDATING.value
                session.commit()
                info = target.validate(adapter_dir) if enqueue is None else None
                stored = _store_files(session, store, adapter_dir, target.max_bytes)
            _record_files(version, config=stored[0], weights=stored[1])
            if info is not None:
                _mark_ready(version, info)
            session.commit()
        except UploadRejected as exc:
            _discard(session, store, adapter, version, stored, adapter_created=created)
            raise APIError(422, f"{REJECTED_PREFIX}{exc}", code="invalid_adapter") from exc
        except BaseException:
            _discard(session, store, adapter, version, stored, adapter_created=created)
            raise
        if enqueue is not None:
            try:
                enqueue(version.id, target)
            except Exception as exc:
                _discard(session, store, adapter, version, stored, adapter_created=created)
                raise APIError(
                    503,
                    "The adapter could not be queued for validation (task broker unreachable); "
                    "nothing was kept. Try again shortly.",
                    code="task_queue_unavailable",
                ) from exc
        return AdapterView(adapter, version)


def _begin(
    session: Session, tenant_id: str, name: str, base_model_id: str
) -> tuple[Adapter, AdapterVersion, bool]:
    """A new *uploading* version of the tenant's adapter ``name`` (created if new), committed."""
    adapter = session.scalar(
        select(Adapter)
        .where(Adapter.tenant_id == tenant_id, Adapter.name == name, Adapter.deleted_at.is_(None))
        .with_for_update()
    )
    created = adapter is None
    if adapter is None:
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
    )
    session.add(version)
    try:
        session.commit()
    except IntegrityError as exc:
        session.rollback()
        raise APIError(
            409,
            f"Another upload of adapter {name!r} is in progress; try again.",
            code="adapter_upload_conflict",
        ) from exc
    return adapter, version, created


def _adapter_dir(received: ReceivedUpload, work: Path, max_bytes: int) -> Path:
    if received.archive is None:
        return received.folder
    return unpack_adapter_archive(received.archive, work / "adapter", max_total_bytes=max_bytes)


def _store_files(
    session: Session, store: ObjectStore, adapter_dir: Path, max_bytes: int
) -> list[StoredObject]:
    """Put config and weights into the store; on failure remove what this call put."""
    stored: list[StoredObject] = []
    try:
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            path = adapter_dir / name
            if not path.is_file() or path.is_symlink():
                raise UploadRejected(f"{name} is missing from the upload")
            stored.append(store.put_file(path, max_bytes=max_bytes))
    except BaseException:
        _delete_unshared(session, store, (obj.key for obj in stored))
        raise
    return stored


def _record_files(version: AdapterVersion, *, config: StoredObject, weights: StoredObject) -> None:
    version.config_store_key, version.config_sha256 = config.key, config.sha256
    version.weights_store_key, version.sha256 = weights.key, weights.sha256


def _mark_ready(version: AdapterVersion, info: AdapterInfo) -> None:
    version.status = AdapterStatus.READY.value
    version.rank = info.rank
    version.target_modules = list(info.target_modules)
    version.size_bytes = info.size_bytes


def _key_in_use(session: Session, key: str) -> bool:
    """Whether a version refers to ``key`` (identical content is stored once and shared)."""
    uses = select(func.count()).where(
        (AdapterVersion.weights_store_key == key) | (AdapterVersion.config_store_key == key)
    )
    return session.scalar(uses.select_from(AdapterVersion)) > 0


def _delete_unshared(session: Session, store: ObjectStore, keys: Iterable[str]) -> None:
    for key in keys:
        if not _key_in_use(session, key):
            store.delete(key)


def _discard(
    session: Session,
    store: ObjectStore,
    adapter: Adapter,
    version: AdapterVersion,
    stored: list[StoredObject],
    *,
    adapter_created: bool,
) -> None:
    """Remove a refused upload: its version, its adapter if this upload made it, its files."""
    session.rollback()  # whatever was pending; the committed rows are deleted below
    session.delete(version)
    session.flush()
    session.expire(adapter, ["versions"])
    if adapter_created and latest_version(session, adapter) is None:
        session.delete(adapter)
    session.commit()
    _delete_unshared(session, store, (obj.key for obj in stored))


# --- the worker's part -----------------------------------------------------------------------


def validate_stored_version(
    sessions: sessionmaker[Session], store: ObjectStore, version_id: str, target: ValidationTarget
) -> str:
    """Validate a *validating* version's files from the store; returns its status after.

    Idempotent: a version no longer validating (done already, or removed) is left as it
    is. The store's errors other than missing or corrupt files propagate, so the task is
    retried rather than the upload failed for an outage.
    """
    with sessions() as session:
        version = session.get(AdapterVersion, version_id)
        if version is None or version.status != AdapterStatus.VALIDATING.value:
            return "gone" if version is None else version.status
        keys = {CONFIG_FILE: version.config_store_key, WEIGHTS_FILE: version.weights_store_key}
    info: AdapterInfo | None = None
    reason: str | None = None
    with tempfile.TemporaryDirectory(prefix="loramux-validate-") as work:
        try:
            for file_name, key in keys.items():
                if key is None:
                    raise UploadRejected(f"{file_name} was never stored")
                store.read_to(key, Path(work) / file_name)
            info = target.validate(Path(work))
        except (UploadRejected, ObjectNotFound, ChecksumMismatch) as exc:
            reason = f"{REJECTED_PREFIX}{exc}"
    with sessions.begin() as session:
        version = session.get(AdapterVersion, version_id, with_for_update=True)
        if version is None or version.status != AdapterStatus.VALIDATING.value:
            return "gone" if version is None else version.status
        if info is not None:
            _mark_ready(version, info)
        else:
            version.status = AdapterStatus.FAILED.value
            version.failure_reason = reason
            version.config_store_key = version.weights_store_key = None
        status = version.status
    if info is None:
        with sessions() as session:
            _delete_unshared(session, store, (key for key in keys.values() if key is not None))
    return status


# --- start-up clean-up -----------------------------------------------------------------------

# An upload still uploading/validating after this long was cut off by a crash or restart
# (a live one finishes in seconds to minutes; a queued one waits for a worker at most this).
INTERRUPTED_UPLOAD_AGE = timedelta(hours=1)


def discard_interrupted_uploads(
    sessions: sessionmaker[Session],
    store: ObjectStore,
    *,
    older_than: timedelta = INTERRUPTED_UPLOAD_AGE,
) -> int:
    """Remove versions stuck in uploading/validating, adapters left with no version, and
    the files only they referred to. Returns how many versions were removed."""
    unfinished = (AdapterStatus.UPLOADING.value, AdapterStatus.VALIDATING.value)
    with sessions.begin() as session:
        stale = session.scalars(
            select(AdapterVersion).where(
                AdapterVersion.status.in_(unfinished),
                AdapterVersion.updated_at < utc_now() - older_than,
            )
        ).all()
        keys = {
            key
            for version in stale
            for key in (version.config_store_key, version.weights_store_key)
            if key is not None
        }
        adapters = {version.adapter for version in stale}
        for version in stale:
            session.delete(version)
        session.flush()
        for adapter in adapters:
            session.expire(adapter, ["versions"])
            if latest_version(session, adapter) is None:
                session.delete(adapter)
    with sessions() as session:
        _delete_unshared(session, store, keys)
    return len(stale)
