"""Export the usage of every tenant over one period as a CSV in the object store.

``export_billing(sessions, store, period_start=..., period_end=..., group_by=...)`` builds
the billing report (``loramux.platform.services.billing``) over ``[start, end)``, stores its
CSV (content-addressed) and records a ``BillingExport`` row. It is idempotent: an existing
export of the same period and grouping is returned as it is, with nothing stored again.
Two concurrent calls for one period record one row; the loser returns the winner's row.
The loser's object, if its bytes differ, stays in the store: objects are shared by content
(every empty period has the same header-only CSV), so only a sweep over all rows could
tell it is unused.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from loramux.platform.db.models import BillingExport
from loramux.platform.services.billing import to_csv, usage_report
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
