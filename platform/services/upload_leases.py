"""Leases on unfinished adapter versions: who keeps one alive, and until when.

An uploading or validating version is held by exactly one live owner, named in
``AdapterVersion.lease_owner``; the owner renews ``lease_expires_at`` while it works. Every
change an owner makes to its version is conditional on still holding the lease
(:func:`update_if_held`), so once the sweep (``loramux.platform.services.upload_cleanup``)
has taken an expired version over, a late owner can no longer touch it.

Owners, and how long each lease runs (renewed every quarter of it while the work goes on):

* ``platform:<id>`` (:func:`request_owner`): the platform replica whose request receives,
  checks and stores the upload; :data:`REQUEST_LEASE`. ``<id>`` is the replica's data
  directory's id, so a replica restarted on its data directory knows every version it held
  before is abandoned and removes them at once.
* ``queue`` (:data:`QUEUE_OWNER`): validation was queued and the tenant answered 202; the
  task waits for a worker. :data:`QUEUED_LEASE` is also the task's expiry, so once it runs
  out no worker will start the task any more.
* ``worker:<host>:<pid>`` (:func:`worker_owner`): the worker process validating it, from
  the moment the task starts; :data:`WORKER_LEASE`. A redelivered task (its first worker
  died) takes the version over from the earlier worker.
* ``sweeper:<uuid>`` (:func:`sweeper_owner`): a sweep that took over an expired version to
  remove it (or fail it); :data:`SWEEP_CLAIM_LEASE`, after which another sweep may retry.

Times are the processes' own clocks (UTC), so replicas and workers must agree on the time
to within seconds (NTP), far less than a lease.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import update
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from loramux.platform.db.models import AdapterStatus, AdapterVersion
from loramux.platform.db.types import utc_now

logger = logging.getLogger(__name__)

REQUEST_LEASE = timedelta(seconds=60)
WORKER_LEASE = timedelta(seconds=60)
QUEUED_LEASE = timedelta(hours=1)
SWEEP_CLAIM_LEASE = timedelta(seconds=60)
RENEWALS_PER_LEASE = 4  # renew every quarter of a lease: three renewals may fail in a row

QUEUE_OWNER = "queue"
_REQUEST_PREFIX = "platform:"
_WORKER_PREFIX = "worker:"

UNFINISHED = (AdapterStatus.UPLOADING.value, AdapterStatus.VALIDATING.value)

# SQLSTATEs of PostgreSQL's lock and serialisation conflicts: worth a retry.
_PG_CONTENTION = {"40001", "40P01", "55P03"}


class LeaseLost(Exception):
    """The version is no longer held by this owner (swept after its lease ran out)."""


# --- owners --------------------------------------------------------------------------------


def request_owner(instance_id: str) -> str:
    return f"{_REQUEST_PREFIX}{instance_id}"


def worker_owner() -> str:
    """This process as a validating worker (a prefork child has its own pid)."""
    return f"{_WORKER_PREFIX}{socket.gethostname()}:{os.getpid()}"


def sweeper_owner() -> str:
    return f"sweeper:{uuid.uuid4().hex}"


def answered_tenant(owner: str | None) -> bool:
    """Whether the tenant was told the upload is being validated (202): it was queued."""
    return owner is not None and (owner == QUEUE_OWNER or owner.startswith(_WORKER_PREFIX))


def queued_or_validating_by_worker(column):
    """SQL: the version's owner is the queue or a worker (what a worker may take over)."""
    return (column == QUEUE_OWNER) | column.startswith(_WORKER_PREFIX)


def lease_until(duration: timedelta, now: datetime | None = None) -> datetime:
    return (now or utc_now()) + duration


# --- conditional writes --------------------------------------------------------------------


def update_if_held(session: Session, version_id: str, owner: str, **values: Any) -> bool:
    """Set ``values`` on the unfinished version if ``owner`` still holds it; whether it did."""
    result = session.execute(
        update(AdapterVersion)
        .where(
            AdapterVersion.id == version_id,
            AdapterVersion.lease_owner == owner,
            AdapterVersion.status.in_(UNFINISHED),
        )
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1


def write_if_held(
    sessions: sessionmaker[Session], version_id: str, owner: str, **values: Any
) -> None:
    """:func:`update_if_held` in a transaction of its own; :class:`LeaseLost` if not held."""
    with sessions.begin() as session:
        if not update_if_held(session, version_id, owner, **values):
            raise LeaseLost(version_id)


def release(**values: Any) -> dict[str, Any]:
    """``values`` plus an ended lease: what a version that is done (ready, failed) gets."""
    return {**values, "lease_owner": None, "lease_expires_at": None}


def renew(
    sessions: sessionmaker[Session], version_id: str, owner: str, duration: timedelta
) -> bool:
    with sessions.begin() as session:
        return update_if_held(session, version_id, owner, lease_expires_at=lease_until(duration))


class LeaseKeeper:
    """Renews one version's lease from a background thread while a block of work runs.

    A renewal that fails (database briefly down) is logged and tried again next time; one
    that finds the lease no longer held stops renewing and sets :attr:`lost`.
    """

    def __init__(
        self, sessions: sessionmaker[Session], version_id: str, owner: str, duration: timedelta
    ) -> None:
        self._sessions = sessions
        self._version_id = version_id
        self._owner = owner
        self._duration = duration
        self._every_s = duration.total_seconds() / RENEWALS_PER_LEASE
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"lease-{version_id[:8]}", daemon=True
        )
        self.lost = False

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            try:
                held = renew(self._sessions, self._version_id, self._owner, self._duration)
            except Exception:
                logger.warning(
                    "could not renew the lease of version %s", self._version_id, exc_info=True
                )
                continue
            if not held:
                self.lost = True
                return


# --- SQLite and PostgreSQL alike -----------------------------------------------------------


def lock_for_writing(session: Session) -> None:
    """Start the session's transaction holding the database's write lock, so what it reads
    stays true until it commits: SQLite ignores ``FOR UPDATE`` and reads outside any
    transaction until the first write, so it gets ``BEGIN IMMEDIATE`` (waiting up to the
    busy timeout for other writers). PostgreSQL needs nothing here: callers lock the rows
    they read with ``FOR UPDATE``. Call it first thing in a transaction."""
    if session.get_bind().dialect.name == "sqlite":
        session.connection().exec_driver_sql("BEGIN IMMEDIATE")


def is_contention(exc: Exception) -> bool:
    """Whether a database error is another writer's doing, so trying again may succeed: a
    unique or foreign key race, SQLite's busy lock, PostgreSQL's lock conflicts."""
    if isinstance(exc, IntegrityError):
        return True
    if not isinstance(exc, OperationalError):
        return False
    cause = exc.orig
    if getattr(cause, "sqlstate", None) in _PG_CONTENTION:
        return True
    message = str(cause).lower()
    return "database is locked" in message or "database is busy" in message
