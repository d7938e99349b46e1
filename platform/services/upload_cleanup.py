"""Removing what an unfinished upload leaves behind, and the sweep of abandoned versions.

Objects are content-addressed, so identical files of two versions are one object: an object
is deleted only when no other version names it (:func:`delete_unshared`). A version names
its objects before they are put (``adapter_upload``), so no crash can leave an object in the
store that no version names.

Removing a version deletes its unshared objects first and its row after, so a store that
cannot delete now leaves the row naming them, and a later sweep finishes the job once the
store answers. The adapter goes with its last version.

:func:`sweep_abandoned_uploads` runs when the platform starts and every
:data:`SWEEP_INTERVAL` while it runs (``sweep_periodically``, in the app's lifespan). It
takes over every unfinished version whose lease ran out, and at start every one the
restarted replica itself held (``restarted_owner``):

* a version whose tenant was answered 202 (queued: its worker died, or no worker started
  the task before it expired) becomes *failed* with a reason that says to upload again; its
  files go, its row stays so the tenant can read why;
* any other (the platform serving its request died, or could not reach the store to clean
  up a refused upload) is removed with its files, and its adapter if no version is left: its
  tenant was never told it succeeded.

So a version abandoned in a request is gone within ``REQUEST_LEASE`` + ``SWEEP_INTERVAL``
(75 s), at once when its own replica restarts; a validation whose worker died fails within
``WORKER_LEASE`` + ``SWEEP_INTERVAL``, unless the task is redelivered first (Celery requeues
the task of a killed prefork child at once: the next worker takes the version over and
finishes it); a queued task no worker starts within ``QUEUED_LEASE`` (1 h) expires and its
version fails. A version without a lease (written before leases existed) is swept once it
has not changed for :data:`LEGACY_UNFINISHED_AGE`, as before.

Every function here is blocking.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from loramux.platform.db.models import Adapter, AdapterStatus, AdapterVersion
from loramux.platform.db.types import utc_now
from loramux.platform.services.upload_leases import (
    SWEEP_CLAIM_LEASE,
    UNFINISHED,
    answered_tenant,
    lease_until,
    lock_for_writing,
    release,
    sweeper_owner,
)
from loramux.platform.store import ObjectStore, StoreError

logger = logging.getLogger(__name__)

SWEEP_INTERVAL = timedelta(seconds=15)
LEGACY_UNFINISHED_AGE = timedelta(hours=1)

ABANDONED_VALIDATION = (
    "Adapter rejected: its validation did not finish (the worker validating it stopped, or "
    "no worker took it in time); nothing was kept. Upload the adapter again."
)


# --- objects no other version names ----------------------------------------------------------


def key_in_use(session: Session, key: str, *, besides: Collection[str] = ()) -> bool:
    """Whether a version other than those in ``besides`` names the object ``key``."""
    uses = select(func.count()).where(
        (AdapterVersion.weights_store_key == key) | (AdapterVersion.config_store_key == key)
    )
    if besides:
        uses = uses.where(AdapterVersion.id.not_in(besides))
    return session.scalar(uses.select_from(AdapterVersion)) > 0


def delete_unshared(
    session: Session, store: ObjectStore, keys: Iterable[str], *, besides: Collection[str] = ()
) -> None:
    """Delete the objects no version but those in ``besides`` names; raises ``StoreError``."""
    for key in dict.fromkeys(keys):  # once each, in order
        if not key_in_use(session, key, besides=besides):
            store.delete(key)


def named_keys(version: AdapterVersion) -> list[str]:
    return [k for k in (version.config_store_key, version.weights_store_key) if k is not None]


# --- removing one version --------------------------------------------------------------------


def remove_version(sessions: sessionmaker[Session], version_id: str, owner: str) -> bool:
    """Delete the version's row if ``owner`` holds it, and its adapter if no version is
    left; whether it did. Its objects must be gone already (:func:`delete_unshared`)."""
    with sessions.begin() as session:
        lock_for_writing(session)
        adapter_id = session.scalar(
            select(AdapterVersion.adapter_id).where(AdapterVersion.id == version_id)
        )
        if adapter_id is None:
            return False
        # PostgreSQL: an upload starting now (it locks the adapter too) waits for this to end,
        # then finds the adapter gone and makes a new one, or sees it is still used.
        session.scalar(select(Adapter.id).where(Adapter.id == adapter_id).with_for_update())
        removed = session.execute(
            delete(AdapterVersion).where(
                AdapterVersion.id == version_id, AdapterVersion.lease_owner == owner
            )
        )
        if removed.rowcount != 1:
            return False
        left = session.scalar(
            select(func.count())
            .select_from(AdapterVersion)
            .where(AdapterVersion.adapter_id == adapter_id)
        )
        if left == 0:
            session.execute(delete(Adapter).where(Adapter.id == adapter_id))
    return True


def remove_with_objects(
    sessions: sessionmaker[Session], store: ObjectStore, version_id: str, owner: str
) -> bool:
    """Delete the version's unshared objects, then (if ``owner`` holds it) its rows.

    Raises ``StoreError`` (the row is kept, naming the objects) when the store fails."""
    with sessions() as session:
        version = session.get(AdapterVersion, version_id)
        if version is None or version.lease_owner != owner:
            return False
        delete_unshared(session, store, named_keys(version), besides=[version_id])
    return remove_version(sessions, version_id, owner)


# --- the sweep -------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepResult:
    removed: int = 0  # versions removed (with their files, and emptied adapters)
    failed: int = 0  # queued versions marked failed
    pending: int = 0  # left for a later sweep: the store could not delete their files

    def __add__(self, other: SweepResult) -> SweepResult:
        return SweepResult(
            self.removed + other.removed, self.failed + other.failed, self.pending + other.pending
        )


@dataclass(frozen=True)
class _Candidate:
    id: str
    owner: str | None
    expires_at: datetime | None


def sweep_abandoned_uploads(
    sessions: sessionmaker[Session],
    store: ObjectStore,
    *,
    now: datetime | None = None,
    restarted_owner: str | None = None,
) -> SweepResult:
    """Remove or fail the versions whose owner is gone (see the module); ``now`` is when the
    leases are judged (a test may look ahead), ``restarted_owner`` the owner name of the
    replica that is starting (its earlier process held those versions and is dead)."""
    now = now or utc_now()
    result = SweepResult()
    for candidate in _abandoned(sessions, now, restarted_owner):
        if answered_tenant(candidate.owner):
            result += _fail_queued(sessions, store, candidate)
        else:
            result += _remove_abandoned(sessions, store, candidate)
    result += _delete_files_of_failed(sessions, store)
    if result != SweepResult():
        logger.info("upload sweep: %s", result)
    return result


def _abandoned(
    sessions: sessionmaker[Session], now: datetime, restarted_owner: str | None
) -> list[_Candidate]:
    expired = or_(
        AdapterVersion.lease_expires_at < now,
        AdapterVersion.lease_expires_at.is_(None)
        & (AdapterVersion.updated_at < now - LEGACY_UNFINISHED_AGE),
    )
    if restarted_owner is not None:
        expired = expired | (AdapterVersion.lease_owner == restarted_owner)
    with sessions() as session:
        rows = session.execute(
            select(
                AdapterVersion.id, AdapterVersion.lease_owner, AdapterVersion.lease_expires_at
            ).where(AdapterVersion.status.in_(UNFINISHED), expired)
        ).all()
    return [_Candidate(*row) for row in rows]


def _still_as_seen(candidate: _Candidate):
    """SQL: the version is unfinished and its lease unchanged since the sweep looked (an
    owner that renewed in the meantime is alive after all)."""
    return (
        (AdapterVersion.id == candidate.id)
        & AdapterVersion.status.in_(UNFINISHED)
        & AdapterVersion.lease_owner.is_not_distinct_from(candidate.owner)
        & AdapterVersion.lease_expires_at.is_not_distinct_from(candidate.expires_at)
    )


def _remove_abandoned(
    sessions: sessionmaker[Session], store: ObjectStore, candidate: _Candidate
) -> SweepResult:
    sweeper = sweeper_owner()
    with sessions.begin() as session:
        taken = session.execute(
            update(AdapterVersion)
            .where(_still_as_seen(candidate))
            .values(lease_owner=sweeper, lease_expires_at=lease_until(SWEEP_CLAIM_LEASE))
            .execution_options(synchronize_session=False)
        )
    if taken.rowcount != 1:
        return SweepResult()
    try:
        removed = remove_with_objects(sessions, store, candidate.id, sweeper)
    except StoreError:
        # The claim runs out and a later sweep tries again.
        logger.warning(
            "upload sweep: the store could not delete the files of version %s",
            candidate.id,
            exc_info=True,
        )
        return SweepResult(pending=1)
    return SweepResult(removed=int(removed))


def _fail_queued(
    sessions: sessionmaker[Session], store: ObjectStore, candidate: _Candidate
) -> SweepResult:
    with sessions.begin() as session:
        failed = session.execute(
            update(AdapterVersion)
            .where(_still_as_seen(candidate))
            .values(
                **release(status=AdapterStatus.FAILED.value, failure_reason=ABANDONED_VALIDATION)
            )
            .execution_options(synchronize_session=False)
        )
    if failed.rowcount != 1:
        return SweepResult()
    return SweepResult(failed=1) + _delete_files_of_failed(sessions, store, [candidate.id])


def drop_files_of_failed(
    sessions: sessionmaker[Session], store: ObjectStore, version_id: str
) -> None:
    """A failed version keeps no files: delete its unshared objects, then forget their keys.
    Raises ``StoreError`` (the keys stay, for the sweep to retry) when the store fails."""
    with sessions() as session:
        version = session.get(AdapterVersion, version_id)
        if version is None or version.status != AdapterStatus.FAILED.value:
            return
        keys = named_keys(version)
        if not keys:
            return
        delete_unshared(session, store, keys, besides=[version_id])
    with sessions.begin() as session:
        session.execute(
            update(AdapterVersion)
            .where(
                AdapterVersion.id == version_id,
                AdapterVersion.status == AdapterStatus.FAILED.value,
            )
            .values(config_store_key=None, weights_store_key=None)
            .execution_options(synchronize_session=False)
        )


def _delete_files_of_failed(
    sessions: sessionmaker[Session], store: ObjectStore, version_ids: list[str] | None = None
) -> SweepResult:
    """Finish failed versions that still name files (the store was down when they failed)."""
    if version_ids is None:
        with sessions() as session:
            version_ids = list(
                session.scalars(
                    select(AdapterVersion.id).where(
                        AdapterVersion.status == AdapterStatus.FAILED.value,
                        AdapterVersion.weights_store_key.is_not(None)
                        | AdapterVersion.config_store_key.is_not(None),
                    )
                )
            )
    pending = 0
    for version_id in version_ids:
        try:
            drop_files_of_failed(sessions, store, version_id)
        except StoreError:
            logger.warning(
                "upload sweep: the store could not delete the files of failed version %s",
                version_id,
                exc_info=True,
            )
            pending += 1
    return SweepResult(pending=pending)


async def sweep_periodically(
    sessions: sessionmaker[Session], store: ObjectStore, *, every: timedelta = SWEEP_INTERVAL
) -> None:
    """Sweep every ``every`` until cancelled (a task in the platform's lifespan)."""
    while True:
        await asyncio.sleep(every.total_seconds())
        try:
            await asyncio.to_thread(sweep_abandoned_uploads, sessions, store)
        except Exception:  # the database may be down for a while: try again next time
            logger.exception("upload sweep failed; trying again in %s", every)
