"""Request and response bodies of the operator's billing routes (``/admin/usage/rollup``,
``/admin/billing/exports``), apart from the ORM models.

Days are UTC calendar days written ``YYYY-MM-DD``. An export request names one ``day``, or a
``start`` and an ``end`` day that are **both inclusive** (``2026-11-01`` to ``2026-11-30`` is
November): at most 31 days, none after today (UTC). Anything else of the right shape (start
after end, too long, in the future) is a 400 ``invalid_period``; a wrong shape (a missing
field, ``day`` with ``start``, not a date) a 422 naming the field. Request bodies refuse
unknown fields and take JSON types as they are.
"""

from __future__ import annotations

import re
from datetime import date, datetime
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag

from loramux.platform.db.models import BillingExport
from loramux.platform.services.billing import GroupBy
from loramux.platform.services.billing_exports import (
    DayRange,
    ExportOutcome,
    export_file_name,
    period_of,
)
from loramux.platform.services.rollups import RollupRun

_DAY_RE = re.compile(r"\d{4}-\d{2}-\d{2}")


def _read_day(value: Any) -> Any:
    """``YYYY-MM-DD`` as a date; anything else (a number, a datetime, a week date) refused."""
    if not isinstance(value, str) or not _DAY_RE.fullmatch(value):
        raise ValueError(f"{value!r} is not a UTC day written YYYY-MM-DD (such as 2026-11-24)")
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a calendar day") from None


UtcDay = Annotated[date, BeforeValidator(_read_day)]

GROUP_BY_FIELD = Field(
    default=None,
    description="Rows per `day`, `adapter` or `request`; absent or null: the setting "
    "LORAMUX_BILLING_EXPORT_GROUP_BY (the daily export's grouping, `request` by default).",
)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# --- billing exports -------------------------------------------------------------------------


class ExportDay(_Request):
    """Export one UTC day (today's too: provisional until it closes)."""

    day: UtcDay = Field(description="The UTC day to export, YYYY-MM-DD; today at the latest.")
    group_by: GroupBy | None = GROUP_BY_FIELD

    def period(self) -> DayRange:
        return DayRange(self.day, self.day)


class ExportRange(_Request):
    """Export the UTC days ``start`` to ``end``, both included (at most 31 days)."""

    start: UtcDay = Field(description="The first UTC day exported (inclusive), YYYY-MM-DD.")
    end: UtcDay = Field(
        description="The last UTC day exported (inclusive: 2026-11-01 to 2026-11-30 is "
        "November), YYYY-MM-DD; today at the latest."
    )
    group_by: GroupBy | None = GROUP_BY_FIELD

    def period(self) -> DayRange:
        """The days; ``InvalidPeriod`` when ``start`` is after ``end``."""
        return DayRange(self.start, self.end)


def _export_kind(value: Any) -> str:
    """Which request a body is: one naming ``day`` is a day, any other a range."""
    return "day" if isinstance(value, dict) and "day" in value else "range"


ExportRequest = Annotated[
    Annotated[ExportDay, Tag("day")] | Annotated[ExportRange, Tag("range")],
    Discriminator(_export_kind),
]


class ExportOut(BaseModel):
    """One stored billing export (one version of a period and grouping)."""

    id: str
    first_day: date = Field(description="The first UTC day covered.")
    last_day: date = Field(description="The last UTC day covered (inclusive).")
    period_start: datetime = Field(description="Midnight UTC starting first_day (inclusive).")
    period_end: datetime = Field(description="Midnight UTC ending last_day (exclusive).")
    group_by: GroupBy
    version: int = Field(description="1, 2, ... per period and grouping; each its own file.")
    provisional: bool = Field(
        description="True: exported before the period closed (its usage may still grow); "
        "exporting it again after it closed makes a final version."
    )
    rows: int = Field(description="Data lines of the CSV (the header not counted).")
    size_bytes: int
    sha256: str = Field(description="SHA-256 of the CSV; downloads are verified against it.")
    created_at: datetime
    key: str = Field(description="Where the CSV lies in the object store.")
    file_name: str = Field(description="The name a download is saved under.")
    download_url: str = Field(description="GET it with the admin token for the CSV.")

    @classmethod
    def from_export(cls, export: BillingExport) -> ExportOut:
        period = period_of(export)
        copied = ("id", "period_start", "period_end", "group_by", "version", "provisional")
        copied += ("rows", "size_bytes", "sha256", "created_at")
        return cls(
            **{name: getattr(export, name) for name in copied},
            first_day=period.first,
            last_day=period.last,
            key=export.store_key,
            file_name=export_file_name(export),
            download_url=f"/admin/billing/exports/{export.id}/download",
        )


class ExportCreatedOut(ExportOut):
    """``POST /admin/billing/exports``: the export that stands for the period now."""

    created: bool = Field(
        description="True (201): exported now. False (200): an existing export was returned: "
        "the period's final export, or its last provisional one when no usage changed since."
    )
    note: str = Field(description="What this export is, in words.")

    @classmethod
    def from_outcome(cls, outcome: ExportOutcome) -> ExportCreatedOut:
        fields = ExportOut.from_export(outcome.export).model_dump()
        return cls(**fields, created=outcome.created, note=outcome.note)


# --- usage roll-up ---------------------------------------------------------------------------


class RollupRequest(_Request):
    """Roll one closed UTC day up again (after a backfill); without a body, catch up."""

    day: UtcDay = Field(description="A closed UTC day, YYYY-MM-DD.")


class RollupOut(BaseModel):
    """What ``POST /admin/usage/rollup`` did."""

    rolled_up: list[date] = Field(description="The UTC days rolled up now, oldest first.")
    last_closed_day: date = Field(description="The newest closed UTC day.")
    open_days: list[date] = Field(
        description="The days after it up to today (UTC): still open, so not rolled up."
    )
    next_close_at: datetime = Field(description="When the oldest open day closes.")
    more_pending: bool = Field(description="The run stopped at its cap: run it again.")
    note: str = Field(description="The same, in words.")

    @classmethod
    def from_run(cls, run: RollupRun) -> RollupOut:
        return cls(
            rolled_up=run.rolled,
            last_closed_day=run.last_closed,
            open_days=run.open_days,
            next_close_at=run.next_close,
            more_pending=run.more_pending,
            note=run.note,
        )
