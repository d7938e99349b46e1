"""Export the usage of every tenant over one period as a CSV in the object store.

``export_billing(sessions, store, period_start=..., period_end=..., group_by=...)`` builds
the billing report (``loramux.platform.services.billing``) over ``[start, end)``, stores its
CSV (content-addressed) and records a ``BillingExport`` row. It is idempotent: an existing
export of the same period and grouping is returned as it is, with nothing stored again.
Two concurrent calls for one period record one row; the loser returns the winner's row.
The loser's object, if its bytes differ, stays in the store: objects are shared by content
(every empty period has the same header-only CSV), so only a sweep over all rows could
tell it is unused.

``export_closed_days(sessions, store, now=..., group_by=...)`` is what the daily schedule
runs: it exports every closed UTC day (``loramux.platform.services.rollups.is_closed``) not
exported yet, oldest first, so a run that is late, missed or repeated still exports each day
exactly once, whatever the day it runs on.
"""

from __future__ import annotations

from datetime import date, datetime, timedelta

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from loramux.platform.db.models import BillingExport
from loramux.platform.services.billing import to_csv, usage_report
from loramux.platform.services.rollups import (
    DEFAULT_MAX_DAYS,
    days_between,
    first_usage_day,
    last_closed_day,
    utc_day_bounds,
)
from loramux.platform.store import ObjectStore

EXPORT_FORMAT = "csv"


def _check_period(period_start: datetime, period_end: datetime) -> None:
    for name, bound in (("period_start", period_start), ("period_end", period_end)):
        if bound.utcoffset() is None:
            raise ValueError(f"{name} must be timezone-aware")
    if period_start >= period_end:
        raise ValueError("period_start must be before period_end")


def find_export(
    session: Session, *, period_start: datetime, period_end: datetime, group_by: str
) -> BillingExport | None:
    """The recorded export of this period and grouping, if there is one."""
    return session.scalars(
        select(BillingExport).where(
            BillingExport.period_start == period_start,
            BillingExport.period_end == period_end,
            BillingExport.group_by == group_by,
        )
    ).one_or_none()


def export_billing(
    sessions: sessionmaker[Session],
    store: ObjectStore,
    *,
    period_start: datetime,
    period_end: datetime,
    group_by: str = "request",
) -> BillingExport:
    """The export of every tenant's usage in ``[period_start, period_end)``; see the module.

    Bounds must be timezone-aware with ``period_start < period_end``; ``group_by`` is one of
    the billing report's groupings (``ValueError`` otherwise).
    """
    _check_period(period_start, period_end)
    period = {"period_start": period_start, "period_end": period_end, "group_by": group_by}
    with sessions() as session:
        existing = find_export(session, **period)
        if existing is not None:
            return existing
        report = usage_report(session, start=period_start, end=period_end, group_by=group_by)

    stored = store.put_stream(to_csv(report).encode("utf-8"))
    export = BillingExport(
        **period,
        format=EXPORT_FORMAT,
        store_key=stored.key,
        sha256=stored.sha256,
        size_bytes=stored.size,
        rows=len(report.rows),
    )
    try:
        with sessions.begin() as session:
            session.add(export)
    except IntegrityError:
        # Another worker recorded this period first: its row is the export.
        with sessions() as session:
            existing = find_export(session, **period)
        if existing is None:
            raise
        return existing
    return export


def newest_daily_export_day(session: Session, *, group_by: str) -> date | None:
    """The newest UTC day exported whole (``[00:00, next 00:00)``) with this grouping.

    Exports of other periods (not made by the daily schedule) are passed over.
    """
    exports = session.execute(
        select(BillingExport.period_start, BillingExport.period_end)
        .where(BillingExport.group_by == group_by)
        .order_by(BillingExport.period_start.desc())
        .execution_options(yield_per=64)
    )
    for period_start, period_end in exports:
        day = period_start.date()  # UtcDateTime hands back UTC
        if (period_start, period_end) == utc_day_bounds(day):
            return day
    return None


def export_closed_days(
    sessions: sessionmaker[Session],
    store: ObjectStore,
    *,
    now: datetime,
    group_by: str,
    max_days: int = DEFAULT_MAX_DAYS,
) -> list[BillingExport]:
    """Export every closed UTC day not exported yet with ``group_by``; the new exports.

    The run starts the day after the newest daily export, or on the day of the oldest usage
    record when nothing was exported, but never before that day (no statements before usage
    ever began; nothing at all while there is no usage). It ends at the last closed day at
    ``now``, after at most ``max_days`` days, oldest first: the next call goes on from there. Days without usage inside the run
    are exported too: their header-only CSV states that the day had no usage. Each day is
    exported by ``export_billing``, so a concurrent or repeated run records nothing twice.
    """
    if max_days < 1:
        raise ValueError("max_days must be at least 1")
    last_closed = last_closed_day(now)
    with sessions() as session:
        first_usage = first_usage_day(session)
        newest = newest_daily_export_day(session, group_by=group_by)
    if first_usage is None:
        return []
    first = first_usage if newest is None else max(first_usage, newest + timedelta(days=1))
    last = min(last_closed, first + timedelta(days=max_days - 1))
    exports = []
    for day in days_between(first, last):
        start, end = utc_day_bounds(day)
        exports.append(
            export_billing(sessions, store, period_start=start, period_end=end, group_by=group_by)
        )
    return exports
