"""``upload_adapter`` and ``validate_stored_version`` against failures, on PostgreSQL and
SQLite: a store outage answers 503 and keeps nothing (or, if the store cannot even delete
what it took, leaves the version for the sweep, which removes it once the store is back);
an upload swept from under its request answers 503; leases are renewed while work goes on,
handed to the queue before the task is sent, and taken over by the worker that runs it."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select

from loramux.platform.db.models import Adapter, AdapterVersion, Tenant
from loramux.platform.db.types import utc_now
from loramux.platform.errors import Unavailable
from loramux.platform.services.adapter_upload import (
    ReceivedUpload,
    ValidationTarget,
    upload_adapter,
    validate_stored_version,
)
from loramux.platform.services.upload_cleanup import SweepResult, sweep_abandoned_uploads
from loramux.platform.services.upload_leases import (
    QUEUE_OWNER,
    QUEUED_LEASE,
    LeaseKeeper,
    request_owner,
    worker_owner,
)
from loramux.platform.store import LocalObjectStore
from tests.fixtures.polling import eventually
from tests.platform.db.factories import add_adapter, add_adapter_version, add_tenant
from tests.platform.services.stores import FlakyStore

OWNER = request_owner("test-replica")
FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(scope="module")
def adapter_dir(make_adapter, tiny_model_dir) -> Path:
    return make_adapter(tiny_model_dir, rank=4, targets=("q_proj",), seed=3)


@pytest.fixture
def target(tiny_model_dir) -> ValidationTarget:
    return ValidationTarget.for_model_dir(
        tiny_model_dir, base_model_id=tiny_model_dir.name, max_rank=8, max_bytes=1 << 24
    )


@pytest.fixture
def tenant_id(make_session) -> str:
    with make_session.begin() as session:
        return add_tenant(session).id


@pytest.fixture
def received(adapter_dir, tmp_path) -> ReceivedUpload:
    folder = tmp_path / "received"
    folder.mkdir()
    for name in FILES:
        shutil.copy(adapter_dir / name, folder / name)
    return ReceivedUpload(folder=folder)


def _counts(make_session) -> tuple[int, int]:
    with make_session() as session:
        adapters = session.scalar(select(func.count()).select_from(Adapter))
        versions = session.scalar(select(func.count()).select_from(AdapterVersion))
    return adapters, versions


def _objects(store: LocalObjectStore) -> list[Path]:
    root = store.root / "sha256"
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def _upload(make_session, store, target, tenant_id, received, name="bot", **kwargs):
    return upload_adapter(
        make_session, store, target, tenant_id, name, received, owner=OWNER, **kwargs
    )


# --- store outages ---------------------------------------------------------------------------


def test_a_store_outage_answers_503_and_keeps_nothing(
    make_session, tmp_path, target, tenant_id, received
):
    store = FlakyStore(LocalObjectStore(tmp_path / "store"))
    store.down = True
    with pytest.raises(Unavailable) as raised:
        _upload(make_session, store, target, tenant_id, received)
    assert raised.value.code == "store_unavailable"
    assert "try again" in raised.value.message.lower()
    assert _counts(make_session) == (0, 0)
    assert _objects(store.inner) == []


def test_an_outage_mid_upload_leaves_the_version_for_the_sweep(
    make_session, tmp_path, target, tenant_id, received
):
    # The config is stored, then the store goes down: it cannot delete the config either.
    store = FlakyStore(LocalObjectStore(tmp_path / "store"), puts_before_outage=1)
    with pytest.raises(Unavailable) as raised:
        _upload(make_session, store, target, tenant_id, received)
    assert raised.value.code == "store_unavailable"
    assert len(_objects(store.inner)) == 1
    with make_session() as session:
        version = session.scalars(select(AdapterVersion)).one()
    # Still naming the stored config, its lease ended at once: the next sweep's to finish.
    assert version.config_store_key is not None
    assert version.lease_expires_at <= utc_now()

    assert sweep_abandoned_uploads(make_session, store) == SweepResult(pending=1)
    store.down = False
    later = utc_now() + timedelta(minutes=2)  # past the first sweep's own claim
    assert sweep_abandoned_uploads(make_session, store, now=later) == SweepResult(removed=1)
    assert _counts(make_session) == (0, 0)
    assert _objects(store.inner) == []


def test_a_failed_put_removes_what_the_upload_stored(
    make_session, tmp_path, target, tenant_id, received
):
    store = FlakyStore(LocalObjectStore(tmp_path / "store"), puts_before_outage=1, blip=True)
    with pytest.raises(Unavailable) as raised:
        _upload(make_session, store, target, tenant_id, received)
    assert raised.value.code == "store_unavailable"
    assert _counts(make_session) == (0, 0)
    assert _objects(store.inner) == []


def test_an_upload_keeps_the_files_another_version_shares(
    make_session, tmp_path, target, tenant_id, received
):
    store = FlakyStore(LocalObjectStore(tmp_path / "store"))
    first = _upload(make_session, store, target, tenant_id, received)
    assert first.version.status == "ready"
    store.down = True
    with pytest.raises(Unavailable):  # the same files under another name share the objects
        _upload(make_session, store, target, tenant_id, received, name="twin")
    assert _counts(make_session) == (1, 1)
    assert len(_objects(store.inner)) == 2


def test_the_same_files_again_are_the_ready_version_they_match(
    make_session, tmp_path, target, tenant_id, received
):
    store = FlakyStore(LocalObjectStore(tmp_path / "store"))
    first = _upload(make_session, store, target, tenant_id, received)
    store.down = True  # nothing is stored again: a down store does not matter
    again = _upload(make_session, store, target, tenant_id, received)
    assert (again.reused, again.version.id, again.version.version) == (True, first.version.id, 1)
    assert _counts(make_session) == (1, 1) and len(_objects(store.inner)) == 2


# --- leases ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _SweptWhileValidating(ValidationTarget):
    """Validation during which the replica is taken for dead and its upload swept."""

    sessions: object = None
    store: object = None

    def validate(self, adapter_dir: Path):
        sweep_abandoned_uploads(self.sessions, self.store, restarted_owner=OWNER)
        return super().validate(adapter_dir)


def test_an_upload_swept_from_under_its_request_answers_503(
    make_session, tmp_path, target, tenant_id, received
):
    store = LocalObjectStore(tmp_path / "store")
    swept = _SweptWhileValidating(**target.__dict__, sessions=make_session, store=store)
    with pytest.raises(Unavailable) as raised:
        _upload(make_session, store, swept, tenant_id, received)
    assert raised.value.code == "upload_interrupted"
    assert _counts(make_session) == (0, 0)
    assert _objects(store) == []


def test_a_queued_upload_is_the_queues_before_its_task_is_sent(
    make_session, tmp_path, target, tenant_id, received
):
    store = LocalObjectStore(tmp_path / "store")
    seen = []

    def enqueue(version_id: str, _target) -> None:
        with make_session() as session:
            version = session.get(AdapterVersion, version_id)
            seen.append((version.status, version.lease_owner, version.lease_expires_at))

    view = _upload(make_session, store, target, tenant_id, received, enqueue=enqueue)
    assert view.version.status == "validating"
    [(status, owner, expires)] = seen
    assert (status, owner) == ("validating", QUEUE_OWNER)
    assert expires > utc_now() + QUEUED_LEASE - timedelta(minutes=1)
    assert len(_objects(store)) == 2


def test_the_lease_is_renewed_while_work_goes_on(make_session):
    with make_session.begin() as session:
        adapter = add_adapter(session, add_tenant(session))
        first = utc_now() + timedelta(seconds=1)
        version_id = add_adapter_version(
            session, adapter, status="uploading", lease_owner=OWNER, lease_expires_at=first
        ).id

    def expires() -> object:
        with make_session() as session:
            return session.get(AdapterVersion, version_id).lease_expires_at

    with LeaseKeeper(make_session, version_id, OWNER, timedelta(seconds=0.4)) as keeper:
        eventually(lambda: expires() > first, "a renewal", timeout_s=10)
        assert not keeper.lost
        with make_session.begin() as session:  # taken over (by a sweep): no longer ours
            session.get(AdapterVersion, version_id).lease_owner = "sweeper:x"
        renewed = expires()
        eventually(lambda: keeper.lost, "the keeper to notice", timeout_s=10)
    assert expires() == renewed


# --- the worker ------------------------------------------------------------------------------


def test_a_worker_takes_over_from_the_queue_or_an_earlier_worker(
    make_session, tmp_path, target, tenant_id, received
):
    store = LocalObjectStore(tmp_path / "store")
    view = _upload(make_session, store, target, tenant_id, received, enqueue=lambda *_: None)
    version_id = view.version.id
    with make_session.begin() as session:  # an earlier worker died while validating it
        session.get(AdapterVersion, version_id).lease_owner = "worker:gone:1"

    assert validate_stored_version(make_session, store, version_id, target) == "ready"
    with make_session() as session:
        version = session.get(AdapterVersion, version_id)
        assert version.lease_owner is None and version.lease_expires_at is None
    # Redelivered once more: nothing to do.
    assert validate_stored_version(make_session, store, version_id, target) == "ready"


def test_a_worker_leaves_a_version_still_in_its_request(make_session, tmp_path, target, tenant_id):
    with make_session.begin() as session:
        adapter = add_adapter(session, session.get(Tenant, tenant_id))
        version_id = add_adapter_version(
            session,
            adapter,
            status="validating",
            lease_owner=OWNER,
            lease_expires_at=utc_now() + timedelta(minutes=1),
        ).id
    store = LocalObjectStore(tmp_path / "store")
    assert validate_stored_version(make_session, store, version_id, target) == "validating"
    with make_session() as session:
        assert session.get(AdapterVersion, version_id).lease_owner == OWNER
    assert worker_owner().startswith("worker:")
