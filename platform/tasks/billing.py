"""The daily billing export: every closed UTC day, once, as a CSV in the object store.

``export_closed_days(sessions, store, now=..., group_by=...)`` is what the daily schedule
runs: it exports every closed UTC day (``loramux.platform.services.rollups.is_closed``)
without a final export yet, oldest first, so a run that is late, missed or repeated still
exports each day exactly once, whatever the day it runs on. Each day goes through
``loramux.platform.services.billing_exports.export_period``, like an export an operator asks
for: the same readable store keys (``billing/2026-11-24.by-request.csv``), and a day an
operator exported while it was open (a provisional version) gets its final version here.
"""

from __future__ import annotations

from datetime import date, datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from loramux.platform.db.models import BillingExport
from loramux.platform.services.billing_exports import DayRange, export_period
from loramux.platform.services.rollups import (
    DEFAULT_MAX_DAYS,
    days_between,
    first_usage_day,
    last_closed_day,
    utc_day_bounds,
)
from loramux.platform.store import ObjectStore


def newest_daily_export_day(session: Session, *, group_by: str) -> date | None:
    """The newest UTC day with a final export of it whole (``[00:00, next 00:00)``) with
    this grouping. Exports of longer periods, and provisional ones, are passed over."""
    exports = session.execute(
        select(BillingExport.period_start, BillingExport.period_end)
        .where(BillingExport.group_by == group_by, BillingExport.provisional.is_(False))
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
    """Export every closed UTC day not exported final yet with ``group_by``; the exports.

    The run starts the day after the newest final daily export, or on the day of the oldest
    usage record when there is none, but never before that day (no statements before usage
    ever began; nothing at all while there is no usage). It ends at the last closed day at
    ``now``, after at most ``max_days`` days, oldest first: the next call goes on from there.
    Days without usage inside the run are exported too: their header-only CSV states that
    the day had no usage. A day exported final meanwhile (by an operator) is returned as it
    is, so a concurrent or repeated run records nothing twice.
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
    return [
        export_period(sessions, store, DayRange(day, day), group_by=group_by, now=now).export
        for day in days_between(first, last)
    ]
