"""A real Celery worker (``celery -A loramux.platform.tasks.worker``) on Redis runs the export."""

from __future__ import annotations

from sqlalchemy import select

from loramux.platform.db.models import BillingExport
from loramux.platform.settings import Settings
from loramux.platform.tasks.celery_app import EXPORT_DAILY_BILLING, make_celery
from tests.platform.tasks.usage import DAY_START, add_day_of_usage
from tests.platform.tasks.worker_process import running_worker, wait_until, worker_env


def _export(sessions) -> BillingExport | None:
    with sessions() as session:
        return session.scalars(select(BillingExport)).one_or_none()


def test_worker_runs_the_daily_export_sent_by_name(
    redis_url, database_url, sessions, data_dir, store, tmp_path
):
    add_day_of_usage(sessions)
    env = worker_env(broker_url=redis_url, database_url=database_url, data_dir=data_dir)
    log = tmp_path / "worker.log"
    sender = make_celery(Settings(data_dir=data_dir, celery_broker_url=redis_url))
    try:
        with running_worker(env, log) as worker:
            sender.send_task(EXPORT_DAILY_BILLING, kwargs={"day": DAY_START.date().isoformat()})
            export = wait_until(lambda: _export(sessions), worker, log, "export")
    finally:
        sender.close()

    assert export.period_start == DAY_START and export.group_by == "request"
    assert export.rows == 3
    assert store.exists(export.store_key)
