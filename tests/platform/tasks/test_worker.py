"""A real Celery worker (``celery -A loramux.platform.tasks.worker``) on Redis runs the export."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from sqlalchemy import select

from loramux.platform.db.models import BillingExport
from loramux.platform.settings import Settings
from loramux.platform.tasks.celery_app import EXPORT_DAILY_BILLING, make_celery
from tests.platform.tasks.usage import DAY_START, add_day_of_usage

REPO_ROOT = Path(__file__).resolve().parents[3]
WAIT_S = 30.0


def _start_worker(env: dict[str, str], log: Path) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "loramux.platform.tasks.worker",
        "worker",
        "--pool=solo",
        "--concurrency=1",
        "-Q",
        "celery",
        "--loglevel=INFO",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
    with log.open("wb") as out:
        return subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out
        )


def _stop(worker: subprocess.Popen) -> None:
    if worker.poll() is None:
        worker.terminate()
        try:
            worker.wait(timeout=15)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(timeout=15)


def _wait_for_export(sessions, worker: subprocess.Popen, log: Path) -> BillingExport:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        with sessions() as session:
            export = session.scalars(select(BillingExport)).one_or_none()
        if export is not None:
            return export
        assert worker.poll() is None, f"worker exited ({worker.returncode}):\n{log.read_text()}"
        time.sleep(0.2)
    raise AssertionError(f"no export within {WAIT_S:.0f}s; worker log:\n{log.read_text()}")


def test_worker_runs_the_daily_export_sent_by_name(
    redis_url, database_url, sessions, data_dir, store, tmp_path
):
    add_day_of_usage(sessions)
    env = {
        **os.environ,
        "LORAMUX_CELERY_BROKER_URL": redis_url,
        "LORAMUX_DATABASE_URL": database_url,
        "LORAMUX_DATA_DIR": str(data_dir),
        "LORAMUX_STORE_BACKEND": "local",
    }
    log = tmp_path / "worker.log"
    sender = make_celery(Settings(data_dir=data_dir, celery_broker_url=redis_url))
    worker = _start_worker(env, log)
    try:
        sender.send_task(EXPORT_DAILY_BILLING, kwargs={"day": DAY_START.date().isoformat()})
        export = _wait_for_export(sessions, worker, log)
    finally:
        _stop(worker)
        sender.close()

    assert export.period_start == DAY_START and export.group_by == "request"
    assert export.rows == 3
    assert store.exists(export.store_key)
