"""make_celery: JSON only, the beat schedule, and tasks run in-process without a broker."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import pytest
from celery.schedules import crontab
from sqlalchemy import func, select

from loramux.platform.db.models import BillingExport, UsageDaily
from loramux.platform.db.types import utc_now
from loramux.platform.services.billing import usage_report
from loramux.platform.services.rollups import days_between, last_closed_day, utc_day_bounds
from loramux.platform.settings import Settings
from loramux.platform.tasks.celery_app import EXPORT_DAILY_BILLING, ROLLUP_USAGE, make_celery
from tests.platform.db.factories import add_tenant, usage_record
from tests.platform.tasks.usage import DAY_END, DAY_START, add_day_of_usage


def test_messages_are_json_only_and_beat_sends_registered_tasks(tmp_path):
    app = make_celery(
        Settings(
            data_dir=tmp_path,
            celery_broker_url="redis://127.0.0.1:1/0",
            usage_rollup_interval_s=120,
        )
    )
    assert app.conf.task_serializer == "json"
    assert app.conf.result_serializer == "json"
    assert list(app.conf.accept_content) == ["json"]
    assert app.conf.task_always_eager is False
    assert app.conf.timezone == "UTC" and app.conf.enable_utc
    schedule = app.conf.beat_schedule
    assert schedule["export-daily-billing"]["task"] == EXPORT_DAILY_BILLING
    assert schedule["export-daily-billing"]["schedule"] == crontab(hour=0, minute=10)
    assert schedule["rollup-usage"]["task"] == ROLLUP_USAGE
    assert schedule["rollup-usage"]["schedule"] == timedelta(seconds=120)
    assert {entry["task"] for entry in schedule.values()} <= set(app.tasks)
    assert len(schedule) == 2


def test_the_rollup_interval_defaults_to_an_hour(tmp_path):
    schedule = make_celery(Settings(data_dir=tmp_path)).conf.beat_schedule
    assert schedule["rollup-usage"]["schedule"] == timedelta(hours=1)


def test_without_a_broker_tasks_are_eager(tmp_path):
    assert make_celery(Settings(data_dir=tmp_path)).conf.task_always_eager is True


def test_day_bounds_and_closed_days():
    assert utc_day_bounds(date(2025, 3, 4)) == (DAY_START, DAY_END)
    # A day closes five minutes after its end, wherever the clock that says so is.
    assert last_closed_day(datetime(2031, 3, 5, 0, 4, 59, tzinfo=UTC)) == date(2031, 3, 3)
    assert last_closed_day(datetime(2031, 3, 5, 0, 5, tzinfo=UTC)) == date(2031, 3, 4)
    late_in_new_york = datetime.fromisoformat("2031-03-04T21:00:00-05:00")  # 02:00 UTC on 5th
    assert last_closed_day(late_in_new_york) == date(2031, 3, 4)


def _app(data_dir, database_url, group_by="day"):
    return make_celery(
        Settings(data_dir=data_dir, database_url=database_url, billing_export_group_by=group_by)
    )


def test_eager_export_of_one_day(database_url, sessions, data_dir, store):
    add_day_of_usage(sessions)
    app = _app(data_dir, database_url)

    summary = app.tasks[EXPORT_DAILY_BILLING].delay(day=DAY_START.date().isoformat()).get()

    with sessions() as session:
        export = session.scalars(select(BillingExport)).one()
        report = usage_report(session, start=DAY_START, end=DAY_END, group_by="day")
    assert summary["group_by"] == "day" and export.group_by == "day"
    (exported,) = summary["exports"]
    assert exported["id"] == export.id and exported["store_key"] == export.store_key
    assert exported["day"] == "2025-03-04"
    assert (exported["sha256"], exported["size_bytes"]) == (export.sha256, export.size_bytes)
    assert export.period_start == DAY_START and export.period_end == DAY_END
    assert exported["rows"] == export.rows == len(report.rows) == 2  # two tenants, one day
    assert exported["store_key"] == "billing/2025-03-04.by-day.csv" and exported["version"] == 1
    assert store.exists(export.store_key)

    again = app.tasks[EXPORT_DAILY_BILLING].delay(day="2025-03-04").get()
    assert again == summary


def _add_recent_usage(sessions, days_ago: int) -> date:
    """One record ``days_ago`` days before today (UTC); its day."""
    moment = utc_now() - timedelta(days=days_ago)
    with sessions.begin() as session:
        session.add(usage_record(add_tenant(session), created_at=moment))
    return moment.date()


def test_eager_export_without_a_day_catches_up_to_the_last_closed_day(
    database_url, sessions, data_dir
):
    first = _add_recent_usage(sessions, days_ago=3)
    app = _app(data_dir, database_url, group_by="request")

    summary = app.tasks[EXPORT_DAILY_BILLING].delay().get()

    expected = [d.isoformat() for d in days_between(first, last_closed_day(utc_now()))]
    assert [e["day"] for e in summary["exports"]] == expected
    assert [e["rows"] for e in summary["exports"]] == [1] + [0] * (len(expected) - 1)
    assert app.tasks[EXPORT_DAILY_BILLING].delay().get() == {"group_by": "request", "exports": []}


@pytest.mark.parametrize("task", [EXPORT_DAILY_BILLING, ROLLUP_USAGE])
def test_a_day_that_is_not_closed_is_refused(database_url, sessions, data_dir, store, task):
    today = utc_now().date()
    app = _app(data_dir, database_url)
    for day in (today, today + timedelta(days=1)):
        with pytest.raises(ValueError, match="not a closed UTC day"):
            app.tasks[task].delay(day=day.isoformat())
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(BillingExport)) == 0
    assert not store.root.exists()


def test_eager_rollup_of_one_day_and_of_every_closed_day(database_url, sessions, data_dir):
    add_day_of_usage(sessions)
    app = _app(data_dir, database_url)

    assert app.tasks[ROLLUP_USAGE].delay(day="2025-03-04").get() == {"days": ["2025-03-04"]}
    with sessions() as session:
        rows = session.scalars(select(UsageDaily)).all()
    assert {row.day for row in rows} == {date(2025, 3, 4)}
    assert sum(row.requests for row in rows) == 3

    # The catch-up starts after the newest rolled-up day, at the next day with usage (one
    # record at DAY_END), and rolls at most 31 days; the next one finds no usage after them.
    rolled = app.tasks[ROLLUP_USAGE].delay().get()["days"]
    assert rolled == [d.isoformat() for d in days_between(DAY_END.date(), date(2025, 4, 4))]
    assert app.tasks[ROLLUP_USAGE].delay().get() == {"days": []}
    recent = _add_recent_usage(sessions, days_ago=2)
    rolled = app.tasks[ROLLUP_USAGE].delay().get()["days"]
    assert rolled == [d.isoformat() for d in days_between(recent, last_closed_day(utc_now()))]


def test_each_app_has_its_own_task_bound_to_its_own_settings(tmp_path):
    first = make_celery(Settings(data_dir=tmp_path / "a"))
    second = make_celery(Settings(data_dir=tmp_path / "b"))
    for task in (EXPORT_DAILY_BILLING, ROLLUP_USAGE):
        assert first.tasks[task] is not second.tasks[task]
