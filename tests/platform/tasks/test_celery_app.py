"""make_celery: JSON only, the beat schedule, and tasks run in-process without a broker."""

from __future__ import annotations

from datetime import UTC, date, datetime

from celery.schedules import crontab
from sqlalchemy import select

from loramux.platform.db.models import BillingExport
from loramux.platform.services.billing import usage_report
from loramux.platform.settings import Settings
from loramux.platform.tasks.celery_app import (
    EXPORT_DAILY_BILLING,
    make_celery,
    previous_utc_day,
    utc_day_bounds,
)
from tests.platform.tasks.usage import DAY_END, DAY_START, add_day_of_usage


def test_messages_are_json_only_and_beat_exports_daily_at_0010_utc(tmp_path):
    app = make_celery(Settings(data_dir=tmp_path, celery_broker_url="redis://127.0.0.1:1/0"))
    assert app.conf.task_serializer == "json"
    assert app.conf.result_serializer == "json"
    assert list(app.conf.accept_content) == ["json"]
    assert app.conf.task_always_eager is False
    assert app.conf.timezone == "UTC" and app.conf.enable_utc
    (entry,) = app.conf.beat_schedule.values()
    assert entry["task"] == EXPORT_DAILY_BILLING
    assert entry["schedule"] == crontab(hour=0, minute=10)
    assert EXPORT_DAILY_BILLING in app.tasks


def test_without_a_broker_tasks_are_eager(tmp_path):
    assert make_celery(Settings(data_dir=tmp_path)).conf.task_always_eager is True


def test_previous_utc_day_and_day_bounds():
    assert previous_utc_day(datetime(2031, 3, 5, 0, 10, tzinfo=UTC)) == date(2031, 3, 4)
    late_in_new_york = datetime.fromisoformat("2031-03-04T21:00:00-05:00")  # 02:00 UTC on 5th
    assert previous_utc_day(late_in_new_york) == date(2031, 3, 4)
    assert utc_day_bounds(date(2031, 3, 4)) == (DAY_START, DAY_END)


def test_eager_delay_exports_in_process(database_url, sessions, data_dir, store):
    add_day_of_usage(sessions)
    app = make_celery(
        Settings(data_dir=data_dir, database_url=database_url, billing_export_group_by="day")
    )

    result = app.tasks[EXPORT_DAILY_BILLING].delay(day=DAY_START.date().isoformat())

    summary = result.get()
    with sessions() as session:
        export = session.scalars(select(BillingExport)).one()
        report = usage_report(session, start=DAY_START, end=DAY_END, group_by="day")
    assert summary["id"] == export.id and summary["store_key"] == export.store_key
    assert summary["day"] == "2031-03-04" and export.group_by == "day"
    assert export.period_start == DAY_START and export.period_end == DAY_END
    assert export.rows == len(report.rows) == 2  # two tenants, one day
    assert store.exists(export.store_key)

    again = app.tasks[EXPORT_DAILY_BILLING].delay(day="2031-03-04").get()
    assert again == summary


def test_each_app_has_its_own_task_bound_to_its_own_settings(tmp_path):
    first = make_celery(Settings(data_dir=tmp_path / "a"))
    second = make_celery(Settings(data_dir=tmp_path / "b"))
    assert first.tasks[EXPORT_DAILY_BILLING] is not second.tasks[EXPORT_DAILY_BILLING]
