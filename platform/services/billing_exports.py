"""Billing exports: every tenant's usage over whole UTC days, as CSV files in the object store.

Periods. An export covers whole UTC days, ``first`` to ``last`` inclusive (:class:`DayRange`),
at most :data:`MAX_EXPORT_DAYS` of them and none after today (UTC); anything else is
:class:`~loramux.platform.services.rollups.InvalidPeriod`. Its CSV is the billing report
(``loramux.platform.services.billing``) over ``[first 00:00, last + 1 00:00)`` with one
grouping (``day``, ``adapter`` or ``request``).

Provisional and final. A period is *closed* once its last day is (midnight UTC plus the
5-minute ``ROLLUP_GRACE``, ``loramux.platform.services.rollups``): no usage of it can still
be written. :func:`export_period` of a closed period makes a final export, once: exporting
it again returns that export (idempotent). A period that is not closed (today's, or
yesterday's in the first 5 minutes after midnight) is exported *provisional*: its usage may
still grow. Exporting it again makes a new provisional version if the usage changed (else
returns the last one), and once the period is closed a new, final version: a provisional
export is never what a closed period's export returns.

Versions and store keys. Versions count 1, 2, ... per period and grouping; each is its own
object under a readable name (:func:`export_key`)::

    billing/2026-11-24.by-request.csv             a day, version 1
    billing/2026-11-24.by-request.v2.csv          the same day, version 2 (e.g. the final)
    billing/2026-11-01_2026-11-30.by-day.csv      a range (first_last, both inclusive)

The grouping is always in the name (the default grouping is a setting that may change).
No version overwrites another; the row records each object's sha256, and reads
(:func:`read_export`) are verified against it. Exports made before names (content-addressed
keys, ``sha256/…``) are read back under their old keys.

Concurrency. The row is inserted (claiming its period, grouping and version under the
table's unique constraints) before the object is written, and committed after: a second
export of the same version waits on the first's insert, then returns the first's row; an
export that fails to write its object records nothing. A crash between the write and the
commit leaves an object no row names, which the next export of that version overwrites.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from typing import BinaryIO

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from loramux.platform.db.models import BillingExport
from loramux.platform.services.billing import GROUP_BYS, to_csv, usage_report
from loramux.platform.services.rollups import (
    InvalidPeriod,
    closes_at,
    is_closed,
    utc_day_bounds,
    utc_day_of,
    utc_text,
    why_not_closed,
)
from loramux.platform.store import ObjectStore, is_content_key
from loramux.platform.store.base import CHUNK_SIZE, VerifyingReader

MAX_EXPORT_DAYS = 31
"""The longest period one export may cover: any calendar month."""
EXPORT_FORMAT = "csv"
KEY_PREFIX = "billing/"
SPOOL_BYTES = 8 * 1024 * 1024
"""A verified read keeps up to this much in memory, the rest in an unlinked temporary file."""
DEFAULT_LIST_LIMIT = 100


class ExportNotFound(LookupError):
    """No billing export has this id."""

    def __init__(self, export_id: str) -> None:
        super().__init__(f"No billing export with id {export_id!r}.")
        self.export_id = export_id


# --- periods --------------------------------------------------------------------------------


@dataclass(frozen=True)
class DayRange:
    """UTC days ``first`` to ``last``, both included (``first <= last``)."""

    first: date
    last: date

    def __post_init__(self) -> None:
        if self.first > self.last:
            raise InvalidPeriod(
                f"the period starts ({self.first.isoformat()}) after it ends "
                f"({self.last.isoformat()}); the end day is included, so one day is start = end"
            )

    @classmethod
    def of_bounds(cls, start: datetime, end: datetime) -> DayRange:
        """The days of ``[start, end)``; both bounds must be aware UTC midnights, start < end."""
        for name, bound in (("start", start), ("end", end)):
            if bound.utcoffset() is None:
                raise InvalidPeriod(f"{name} must be timezone-aware")
            if bound != utc_day_bounds(utc_day_of(bound))[0]:
                raise InvalidPeriod(f"{name} ({bound.isoformat()}) is not a midnight UTC")
        if start >= end:
            raise InvalidPeriod("the period's start is not before its end")
        return cls(utc_day_of(start), utc_day_of(end) - timedelta(days=1))

    @property
    def start(self) -> datetime:
        """Midnight UTC starting ``first`` (inclusive)."""
        return utc_day_bounds(self.first)[0]

    @property
    def end(self) -> datetime:
        """Midnight UTC ending ``last`` (exclusive)."""
        return utc_day_bounds(self.last)[1]

    @property
    def days(self) -> int:
        return (self.last - self.first).days + 1

    @property
    def label(self) -> str:
        """``2026-11-24`` for one day, ``2026-11-01_2026-11-30`` for several."""
        if self.first == self.last:
            return self.first.isoformat()
        return f"{self.first.isoformat()}_{self.last.isoformat()}"

    def is_closed(self, now: datetime) -> bool:
        """Whether no usage of the period can still be written at ``now``."""
        return is_closed(self.last, now)

    @property
    def closes_at(self) -> datetime:
        return closes_at(self.last)


def check_exportable(period: DayRange, now: datetime, *, max_days: int = MAX_EXPORT_DAYS) -> None:
    """:class:`InvalidPeriod` if ``period`` is longer than ``max_days`` or ends after today."""
    if period.days > max_days:
        raise InvalidPeriod(
            f"the period {period.first.isoformat()} to {period.last.isoformat()} is "
            f"{period.days} days; one export covers at most {max_days} (export it in parts)"
        )
    if period.last > utc_day_of(now):
        raise InvalidPeriod(
            f"{why_not_closed(period.last, now)}: export up to today at most (today's "
            "export is provisional)"
        )


def period_of(export: BillingExport) -> DayRange:
    """The days an export covers (its bounds are midnights UTC)."""
    return DayRange(
        utc_day_of(export.period_start), utc_day_of(export.period_end - timedelta(microseconds=1))
    )


# --- names ----------------------------------------------------------------------------------


def _stem(period: DayRange, group_by: str, version: int) -> str:
    return f"{period.label}.by-{group_by}" + ("" if version == 1 else f".v{version}")


def export_key(period: DayRange, group_by: str, version: int) -> str:
    """The store key of a version: ``billing/2026-11-24.by-request[.v2].csv`` (module)."""
    return f"{KEY_PREFIX}{_stem(period, group_by, version)}.{EXPORT_FORMAT}"


def export_file_name(export: BillingExport) -> str:
    """The name a download is saved under: ``billing-2026-11-24.by-request[.v2].csv``."""
    return f"billing-{_stem(period_of(export), export.group_by, export.version)}.{EXPORT_FORMAT}"


# --- exporting ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportOutcome:
    export: BillingExport
    created: bool  # False: an existing export was returned (see export_period)

    @property
    def note(self) -> str:
        """What this export is, in words."""
        if self.export.provisional:
            note = provisional_note(self.export)
            return note if self.created else f"No usage changed since this export. {note}"
        if self.created:
            return "Final: the period is closed, so this export will not change."
        return "Already exported: the final export of this period and grouping."


def latest_export(session: Session, period: DayRange, group_by: str) -> BillingExport | None:
    """The newest version exported of this period and grouping, if any."""
    return session.scalars(
        select(BillingExport)
        .where(
            BillingExport.period_start == period.start,
            BillingExport.period_end == period.end,
            BillingExport.group_by == group_by,
        )
        .order_by(BillingExport.version.desc())
        .limit(1)
    ).one_or_none()


def export_period(
    sessions: sessionmaker[Session],
    store: ObjectStore,
    period: DayRange,
    *,
    group_by: str,
    now: datetime,
) -> ExportOutcome:
    """Export ``period`` grouped by ``group_by`` as of ``now``, or return the export that
    stands for it (see the module: final, provisional, versions, concurrency).

    ``InvalidPeriod`` for a period :func:`check_exportable` refuses, ``ValueError`` for an
    unknown grouping; the store's errors (``StoreUnavailable``) propagate, recording nothing.
    """
    if group_by not in GROUP_BYS:
        raise ValueError(f"group_by must be one of {', '.join(GROUP_BYS)}, got {group_by!r}")
    check_exportable(period, now)
    provisional = not period.is_closed(now)
    with sessions() as session:
        latest = latest_export(session, period, group_by)
        if latest is not None and not latest.provisional:
            return ExportOutcome(latest, created=False)
        report = usage_report(session, start=period.start, end=period.end, group_by=group_by)
    data = to_csv(report).encode("utf-8")
    sha256 = hashlib.sha256(data).hexdigest()
    if latest is not None and provisional and latest.sha256 == sha256:
        return ExportOutcome(latest, created=False)  # nothing changed since that snapshot

    version = 1 if latest is None else latest.version + 1
    export = BillingExport(
        period_start=period.start,
        period_end=period.end,
        group_by=group_by,
        version=version,
        provisional=provisional,
        format=EXPORT_FORMAT,
        store_key=export_key(period, group_by, version),
        sha256=sha256,
        size_bytes=len(data),
        rows=len(report.rows),
    )
    try:
        with sessions.begin() as session:
            session.add(export)
            session.flush()  # claims the version: a concurrent export of it waits here
            store.put_named(export.store_key, [data])
    except IntegrityError:
        # Another export of this period claimed the version (or made the final) first.
        with sessions() as session:
            winner = latest_export(session, period, group_by)
        if winner is None:
            raise
        return ExportOutcome(winner, created=False)
    return ExportOutcome(export, created=True)


# --- listing and reading --------------------------------------------------------------------


def list_exports(
    session: Session, *, limit: int = DEFAULT_LIST_LIMIT, offset: int = 0
) -> list[BillingExport]:
    """Exports, newest first (by creation; a later version of a period is newer)."""
    return list(
        session.scalars(
            select(BillingExport)
            .order_by(BillingExport.created_at.desc(), BillingExport.version.desc())
            .limit(limit)
            .offset(offset)
        )
    )


def get_export(session: Session, export_id: str) -> BillingExport:
    """The export with this id; :class:`ExportNotFound` if there is none."""
    export = session.get(BillingExport, export_id)
    if export is None:
        raise ExportNotFound(export_id)
    return export


def open_export(store: ObjectStore, export: BillingExport) -> VerifyingReader:
    """A reader of the export's CSV that raises ``ChecksumMismatch`` at its end unless the
    bytes hash to the recorded sha256 (exports made before names: to their content key)."""
    if is_content_key(export.store_key):
        return store.open(export.store_key)
    return store.open_named(export.store_key, export.sha256)


def read_export(store: ObjectStore, export: BillingExport) -> BinaryIO:
    """The export's CSV, read whole and verified, as a file positioned at its start.

    The caller closes it. Nothing unverified is handed out: ``ChecksumMismatch`` (corrupt)
    or ``ObjectNotFound`` (gone from the store) is raised before any byte is returned.
    """
    copy = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)  # noqa: SIM115 (returned)
    try:
        with open_export(store, export) as reader:
            shutil.copyfileobj(reader, copy, CHUNK_SIZE)  # verified at the end
        copy.seek(0)
    except BaseException:
        copy.close()
        raise
    return copy  # type: ignore[return-value]


def provisional_note(export: BillingExport) -> str:
    """Why an export is provisional and when its final version can be made."""
    period = period_of(export)
    return (
        f"Provisional: {period.last.isoformat()} is not closed until "
        f"{utc_text(period.closes_at)} (midnight UTC plus 5 minutes, so late usage is in); "
        "its usage may still grow. Export the period again after that for the final version."
    )
