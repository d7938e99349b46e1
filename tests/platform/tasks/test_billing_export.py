"""export_period on PostgreSQL: the report as CSV under a readable, versioned store key,
provisional exports of open periods then a final one, idempotence, refusals, reading back
verified (local store, and S3 on moto)."""

from __future__ import annotations

import csv
import io
import threading
from datetime import UTC, date, datetime, timedelta

import pytest
from sqlalchemy import func, select

from loramux.platform.db.models import BillingExport
from loramux.platform.services.billing import format_cell, to_csv, usage_report
from loramux.platform.services.billing_exports import (
    MAX_EXPORT_DAYS,
    DayRange,
    export_file_name,
    export_period,
    read_export,
)
from loramux.platform.services.rollups import InvalidPeriod
from loramux.platform.store import ChecksumMismatch, ObjectNotFound, StoreUnavailable
from tests.platform.db.factories import add_tenant, usage_record
from tests.platform.services.stores import FlakyStore
from tests.platform.store.factories import s3_store
from tests.platform.tasks.usage import DAY_END, DAY_START, add_day_of_usage

DAY = DAY_START.date()
ONE_DAY = DayRange(DAY, DAY)
CLOSED = DAY_END + timedelta(days=3)  # long after the day closed
DURING = DAY_START + timedelta(hours=20)  # the day is open


def _files(store) -> list[str]:
    if not store.root.exists():
        return []
    return sorted(
        p.relative_to(store.root).as_posix() for p in store.root.rglob("*") if p.is_file()
    )


def _count(sessions) -> int:
    with sessions() as session:
        return session.scalar(select(func.count()).select_from(BillingExport))


def _read(store, export) -> bytes:
    with read_export(store, export) as copy:
        return copy.read()


def _add_usage(sessions, at: datetime, **fields) -> None:
    with sessions.begin() as session:
        session.add(usage_record(add_tenant(session), created_at=at, **fields))


@pytest.mark.parametrize("group_by", ["request", "day", "adapter"])
def test_export_stores_the_report_as_csv_under_a_readable_key(sessions, store, group_by):
    inside = add_day_of_usage(sessions)

    outcome = export_period(sessions, store, ONE_DAY, group_by=group_by, now=CLOSED)

    export = outcome.export
    with sessions() as session:
        report = usage_report(session, start=DAY_START, end=DAY_END, group_by=group_by)
        recorded = session.scalars(select(BillingExport)).one()
    assert outcome.created and report.totals["requests"] == inside
    assert export.rows == len(report.rows) > 0
    assert (recorded.id, recorded.store_key, recorded.sha256, recorded.rows) == (
        export.id,
        f"billing/2025-03-04.by-{group_by}.csv",
        export.sha256,
        export.rows,
    )
    assert (recorded.version, recorded.provisional) == (1, False)
    assert recorded.period_start == DAY_START and recorded.period_end == DAY_END
    assert recorded.group_by == group_by and recorded.format == "csv"
    assert export_file_name(recorded) == f"billing-2025-03-04.by-{group_by}.csv"
    assert _files(store) == [export.store_key]

    data = _read(store, recorded)
    assert len(data) == export.size_bytes and data == to_csv(report).encode()
    parsed = list(csv.reader(io.StringIO(data.decode("utf-8"))))
    assert parsed[0] == list(report.columns)
    assert parsed[1:] == [[format_cell(row[c]) for c in report.columns] for row in report.rows]


def test_a_range_is_named_first_last_and_holds_every_day(sessions, store):
    add_day_of_usage(sessions)
    period = DayRange(DAY - timedelta(days=3), DAY + timedelta(days=1))

    export = export_period(sessions, store, period, group_by="day", now=CLOSED).export

    assert export.store_key == "billing/2025-03-01_2025-03-05.by-day.csv"
    assert export.period_start == DAY_START - timedelta(days=3)
    assert export.period_end == DAY_END + timedelta(days=1)
    rows = list(csv.DictReader(io.StringIO(_read(store, export).decode())))
    # The records just outside DAY fall on the 3rd and the 5th: inside the range.
    assert sorted({row["day"] for row in rows}) == ["2025-03-03", "2025-03-04", "2025-03-05"]
    assert sum(int(row["requests"]) for row in rows) == 5


def test_exporting_a_closed_period_again_returns_the_same_export(sessions, store):
    add_day_of_usage(sessions)
    first = export_period(sessions, store, ONE_DAY, group_by="request", now=CLOSED)
    files = _files(store)
    _add_usage(sessions, DAY_START + timedelta(hours=1))  # a late backfill changes nothing

    again = export_period(sessions, store, ONE_DAY, group_by="request", now=CLOSED)

    assert first.created and not again.created
    assert again.export.id == first.export.id and again.export.sha256 == first.export.sha256
    assert _files(store) == files and _count(sessions) == 1


def test_an_open_period_is_provisional_then_gets_a_final_version(sessions, store):
    add_day_of_usage(sessions)

    first = export_period(sessions, store, ONE_DAY, group_by="request", now=DURING)
    unchanged = export_period(sessions, store, ONE_DAY, group_by="request", now=DURING)
    _add_usage(sessions, DAY_START + timedelta(hours=21))
    grown = export_period(sessions, store, ONE_DAY, group_by="request", now=DURING)
    # 00:03 the next day: still within the 5-minute grace, so still provisional.
    in_grace = export_period(
        sessions, store, ONE_DAY, group_by="request", now=DAY_END + timedelta(minutes=3)
    )
    final = export_period(
        sessions, store, ONE_DAY, group_by="request", now=DAY_END + timedelta(minutes=5)
    )
    again = export_period(sessions, store, ONE_DAY, group_by="request", now=CLOSED)

    assert first.created and first.export.provisional and first.export.version == 1
    assert not unchanged.created and unchanged.export.id == first.export.id
    assert grown.created and grown.export.provisional and grown.export.version == 2
    assert grown.export.rows == first.export.rows + 1
    assert not in_grace.created and in_grace.export.id == grown.export.id
    assert final.created and not final.export.provisional and final.export.version == 3
    assert final.export.sha256 == grown.export.sha256  # same usage, now final
    assert not again.created and again.export.id == final.export.id
    assert _files(store) == [
        "billing/2025-03-04.by-request.csv",
        "billing/2025-03-04.by-request.v2.csv",
        "billing/2025-03-04.by-request.v3.csv",
    ]
    # No version overwrote another: each reads back verified, with its own rows.
    for outcome in (first, grown, final):
        assert _read(store, outcome.export).count(b"\r\n") == 1 + outcome.export.rows


def test_today_is_exportable_and_provisional(sessions, store):
    now = datetime.now(UTC)
    today = now.date()
    _add_usage(sessions, now - timedelta(seconds=1))

    export = export_period(sessions, store, DayRange(today, today), group_by="day", now=now).export

    assert export.provisional and export.rows == 1


@pytest.mark.parametrize(
    ("period", "message"),
    [
        (lambda: DayRange(DAY, DAY - timedelta(days=1)), "starts .* after it ends"),
        (lambda: DayRange(DAY, DAY + timedelta(days=MAX_EXPORT_DAYS)), "at most 31"),
        (lambda: DayRange(date(2025, 3, 8), date(2025, 3, 8)), "in the future"),
        (lambda: DayRange(DAY, date(2025, 3, 8)), "in the future"),
    ],
)
def test_impossible_periods_are_refused_and_record_nothing(sessions, store, period, message):
    now = datetime(2025, 3, 7, 12, tzinfo=UTC)
    with pytest.raises(InvalidPeriod, match=message):
        export_period(sessions, store, period(), group_by="day", now=now)
    assert _files(store) == [] and _count(sessions) == 0


def test_a_whole_month_is_one_export(sessions, store):
    january = DayRange(date(2025, 1, 1), date(2025, 1, 31))
    export = export_period(sessions, store, january, group_by="adapter", now=CLOSED).export
    assert export.store_key == "billing/2025-01-01_2025-01-31.by-adapter.csv"


@pytest.mark.parametrize(
    ("start", "end"),
    [
        (DAY_END, DAY_START),
        (DAY_START, DAY_START),
        (DAY_START.replace(tzinfo=None), DAY_END),
        (DAY_START + timedelta(hours=1), DAY_END),
    ],
)
def test_bounds_must_be_ordered_aware_midnights(start, end):
    with pytest.raises(InvalidPeriod):
        DayRange.of_bounds(start, end)


def test_day_range_of_bounds_and_labels():
    period = DayRange.of_bounds(DAY_START, DAY_END + timedelta(days=1))
    assert (period.first, period.last, period.days) == (DAY, DAY + timedelta(days=1), 2)
    assert period.label == "2025-03-04_2025-03-05"
    assert ONE_DAY.label == "2025-03-04"
    assert period.closes_at == DAY_END + timedelta(days=1, minutes=5)


def test_a_store_outage_records_nothing(sessions, store):
    add_day_of_usage(sessions)
    flaky = FlakyStore(store)
    flaky.down = True

    with pytest.raises(StoreUnavailable):
        export_period(sessions, flaky, ONE_DAY, group_by="request", now=CLOSED)

    assert _count(sessions) == 0
    flaky.down = False
    assert export_period(sessions, flaky, ONE_DAY, group_by="request", now=CLOSED).created


def test_concurrent_exports_of_one_period_record_one(sessions, store):
    add_day_of_usage(sessions)
    barrier = threading.Barrier(4)
    results: list = []

    def export() -> None:
        barrier.wait()
        results.append(export_period(sessions, store, ONE_DAY, group_by="day", now=CLOSED))

    threads = [threading.Thread(target=export) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert len(results) == 4
    assert len({outcome.export.id for outcome in results}) == 1
    assert sum(outcome.created for outcome in results) == 1
    assert _count(sessions) == 1 and _files(store) == ["billing/2025-03-04.by-day.csv"]


def test_reads_are_verified_and_a_missing_file_is_reported(sessions, store):
    add_day_of_usage(sessions)
    export = export_period(sessions, store, ONE_DAY, group_by="request", now=CLOSED).export
    path = store.root / export.store_key
    data = path.read_bytes()

    path.write_bytes(data.replace(b"7", b"8", 1))  # a tampered token count
    with pytest.raises(ChecksumMismatch):
        _read(store, export)
    path.unlink()
    with pytest.raises(ObjectNotFound):
        _read(store, export)


def test_an_export_made_before_names_reads_from_its_content_address(sessions, store):
    stored = store.put_stream([b"tenant_id,day,requests\r\n"])
    with sessions.begin() as session:
        session.add(
            BillingExport(
                period_start=DAY_START,
                period_end=DAY_END,
                group_by="day",
                store_key=stored.key,
                sha256=stored.sha256,
                size_bytes=stored.size,
                rows=0,
            )
        )
    with sessions() as session:
        legacy = session.scalars(select(BillingExport)).one()

    assert _read(store, legacy) == b"tenant_id,day,requests\r\n"
    assert export_file_name(legacy) == "billing-2025-03-04.by-day.csv"
    # Exporting the period again returns it: it is final (version 1).
    again = export_period(sessions, store, ONE_DAY, group_by="day", now=CLOSED)
    assert not again.created and again.export.id == legacy.id


def test_exports_to_s3_under_the_same_names(sessions, s3_endpoint, s3_bucket):
    add_day_of_usage(sessions)
    bucket = s3_store(s3_endpoint, s3_bucket)

    provisional = export_period(sessions, bucket, ONE_DAY, group_by="day", now=DURING).export
    final = export_period(sessions, bucket, ONE_DAY, group_by="day", now=CLOSED).export

    listed = s3_endpoint.client().list_objects_v2(Bucket=s3_bucket)["Contents"]
    assert sorted(o["Key"] for o in listed) == [
        "billing/2025-03-04.by-day.csv",
        "billing/2025-03-04.by-day.v2.csv",
    ]
    assert provisional.provisional and not final.provisional
    assert _read(bucket, final).count(b"\r\n") == 1 + final.rows
