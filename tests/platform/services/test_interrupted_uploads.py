"""The sweep of abandoned uploads, on PostgreSQL and SQLite: a version whose owner's lease ran
out (or whose replica restarted) is removed with the files no other version shares, or, if
its tenant was answered 202, failed with a reason; live ones are never touched."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, select

from loramux.platform.db.models import Adapter, AdapterVersion
from loramux.platform.db.types import utc_now
from loramux.platform.services.upload_cleanup import (
    ABANDONED_VALIDATION,
    SweepResult,
    sweep_abandoned_uploads,
)
from loramux.platform.services.upload_leases import (
    QUEUE_OWNER,
    REQUEST_LEASE,
    WORKER_LEASE,
    request_owner,
)
from loramux.platform.store.local import LocalObjectStore
from tests.platform.db.factories import add_adapter, add_adapter_version, add_tenant
from tests.platform.services.stores import FlakyStore

ME = request_owner("this-replica")
OTHER = request_owner("other-replica")
WORKER = "worker:host-a:4242"


def _rows(make_session) -> set[tuple[str, int, str]]:
    with make_session() as session:
        return set(
            session.execute(
                select(Adapter.name, AdapterVersion.version, AdapterVersion.status).join(
                    AdapterVersion.adapter
                )
            )
        )


def _adapter_names(make_session) -> set[str]:
    with make_session() as session:
        return set(session.scalars(select(Adapter.name)))


def test_legacy_unfinished_versions_without_a_lease_go_after_an_hour(make_session, tmp_path):
    store = LocalObjectStore(tmp_path / "store")
    staged = store.put_stream(b"staged weights nobody else has")
    shared = store.put_stream(b"a config a ready version uses too")
    long_ago = utc_now() - timedelta(hours=3)
    with make_session.begin() as session:
        tenant = add_tenant(session)
        # An adapter whose only version was cut off while queued: rows and its file go.
        orphan = add_adapter(session, tenant, name="orphan")
        add_adapter_version(
            session,
            orphan,
            1,
            status="validating",
            updated_at=long_ago,
            weights_store_key=staged.key,
            config_store_key=shared.key,
        )
        # A ready v1 and a cut-off v2: only v2 goes.
        kept = add_adapter(session, tenant, name="kept")
        add_adapter_version(
            session, kept, 1, status="ready", updated_at=long_ago, config_store_key=shared.key
        )
        add_adapter_version(session, kept, 2, status="uploading", updated_at=long_ago)
        # Written just now without a lease (an older replica during an upgrade): untouched.
        live = add_adapter(session, tenant, name="live")
        add_adapter_version(session, live, 1, status="validating")

    assert sweep_abandoned_uploads(make_session, store) == SweepResult(removed=2)
    assert not store.exists(staged.key)
    assert store.exists(shared.key)  # still the ready version's
    assert _adapter_names(make_session) == {"kept", "live"}
    assert _rows(make_session) == {("kept", 1, "ready"), ("live", 1, "validating")}
    assert sweep_abandoned_uploads(make_session, store) == SweepResult()


def test_expired_request_leases_are_removed_and_live_ones_kept(make_session, tmp_path):
    store = LocalObjectStore(tmp_path / "store")
    files = store.put_stream(b"weights of a dead request")
    now = utc_now()
    with make_session.begin() as session:
        tenant = add_tenant(session)
        dead = add_adapter(session, tenant, name="dead")
        add_adapter_version(
            session,
            dead,
            1,
            status="validating",
            lease_owner=OTHER,
            lease_expires_at=now - timedelta(seconds=1),
            weights_store_key=files.key,
        )
        alive = add_adapter(session, tenant, name="alive")
        add_adapter_version(
            session,
            alive,
            1,
            status="uploading",
            lease_owner=OTHER,
            lease_expires_at=now + REQUEST_LEASE,
        )

    assert sweep_abandoned_uploads(make_session, store, now=now) == SweepResult(removed=1)
    assert not store.exists(files.key)
    assert _rows(make_session) == {("alive", 1, "uploading")}
    # A lease that ran out is not renewed by anyone: a later sweep takes that one too.
    later = now + REQUEST_LEASE + timedelta(seconds=1)
    assert sweep_abandoned_uploads(make_session, store, now=later) == SweepResult(removed=1)
    assert _adapter_names(make_session) == set()


def test_a_restarted_replica_removes_its_own_versions_at_once(make_session, tmp_path):
    store = LocalObjectStore(tmp_path / "store")
    lease = utc_now() + REQUEST_LEASE  # still running: only the restart tells they are dead
    with make_session.begin() as session:
        tenant = add_tenant(session)
        mine = add_adapter(session, tenant, name="mine")
        add_adapter_version(session, mine, 1, status="ready")
        add_adapter_version(
            session, mine, 2, status="validating", lease_owner=ME, lease_expires_at=lease
        )
        theirs = add_adapter(session, tenant, name="theirs")
        add_adapter_version(
            session, theirs, 1, status="uploading", lease_owner=OTHER, lease_expires_at=lease
        )
        queued = add_adapter(session, tenant, name="queued")
        add_adapter_version(
            session, queued, 1, status="validating", lease_owner=QUEUE_OWNER, lease_expires_at=lease
        )

    swept = sweep_abandoned_uploads(make_session, store, restarted_owner=ME)
    assert swept == SweepResult(removed=1)
    assert _rows(make_session) == {
        ("mine", 1, "ready"),
        ("theirs", 1, "uploading"),
        ("queued", 1, "validating"),
    }


def test_abandoned_queued_validations_fail_with_a_reason(make_session, tmp_path):
    store = LocalObjectStore(tmp_path / "store")
    mine = store.put_stream(b"weights only the lost validation has")
    shared = store.put_stream(b"a config a ready adapter has too")
    now = utc_now()
    with make_session.begin() as session:
        tenant = add_tenant(session)
        ready = add_adapter(session, tenant, name="ready")
        add_adapter_version(session, ready, 1, status="ready", config_store_key=shared.key)
        for name, owner in (("worker-died", WORKER), ("never-started", QUEUE_OWNER)):
            adapter = add_adapter(session, tenant, name=name)
            add_adapter_version(
                session,
                adapter,
                1,
                status="validating",
                lease_owner=owner,
                lease_expires_at=now - timedelta(seconds=1),
                weights_store_key=mine.key,
                config_store_key=shared.key,
            )
        running = add_adapter(session, tenant, name="running")
        add_adapter_version(
            session,
            running,
            1,
            status="validating",
            lease_owner=WORKER,
            lease_expires_at=now + WORKER_LEASE,
        )

    assert sweep_abandoned_uploads(make_session, store, now=now) == SweepResult(failed=2)
    assert not store.exists(mine.key)
    assert store.exists(shared.key)
    with make_session() as session:
        failed = session.scalars(
            select(AdapterVersion).where(AdapterVersion.status == "failed")
        ).all()
    assert len(failed) == 2
    for version in failed:
        assert version.failure_reason == ABANDONED_VALIDATION
        assert version.weights_store_key is None and version.config_store_key is None
        assert version.lease_owner is None and version.lease_expires_at is None
    assert ("running", 1, "validating") in _rows(make_session)


def test_a_store_outage_leaves_the_version_for_a_later_sweep(make_session, tmp_path):
    store = FlakyStore(LocalObjectStore(tmp_path / "store"))
    files = store.put_stream(b"weights of a dead request")
    expired = utc_now() - timedelta(seconds=1)
    with make_session.begin() as session:
        adapter = add_adapter(session, add_tenant(session), name="dead")
        add_adapter_version(
            session,
            adapter,
            1,
            status="validating",
            lease_owner=OTHER,
            lease_expires_at=expired,
            weights_store_key=files.key,
        )

    store.down = True
    assert sweep_abandoned_uploads(make_session, store) == SweepResult(pending=1)
    assert store.inner.exists(files.key)
    assert _adapter_names(make_session) == {"dead"}  # the row still names the file

    store.down = False  # the sweep's own claim must run out before another sweep retries
    later = utc_now() + timedelta(minutes=2)
    assert sweep_abandoned_uploads(make_session, store, now=later) == SweepResult(removed=1)
    assert not store.inner.exists(files.key)
    with make_session() as session:
        assert session.scalar(select(func.count()).select_from(AdapterVersion)) == 0
        assert session.scalar(select(func.count()).select_from(Adapter)) == 0


def test_nothing_to_do_on_an_empty_database(make_session, tmp_path):
    assert sweep_abandoned_uploads(make_session, LocalObjectStore(tmp_path)) == SweepResult()
