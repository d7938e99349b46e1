"""A Celery worker SIGKILLed in the middle of validating a queued upload (PostgreSQL, Redis).

To hold the worker inside the task, the stored weights object is swapped for a named pipe
holding nothing yet: the worker takes the version over (its lease names its pid), then
blocks reading the pipe until the test writes the real bytes into it.

* A prefork child killed mid-validation: Celery requeues the task at once
  (``task_reject_on_worker_lost``); the replacement child takes the version over from the
  dead one and finishes it: ``ready``.
* A whole (solo) worker killed mid-validation: nothing requeues the task before the broker's
  visibility timeout. The version keeps the dead worker's lease until it runs out, then the
  sweep fails it with a reason and deletes its files; a late redelivery changes nothing.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from loramux.platform.app import create_app
from loramux.platform.context import PlatformContext, build_context
from loramux.platform.db.models import AdapterVersion
from loramux.platform.db.types import utc_now
from loramux.platform.services.adapter_upload import validate_stored_version
from loramux.platform.services.upload_cleanup import (
    ABANDONED_VALIDATION,
    SweepResult,
    sweep_abandoned_uploads,
)
from loramux.platform.services.upload_leases import QUEUE_OWNER, WORKER_LEASE
from loramux.platform.services.upload_workspace import WorkerScratch
from loramux.platform.settings import Settings
from tests.platform.tasks.worker_process import running_worker, wait_until, worker_env

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture
def broker_url(redis_url: str) -> Iterator[str]:
    # A database of its own, emptied after: a killed worker leaves its unacked task there.
    url = redis_url.rsplit("/", 1)[0] + "/5"
    yield url
    redis.Redis.from_url(url).flushdb()


@pytest.fixture
def context(tmp_path, tiny_model_dir, database_url, broker_url) -> Iterator[PlatformContext]:
    settings = Settings(
        data_dir=tmp_path / "data",
        model=str(tiny_model_dir),
        database_url=database_url,
        celery_broker_url=broker_url,
    )
    context = build_context(settings, log=lambda _: None)
    try:
        yield context
    finally:
        context.tasks.close()
        context.sessions.kw["bind"].dispose()


@pytest.fixture
def adapter_dir(make_adapter, tiny_model_dir) -> Path:
    return make_adapter(tiny_model_dir, rank=4, targets=("q_proj",), seed=9)


def _worker_env(context: PlatformContext, database_url: str, tmp_path: Path) -> dict[str, str]:
    """The worker's environment; its system temp dir is the test's, to check that nothing
    lands there (validations work in the data directory's scratch)."""
    (tmp_path / "worker-tmp").mkdir(exist_ok=True)
    env = worker_env(
        broker_url=context.settings.celery_broker_url,
        database_url=database_url,
        data_dir=context.settings.data_dir,
    )
    return {**env, "TMPDIR": str(tmp_path / "worker-tmp")}


def _queue_upload(client: TestClient, context: PlatformContext, adapter_dir: Path) -> str:
    """Upload with no worker running yet; the version's id (validating, the queue's)."""
    admin = {"Authorization": f"Bearer {context.admin_token}"}
    tenant = client.post("/admin/tenants", json={"name": "t"}, headers=admin).json()
    key = client.post(f"/admin/tenants/{tenant['id']}/api-keys", headers=admin).json()["key"]
    files = [("files", (n, (adapter_dir / n).read_bytes())) for n in (CONFIG, WEIGHTS)]
    sent = client.post(
        "/v1/adapters",
        data={"name": "held"},
        files=files,
        headers={"Authorization": f"Bearer {key}"},
    )
    assert sent.status_code == 202, sent.text
    with context.sessions() as session:
        version = session.query(AdapterVersion).one()
        assert (version.status, version.lease_owner) == ("validating", QUEUE_OWNER)
        return version.id


def _version(context: PlatformContext, version_id: str) -> AdapterVersion | None:
    with context.sessions() as session:
        return session.get(AdapterVersion, version_id)


def _swap_weights_for_a_pipe(context: PlatformContext, version_id: str) -> tuple[Path, bytes]:
    path = context.store.path_of(_version(context, version_id).weights_store_key)
    content = path.read_bytes()
    path.unlink()
    os.mkfifo(path)
    return path, content


def _worker_pid(context: PlatformContext, version_id: str, other_than: int | None = None):
    """The pid in the version's lease once a worker (other than ``other_than``) holds it."""
    owner = _version(context, version_id).lease_owner or ""
    if not owner.startswith("worker:"):
        return None
    pid = int(owner.rsplit(":", 1)[1])
    return None if pid == other_than else pid


def _feed(pipe: Path, content: bytes) -> threading.Thread:
    """Write ``content`` into the pipe once a reader opens it (in a thread: open blocks)."""

    def write() -> None:
        with pipe.open("wb") as out:
            out.write(content)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    return writer


def _restore(pipe: Path, content: bytes) -> None:
    """Put the object back as a regular file (the store's own layout)."""
    if pipe.exists() and not pipe.is_file():
        pipe.unlink()
        pipe.write_bytes(content)


def test_a_killed_prefork_child_is_replaced_and_the_task_finishes(
    context, adapter_dir, database_url, tmp_path
):
    env = _worker_env(context, database_url, tmp_path)
    log = tmp_path / "worker.log"
    with TestClient(create_app(context)) as client:
        version_id = _queue_upload(client, context, adapter_dir)
        pipe, content = _swap_weights_for_a_pipe(context, version_id)
        try:
            with running_worker(env, log, pool="prefork") as worker:
                first = wait_until(
                    lambda: _worker_pid(context, version_id), worker, log, "a worker child"
                )
                os.kill(first, signal.SIGKILL)  # blocked reading the pipe: mid-validation
                second = wait_until(
                    lambda: _worker_pid(context, version_id, other_than=first),
                    worker,
                    log,
                    "the task redelivered to a new child",
                )
                assert second != first
                writer = _feed(pipe, content)
                wait_until(
                    lambda: _version(context, version_id).status != "validating",
                    worker,
                    log,
                    "the verdict",
                )
                writer.join(timeout=10)
        finally:
            _restore(pipe, content)

    version = _version(context, version_id)
    assert version.status == "ready", version.failure_reason
    # The killed child's validation folder went when its replacement started.
    scratch = WorkerScratch.in_data_dir(context.settings.data_dir)
    assert not (scratch.root / f"{scratch.host}-{first}").exists()
    assert list((tmp_path / "worker-tmp").iterdir()) == []
    assert version.lease_owner is None and version.lease_expires_at is None
    assert context.store.exists(version.weights_store_key)


def test_a_killed_worker_leaves_the_version_to_the_sweep(
    context, adapter_dir, database_url, tmp_path
):
    env = _worker_env(context, database_url, tmp_path)
    log = tmp_path / "worker.log"
    with TestClient(create_app(context)) as client:
        version_id = _queue_upload(client, context, adapter_dir)
    pipe, content = _swap_weights_for_a_pipe(context, version_id)
    try:
        with running_worker(env, log) as worker:
            pid = wait_until(lambda: _worker_pid(context, version_id), worker, log, "the worker")
            assert pid == worker.pid  # solo: the task runs in the worker itself
            worker.kill()
            worker.wait(timeout=15)
    finally:
        _restore(pipe, content)

    # The validation folder was in the data directory, not the system's temp directory;
    # the next worker process of this host removes it (the dead worker cannot).
    assert list((tmp_path / "worker-tmp").iterdir()) == []
    scratch = WorkerScratch.in_data_dir(context.settings.data_dir)
    assert (scratch.root / f"{scratch.host}-{pid}").is_dir()
    assert scratch.remove_dead() == 1
    assert list(scratch.root.iterdir()) == []

    held = _version(context, version_id)
    assert held.status == "validating" and held.lease_expires_at > utc_now()
    # While the dead worker's lease runs, the version is left alone (it might come back).
    assert sweep_abandoned_uploads(context.sessions, context.store) == SweepResult()
    after_lease = utc_now() + WORKER_LEASE + timedelta(seconds=1)
    swept = sweep_abandoned_uploads(context.sessions, context.store, now=after_lease)
    assert swept == SweepResult(failed=1)

    version = _version(context, version_id)
    assert version.status == "failed"
    assert version.failure_reason == ABANDONED_VALIDATION
    assert version.weights_store_key is None and version.config_store_key is None
    assert not pipe.exists()
    assert [p for p in (context.store.root / "sha256").rglob("*") if p.is_file()] == []
    # The task, redelivered after the broker's visibility timeout, finds nothing to do.
    target = context.validation_target()
    assert validate_stored_version(context.sessions, context.store, version_id, target) == (
        "failed"
    )
