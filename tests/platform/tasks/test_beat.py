"""A real ``celery beat`` and worker on Redis: the usage roll-up runs on its own, on schedule.

``LORAMUX_USAGE_ROLLUP_INTERVAL_S=1`` makes beat send ``loramux.rollup_usage`` every second;
the worker rolls up every closed day, and only closed days.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select

from loramux.platform.db.models import UsageDaily
from loramux.platform.db.types import utc_now
from tests.platform.db.factories import add_adapter, add_tenant, usage_record
from tests.platform.tasks.worker_process import (
    running_beat,
    running_worker,
    wait_until,
    worker_env,
)


def test_beat_and_a_worker_roll_up_closed_days(
    redis_url, database_url, sessions, data_dir, tmp_path
):
    now = utc_now()
    closed = (now - timedelta(days=2)).replace(hour=12, minute=0, second=0, microsecond=0)
    with sessions.begin() as session:
        first, second = add_tenant(session), add_tenant(session)
        adapter = add_adapter(session, first)
        records = [
            usage_record(first, created_at=closed, cost_micro_usd=11),
            usage_record(
                first, created_at=closed, adapter_id=adapter.id, model="a", prompt_tokens=20
            ),
            usage_record(
                first, created_at=closed + timedelta(hours=1), adapter_id=adapter.id, model="a"
            ),
            usage_record(second, created_at=closed, completion_tokens=9, cost_micro_usd=70),
            usage_record(second, created_at=now),  # today: not closed, not rolled up
        ]
        session.add_all(records)
        expected = {
            (first.id, None, "base"): (1, 10, 5, 11),
            (first.id, adapter.id, "a"): (2, 30, 10, 60),
            (second.id, None, "base"): (1, 10, 9, 70),
        }

    env = {
        **worker_env(
            # A database of its own: no other test's messages reach this worker.
            broker_url=redis_url.rsplit("/", 1)[0] + "/4",
            database_url=database_url,
            data_dir=data_dir,
        ),
        "LORAMUX_USAGE_ROLLUP_INTERVAL_S": "1",
    }
    worker_log, beat_log = tmp_path / "worker.log", tmp_path / "beat.log"

    def rolled() -> list[UsageDaily]:
        assert beat.poll() is None, f"beat exited; log:\n{beat_log.read_text()}"
        with sessions() as session:
            return session.scalars(select(UsageDaily)).all()

    with (
        running_worker(env, worker_log) as worker,
        running_beat(env, beat_log, tmp_path / "beat-schedule") as beat,
    ):
        rows = wait_until(rolled, worker, worker_log, "usage_daily rows", timeout_s=20)

    assert {row.day for row in rows} == {closed.date()}
    assert {
        (row.tenant_id, row.adapter_id, row.model): (
            row.requests,
            row.prompt_tokens,
            row.completion_tokens,
            row.cost_micro_usd,
        )
        for row in rows
    } == expected
    assert "rollup_usage" in beat_log.read_text()
