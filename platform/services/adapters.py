"""Tenants' adapters: upload (validate, then store), list, look up, soft-delete.

An upload's life, all inside one request (tasks run inline in the embedded default):

1. the HTTP layer writes the received files to a private temporary folder (byte-capped);
2. ``upload_adapter`` records a new ``AdapterVersion`` as *uploading* (committed), then
   *validating*, unpacks an archive if one was sent, and validates the adapter against the
   base model;
3. only when validation passes are the two files put into the object store and the version
   marked *ready* with what validation found.

A rejected upload leaves nothing behind: its version row (and the adapter row, if this upload
created it) is deleted and nothing was put into the store. Every function here is blocking;
async routes call them through the thread pool. Functions that write commit before returning.
"""

from __future__ import annotations

import functools
import re
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from loramux.engine.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from loramux.engine.model.config import ModelConfig
from loramux.platform.api.errors import APIError
from loramux.platform.context import PlatformContext
from loramux.platform.db.models import Adapter, AdapterStatus, AdapterVersion, Tenant
from loramux.platform.db.types import utc_now
from loramux.platform.ingest import (
    AdapterInfo,
    UploadRejected,
    unpack_adapter_archive,
    validate_adapter_dir,
)
from loramux.platform.store import ObjectStore, StoredObject

MAX_UPLOAD_BYTES = 512 << 20  # a whole upload request, and the unpacked adapter
MAX_RANK = 64
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class ReceivedUpload:
    """What arrived over HTTP: the adapter's two files in ``folder``, or one ``archive``."""

    folder: Path
    archive: Path | None = None


@dataclass(frozen=True)
class AdapterView:
    """An adapter with its latest version (``None`` only while no version exists)."""

    adapter: Adapter
    version: AdapterVersion | None


# --- names and look-ups ----------------------------------------------------------------------


def check_adapter_name(name: str) -> str:
    if not NAME_PATTERN.fullmatch(name):
        raise APIError(
            422,
            f"Invalid adapter name {name!r}: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit.",
            code="invalid_adapter_name",
        )
    return name


def _not_found(name: str) -> APIError:
    # The same answer whether the name is unknown or another tenant's: names never leak.
    return APIError(404, f"No adapter named {name!r}.", code="adapter_not_found")


def _find_live_adapter(session: Session, tenant_id: str, name: str) -> Adapter | None:
    return session.scalar(
        select(Adapter).where(
            Adapter.tenant_id == tenant_id, Adapter.name == name, Adapter.deleted_at.is_(None)
        )
    )


def live_adapter(session: Session, tenant: Tenant, name: str) -> Adapter:
    """The tenant's live adapter called ``name``; 404 otherwise."""
    adapter = _find_live_adapter(session, tenant.id, name)
    if adapter is None:
        raise _not_found(name)
    return adapter


def latest_version(
    session: Session, adapter: Adapter, *, ready: bool = False
) -> AdapterVersion | None:
    query = select(AdapterVersion).where(AdapterVersion.adapter_id == adapter.id)
    if ready:
        query = query.where(AdapterVersion.status == AdapterStatus.READY.value)
    return session.scalar(query.order_by(AdapterVersion.version.desc()).limit(1))


def ready_version(
    session: Session, tenant_id: str, name: str
) -> tuple[Adapter, AdapterVersion] | None:
    """The tenant's live adapter called ``name`` and its newest ready version, if both exist."""
    adapter = _find_live_adapter(session, tenant_id, name)
    if adapter is None:
        return None
    version = latest_version(session, adapter, ready=True)
    return None if version is None else (adapter, version)


def get_adapter(session: Session, adapter: Adapter) -> AdapterView:
    return AdapterView(adapter, latest_version(session, adapter))


def _live_adapters(session: Session, tenant: Tenant) -> list[Adapter]:
    return list(
        session.scalars(
            select(Adapter)
            .where(Adapter.tenant_id == tenant.id, Adapter.deleted_at.is_(None))
            .order_by(Adapter.name)
        ).all()
    )


def list_adapters(session: Session, tenant: Tenant) -> list[AdapterView]:
    """The tenant's live adapters, by name, each with its latest version."""
    return [get_adapter(session, adapter) for adapter in _live_adapters(session, tenant)]


def ready_adapters(session: Session, tenant: Tenant) -> list[AdapterView]:
    """The tenant's live adapters that can serve, each with its latest ready version."""
    views = []
    for adapter in _live_adapters(session, tenant):
        ready = latest_version(session, adapter, ready=True)
        if ready is not None:
            views.append(AdapterView(adapter, ready))
    return views


def delete_adapter(session: Session, adapter: Adapter) -> list[AdapterVersion]:
    """Soft-delete ``adapter``; returns its versions (for the caller to unload)."""
    versions = list(adapter.versions)
    adapter.deleted_at = utc_now()
    session.commit()
    return versions


# --- upload ----------------------------------------------------------------------------------


def upload_adapter(
    context: PlatformContext, tenant_id: str, name: str, received: ReceivedUpload
) -> AdapterView:
    """Record, validate and store an upload as the next version of ``name`` (see module doc).

    Uses its own session: the upload's states are committed one by one, whatever the
    request's session does. Raises ``APIError`` 422 with the validation's message when the
    upload is refused.
    """
    check_adapter_name(name)
    with context.sessions() as session:
        adapter, version, created = _begin(session, tenant_id, name, context.base_model.model_id)
        try:
            version.status = AdapterStatus.VALIDATING.value
            session.commit()
            with tempfile.TemporaryDirectory(prefix="loramux-unpack-") as work:
                adapter_dir = _adapter_dir(received, Path(work))
                info = validate_adapter_dir(
                    adapter_dir,
                    _base_model_config(context.base_model.path),
                    base_model_id=context.base_model.model_id,
                    max_rank=MAX_RANK,
                    max_bytes=MAX_UPLOAD_BYTES,
                )
                config, weights = _store_files(session, context.store, adapter_dir)
        except UploadRejected as exc:
            _discard(session, adapter, version, adapter_created=created)
            raise APIError(422, f"Adapter rejected: {exc}", code="invalid_adapter") from exc
        except BaseException:
            _discard(session, adapter, version, adapter_created=created)
            raise
        _mark_ready(version, info, config=config, weights=weights)
        session.commit()
        return AdapterView(adapter, version)


@functools.lru_cache(maxsize=4)
def _base_model_config(path: Path) -> ModelConfig:
    """The base model's parsed config, read once per model directory (not per upload)."""
    return ModelConfig.from_pretrained(path)


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


def _adapter_dir(received: ReceivedUpload, work: Path) -> Path:
    if received.archive is None:
        return received.folder
    return unpack_adapter_archive(
        received.archive, work / "adapter", max_total_bytes=MAX_UPLOAD_BYTES
    )


def _store_files(
    session: Session, store: ObjectStore, adapter_dir: Path
) -> tuple[StoredObject, StoredObject]:
    """Put both files into the store; on failure remove what this call put (if unshared)."""
    stored: list[StoredObject] = []
    try:
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            stored.append(store.put_file(adapter_dir / name, max_bytes=MAX_UPLOAD_BYTES))
    except BaseException:
        for obj in stored:
            if not _key_in_use(session, obj.key):
                store.delete(obj.key)
        raise
    return stored[0], stored[1]


def _key_in_use(session: Session, key: str) -> bool:
    """Whether a stored version already refers to ``key`` (identical content is shared)."""
    return (
        session.scalar(
            select(func.count())
            .select_from(AdapterVersion)
            .where(
                (AdapterVersion.weights_store_key == key) | (AdapterVersion.config_store_key == key)
            )
        )
        > 0
    )


def _mark_ready(
    version: AdapterVersion, info: AdapterInfo, *, config: StoredObject, weights: StoredObject
) -> None:
    version.status = AdapterStatus.READY.value
    version.rank = info.rank
    version.target_modules = list(info.target_modules)
    version.size_bytes = info.size_bytes
    version.sha256 = info.sha256
    version.config_sha256 = info.config_sha256
    version.weights_store_key = weights.key
    version.config_store_key = config.key


def _discard(
    session: Session, adapter: Adapter, version: AdapterVersion, *, adapter_created: bool
) -> None:
    """Remove a refused upload's rows: its version, and its adapter if this upload made it."""
    session.rollback()  # whatever was pending; the committed rows are deleted below
    session.delete(version)
    session.flush()
    session.expire(adapter, ["versions"])
    if adapter_created and latest_version(session, adapter) is None:
        session.delete(adapter)
    session.commit()


# An upload still uploading/validating after this long was cut off by a crash or restart
# (a live one finishes in seconds to minutes); uploads longer than this are refused anyway.
INTERRUPTED_UPLOAD_AGE = timedelta(hours=1)


def discard_interrupted_uploads(
    sessions: sessionmaker[Session], *, older_than: timedelta = INTERRUPTED_UPLOAD_AGE
) -> int:
    """Remove versions stuck in uploading/validating (and adapters left with no version).

    Their files never reached the store (files are stored only after validation passes),
    so the rows are all there is to clean. Returns how many versions were removed.
    """
    unfinished = (AdapterStatus.UPLOADING.value, AdapterStatus.VALIDATING.value)
    with sessions.begin() as session:
        stale = session.scalars(
            select(AdapterVersion).where(
                AdapterVersion.status.in_(unfinished),
                AdapterVersion.updated_at < utc_now() - older_than,
            )
        ).all()
        adapters = {version.adapter for version in stale}
        for version in stale:
            session.delete(version)
        session.flush()
        for adapter in adapters:
            session.expire(adapter, ["versions"])
            if latest_version(session, adapter) is None:
                session.delete(adapter)
    return len(stale)
