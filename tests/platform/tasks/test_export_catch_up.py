"""export_closed_days on PostgreSQL: every closed day exported once, whenever the task runs.

Usage lies on D-3 and D-1 (D = 2025-04-10); D-2 has none. The clock is an argument of
``export_closed_days``; the task reads ``utc_now`` from its module, patched here.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from loramux.platform.db.models import BillingExport
from loramux.platform.services.billing_exports import DayRange, export_period, open_export
from loramux.platform.services.rollups import utc_day_bounds
from loramux.platform.settings import Settings
from loramux.platform.tasks import celery_app
from loramux.platform.tasks.billing import export_closed_days
from loramux.platform.tasks.celery_app import EXPORT_DAILY_BILLING, make_celery
from tests.platform.db.factories import add_tenant, usage_record

D = date(2025, 4, 10)


def at(day: date, hour: int = 0, minute: int = 0) -> datetime:
    return datetime(day.year, day.month, day.day, hour, minute, tzinfo=UTC)


def days(*offsets: int) -> list[date]:
    return [D + timedelta(days=offset) for offset in offsets]


@pytest.fixture
def usage(sessions: sessionmaker[Session]) -> dict[date, int]:
    """Records on D-3 (three, one at its very start) and D-1 (one); the count per day."""
    with sessions.begin() as session:
        tenant = add_tenant(session)
        d3, d1 = days(-3, -1)
        session.add_all(
            [
                usage_record(tenant, created_at=at(d3)),
                usage_record(tenant, created_at=at(d3, 11)),
                usage_record(tenant, created_at=at(d3, 23, 59)),
                usage_record(tenant, created_at=at(d1, 18)),
            ]
        )
    return {d3: 3, d1: 1}


def _exported_days(exports: list[BillingExport]) -> list[date]:
    for export in exports:
        assert (export.period_start, export.period_end) == utc_day_bounds(
            export.period_start.date()
        )
    return [export.period_start.date() for export in exports]


def _all_exports(sessions: sessionmaker[Session]) -> list[BillingExport]:
    with sessions() as session:
        return list(
            session.scalars(select(BillingExport).order_by(BillingExport.period_start)).all()
        )


def test_exports_every_closed_day_once_and_waits_for_the_grace(sessions, store, usage):
    def run(now: datetime) -> list[date]:
        return _exported_days(export_closed_days(sessions, store, now=now, group_by="request"))

    exports = export_closed_days(sessions, store, now=at(D, 0, 10), group_by="request")
    assert _exported_days(exports) == days(-3, -2, -1)
    assert [e.rows for e in exports] == [3, 0, 1]
    with open_export(store, exports[1]) as reader:
        assert reader.read().decode().count("\r\n") == 1  # D-2: the header, no usage

    assert run(at(D, 0, 10)) == []
    assert run(at(D, 23, 59)) == []
    assert run(at(D + timedelta(days=1), 0, 3)) == []  # D ended, but within the grace
    assert run(at(D + timedelta(days=1), 0, 6)) == days(0)
    assert _exported_days(_all_exports(sessions)) == days(-3, -2, -1, 0)


def test_no_usage_means_no_export_and_none_before_the_first_usage(sessions, store):
    assert export_closed_days(sessions, store, now=at(D, 0, 10), group_by="request") == []

    with sessions.begin() as session:  # usage today only: no closed day has any
        session.add(usage_record(add_tenant(session), created_at=at(D, 0, 1)))
    assert export_closed_days(sessions, store, now=at(D, 0, 10), group_by="request") == []
    exports = export_closed_days(
        sessions, store, now=at(D, 23) + timedelta(hours=2), group_by="day"
    )
    assert _exported_days(exports) == days(0)


def test_a_delayed_task_exports_the_days_that_closed_meanwhile(
    sessions, store, usage, database_url, data_dir, monkeypatch
):
    """Sent at D 00:10 for D-1, run at D+1 00:20: it exports D-3 .. D, not just 'yesterday'."""
    app = make_celery(
        Settings(data_dir=data_dir, database_url=database_url, billing_export_group_by="adapter")
    )
    monkeypatch.setattr(celery_app, "utc_now", lambda: at(D + timedelta(days=1), 0, 20))

    summary = app.tasks[EXPORT_DAILY_BILLING].delay().get()

    assert summary["group_by"] == "adapter"
    assert [e["day"] for e in summary["exports"]] == [d.isoformat() for d in days(-3, -2, -1, 0)]
    recorded = _all_exports(sessions)
    assert [e["id"] for e in summary["exports"]] == [e.id for e in recorded]
    assert [e["store_key"] for e in summary["exports"]] == [e.store_key for e in recorded]
    assert {e.group_by for e in recorded} == {"adapter"}

    # The next run, two days late again, goes on from D+1.
    monkeypatch.setattr(celery_app, "utc_now", lambda: at(D + timedelta(days=3), 0, 20))
    summary = app.tasks[EXPORT_DAILY_BILLING].delay().get()
    assert [e["day"] for e in summary["exports"]] == [d.isoformat() for d in days(1, 2)]


def test_max_days_caps_a_run_and_the_next_goes_on(sessions, store, usage):
    now = at(D + timedelta(days=5), 0, 10)  # closed: up to D+4

    runs = [
        _exported_days(export_closed_days(sessions, store, now=now, group_by="day", max_days=2))
        for _ in range(5)
    ]

    assert runs == [days(-3, -2), days(-1, 0), days(1, 2), days(3, 4), []]


def test_each_grouping_catches_up_on_its_own_and_other_periods_are_ignored(sessions, store, usage):
    # An export of two days and one of a day before any usage, both grouped by day.
    d3, d2 = days(-3, -2)
    export_period(sessions, store, DayRange(d3, d2), group_by="day", now=at(D, 0, 10))
    january = DayRange(date(2025, 1, 1), date(2025, 1, 1))
    export_period(sessions, store, january, group_by="day", now=at(D, 0, 10))
    export_closed_days(sessions, store, now=at(D, 0, 10), group_by="request")

    exports = export_closed_days(sessions, store, now=at(D, 0, 10), group_by="day")

    # The two-day export is not a daily one; the January export does not pull the start
    # back before the first usage.
    assert _exported_days(exports) == days(-3, -2, -1)
    assert {e.group_by for e in exports} == {"day"}
    assert len(_all_exports(sessions)) == 2 + 3 + 3


def test_a_day_exported_while_open_gets_its_final_version_from_the_schedule(sessions, store, usage):
    d1 = days(-1)[0]
    provisional = export_period(
        sessions, store, DayRange(d1, d1), group_by="request", now=at(d1, 20)
    ).export
    assert provisional.provisional and provisional.store_key.endswith(".by-request.csv")

    exports = export_closed_days(sessions, store, now=at(D, 0, 10), group_by="request")

    assert _exported_days(exports) == days(-3, -2, -1)
    final = exports[-1]
    assert (final.version, final.provisional) == (2, False)
    assert final.store_key == f"billing/{d1.isoformat()}.by-request.v2.csv"
    assert [e.store_key for e in exports[:2]] == [
        f"billing/{day.isoformat()}.by-request.csv" for day in days(-3, -2)
    ]
    # The provisional version is still there, under its own name.
    with store.open_named(provisional.store_key, provisional.sha256) as reader:
        assert reader.read().count(b"\r\n") == 1 + usage[d1]
    assert export_closed_days(sessions, store, now=at(D, 23), group_by="request") == []


def test_max_days_must_be_positive(sessions, store):
    with pytest.raises(ValueError, match="max_days"):
        export_closed_days(sessions, store, now=at(D), group_by="day", max_days=0)
