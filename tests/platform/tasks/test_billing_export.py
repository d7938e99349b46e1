"""export_billing on PostgreSQL: the report's rows, the CSV in the store, idempotence."""

from __future__ import annotations

import csv
import io
from datetime import datetime, timedelta

import pytest
from sqlalchemy import func, select

from loramux.platform.db.models import BillingExport
from loramux.platform.services.billing import format_cell, usage_report
from loramux.platform.tasks.billing import export_billing
from tests.platform.tasks.usage import DAY_END, DAY_START, add_day_of_usage


def _stored_files(store) -> list:
    return sorted(path for path in store.root.rglob("*") if path.is_file())


@pytest.mark.parametrize("group_by", ["request", "day", "adapter"])
def test_export_stores_the_report_as_csv_and_records_it(sessions, store, group_by):
    inside = add_day_of_usage(sessions)

    export = export_billing(
        sessions, store, period_start=DAY_START, period_end=DAY_END, group_by=group_by
    )

    with sessions() as session:
        report = usage_report(session, start=DAY_START, end=DAY_END, group_by=group_by)
        recorded = session.scalars(select(BillingExport)).one()
    assert report.totals["requests"] == inside
    assert export.rows == len(report.rows) > 0
    assert (recorded.id, recorded.store_key, recorded.rows) == (
        export.id,
        export.store_key,
        export.rows,
    )
    assert recorded.period_start == DAY_START and recorded.period_end == DAY_END
    assert recorded.group_by == group_by and recorded.format == "csv"

    with store.open(export.store_key) as reader:
        data = reader.read()
    assert len(data) == export.size_bytes
    parsed = list(csv.reader(io.StringIO(data.decode("utf-8"))))
    assert parsed[0] == list(report.columns)
    assert parsed[1:] == [[format_cell(row[c]) for c in report.columns] for row in report.rows]


def test_export_again_returns_the_same_row_and_stores_nothing_more(sessions, store):
    add_day_of_usage(sessions)
    first = export_billing(sessions, store, period_start=DAY_START, period_end=DAY_END)
    files = _stored_files(store)

    again = export_billing(sessions, store, period_start=DAY_START, period_end=DAY_END)

    assert again.id == first.id and again.store_key == first.store_key
    assert _stored_files(store) == files
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(BillingExport)) == 1


def test_an_empty_period_exports_only_the_header(sessions, store):
    start = DAY_START - timedelta(days=30)
    export = export_billing(sessions, store, period_start=start, period_end=start + timedelta(1))
    assert export.rows == 0
    with store.open(export.store_key) as reader:
        assert reader.read().decode().count("\r\n") == 1


@pytest.mark.parametrize(
    ("start", "end"),
    [
        (DAY_END, DAY_START),
        (DAY_START, DAY_START),
        (DAY_START.replace(tzinfo=None), DAY_END),
    ],
)
def test_bad_periods_are_refused(sessions, store, start: datetime, end: datetime):
    with pytest.raises(ValueError):
        export_billing(sessions, store, period_start=start, period_end=end)
    assert not store.root.exists() or _stored_files(store) == []
