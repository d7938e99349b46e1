"""Query parameters and response bodies of the usage routes (``/admin/usage``, ``/v1/usage``).

The period: ``start`` and ``end`` are ISO 8601 dates (``2031-05-01``) or datetimes
(``2031-05-01T12:00:00Z``, ``2031-05-01T14:00:00%2B02:00``); a date means midnight UTC at
its start and a datetime without an offset is UTC. ``start`` is inclusive and ``end``
exclusive, both optional (unbounded): May 2031 is ``start=2031-05-01&end=2031-06-01``.
An offset's ``+`` should be sent as ``%2B``; a bare ``+`` (which arrives as a space) is
understood too.
An unparseable value, or ``start`` after ``end``, is a 422 naming the parameter.

Money is integer micro-dollars (``cost_micro_usd``), exactly as billed.
"""

from __future__ import annotations

from datetime import UTC, date, datetime
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from loramux.platform.services.billing import GroupBy


def _read_instant(text: str) -> datetime | None:
    try:
        parsed = datetime.fromisoformat(text)
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=UTC)
        return parsed.astimezone(UTC)
    except (ValueError, OverflowError):  # overflow: shifting 0001-01-01 or 9999-12-31
        return None


def parse_instant(value: Any) -> Any:
    """An ISO 8601 date or datetime as an aware UTC datetime (see module); others unchanged."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    parsed = _read_instant(text)
    if parsed is None and " " in text:  # an unescaped '+' of an offset arrives as a space
        parsed = _read_instant("+".join(text.rsplit(" ", 1)))
    if parsed is None:
        raise ValueError(
            f"{value!r} is not an ISO 8601 date or datetime "
            "(such as 2031-05-01 or 2031-05-01T12:00:00Z)"
        )
    return parsed


class PeriodQuery(BaseModel):
    """A period: ``start <= created_at < end``, either bound optional."""

    start: datetime | None = Field(
        default=None, description="Inclusive start: ISO 8601 date or datetime, UTC by default."
    )
    end: datetime | None = Field(
        default=None, description="Exclusive end: ISO 8601 date or datetime, UTC by default."
    )

    @field_validator("start", "end", mode="before")
    @classmethod
    def parse_bounds(cls, value: Any) -> Any:
        return parse_instant(value)

    @model_validator(mode="after")
    def check_period(self) -> PeriodQuery:
        if self.start is not None and self.end is not None and self.start > self.end:
            raise ValueError(
                f"start ({self.start.isoformat()}) is after end ({self.end.isoformat()})"
            )
        return self


class UsageQuery(PeriodQuery):
    """``GET /v1/usage``: the calling tenant's usage over a period."""

    group_by: GroupBy = Field(default="day", description="Rows per `day`, `adapter` or `request`.")
    format: Literal["json", "csv"] = Field(default="json", description="`json` or `csv`.")


class AdminUsageQuery(UsageQuery):
    """``GET /admin/usage``: any tenant's usage (all tenants when ``tenant_id`` is unset)."""

    tenant_id: str | None = Field(default=None, description="Only this tenant (404 if unknown).")


# --- responses -------------------------------------------------------------------------------

ADAPTER_DESCRIPTION = (
    "Adapter name (`owner/name` for one another tenant shared with this one; a composition "
    "as its versions and weights, `a@1*0.7+b@2*0.3`); null for the base model."
)


class UsageTotals(BaseModel):
    """Sums over a group of requests (or over all of them, as ``totals``)."""

    requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    cost_micro_usd: int


# Each row is its grouping keys, then the metrics (the CSV's column order). Pydantic lists
# the fields of the last base class first, hence ``Row(UsageTotals, Keys)``.


class _DayKeys(BaseModel):
    tenant_id: str
    day: date = Field(description="UTC calendar day, YYYY-MM-DD.")


class _AdapterKeys(BaseModel):
    tenant_id: str
    adapter: str | None = Field(description=ADAPTER_DESCRIPTION)


class _RequestKeys(BaseModel):
    tenant_id: str
    request_id: str
    created_at: datetime = Field(description="When the request was recorded (UTC).")
    model: str
    adapter: str | None = Field(description=ADAPTER_DESCRIPTION)
    adapter_version: int | None = Field(
        description="The adapter version that served it; null for the base model."
    )
    adapter_sha256: str | None = Field(
        description="That version's weights digest (SHA-256); null for the base model."
    )
    user: str | None = Field(
        description="The end user the request named (its `user` field); null when none."
    )
    finish_reason: str | None
    latency_ms: int


class DayUsageRow(UsageTotals, _DayKeys):
    """One tenant's usage on one UTC day."""


class AdapterUsageRow(UsageTotals, _AdapterKeys):
    """One tenant's usage of one adapter (or of the base model)."""


class RequestUsageRow(UsageTotals, _RequestKeys):
    """One request (``requests`` is 1)."""


class DayUsageReport(BaseModel):
    rows: list[DayUsageRow]
    totals: UsageTotals


class AdapterUsageReport(BaseModel):
    rows: list[AdapterUsageRow]
    totals: UsageTotals


class RequestUsageReport(BaseModel):
    rows: list[RequestUsageRow]
    totals: UsageTotals


UsageReportOut = DayUsageReport | AdapterUsageReport | RequestUsageReport

REPORT_SCHEMAS: dict[str, type[DayUsageReport | AdapterUsageReport | RequestUsageReport]] = {
    "day": DayUsageReport,
    "adapter": AdapterUsageReport,
    "request": RequestUsageReport,
}


class SharedUsageTotals(BaseModel):
    """What grantees ran on the owner's adapters: counts and tokens, never their prompts
    nor what they paid (each pays at its own prices)."""

    requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int


class _SharedKeys(BaseModel):
    adapter: str = Field(description="The owner's adapter name.")
    grantee: str = Field(description="The tenant that called it.")


class SharedUsageRow(SharedUsageTotals, _SharedKeys):
    """One grantee's use of one of the owner's adapters."""


class SharedUsageReport(BaseModel):
    """``GET /v1/usage/shared``: other tenants' use of the caller's shared adapters."""

    rows: list[SharedUsageRow]
    totals: SharedUsageTotals
