"""Billing export: usage records summed per day, per adapter or per request, with totals.

``usage_report(session, tenant_id=..., start=..., end=..., group_by=...)`` filters usage
records by tenant (all tenants when ``None``) and by ``start <= created_at < end`` (either
bound may be ``None``: unbounded), groups them in SQL and returns a ``UsageReport``:

* ``rows``: one dict per group, keys in ``columns`` order: the grouping keys, then the
  metrics ``requests``, ``prompt_tokens``, ``cached_prompt_tokens``, ``completion_tokens``,
  ``cost_micro_usd`` (exact integers);
* ``totals``: the same metrics over every record the filter selects.

Grouping keys: ``day`` → ``tenant_id``, ``day`` (a ``date``, UTC); ``adapter`` →
``tenant_id``, ``adapter`` (its name, ``owner/name`` for another tenant's shared with it,
a composition's ``model`` such as ``a@1*0.7+b@2*0.3``; ``None`` for the base model;
adapters sharing a name, such as a deleted one and its successor, share a row); ``request`` → ``tenant_id``,
``request_id``, ``created_at``, ``model``, ``adapter``, ``adapter_version`` and
``adapter_sha256`` (the version that served it: its number and its weights' digest; ``None``
for the base model), ``user`` (the end user the request named, OpenAI's ``user``; ``None``
when it sent none), ``finish_reason``, ``latency_ms``.

The grand totals are computed in the same SQL statement as the rows (window sums over the
groups), so rows and totals come from one snapshot and always agree exactly, even while
new usage is being written. ``to_csv`` renders the same rows as CSV.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any, Literal, get_args

from sqlalchemy import Date, Integer, case, cast, func, literal_column, select
from sqlalchemy.orm import Session, aliased
from sqlalchemy.sql.elements import ColumnElement

from loramux.platform.db.models import Adapter, AdapterVersion, Tenant, UsageRecord

GroupBy = Literal["day", "adapter", "request"]
GROUP_BYS: tuple[str, ...] = get_args(GroupBy)

METRICS = (
    "requests",
    "prompt_tokens",
    "cached_prompt_tokens",
    "completion_tokens",
    "cost_micro_usd",
)

KEY_COLUMNS: dict[str, tuple[str, ...]] = {
    "day": ("tenant_id", "day"),
    "adapter": ("tenant_id", "adapter"),
    "request": (
        "tenant_id",
        "request_id",
        "created_at",
        "model",
        "adapter",
        "adapter_version",
        "adapter_sha256",
        "user",
        "finish_reason",
        "latency_ms",
    ),
}


@dataclass(frozen=True)
class UsageReport:
    """Rows (dicts keyed by ``columns``) and totals (dict keyed by ``METRICS``)."""

    group_by: str
    columns: tuple[str, ...]
    rows: list[dict[str, Any]]
    totals: dict[str, int]


def _utc_day(dialect: str) -> ColumnElement[Any]:
    """The UTC calendar day of ``UsageRecord.created_at`` as an SQL expression."""
    if dialect == "postgresql":
        # timestamptz → UTC wall-clock timestamp → date (independent of the session zone).
        # The zone is a literal, not a bind parameter, so GROUP BY matches the SELECT list.
        return cast(func.timezone(literal_column("'UTC'"), UsageRecord.created_at), Date)
    if dialect == "sqlite":
        # Stored as UTC text 'YYYY-MM-DD HH:MM:SS[.ffffff]' (see UtcDateTime).
        return func.date(UsageRecord.created_at)
    raise NotImplementedError(f"usage_report does not support {dialect!r}")


def _as_date(value: date | str) -> date:
    return value if isinstance(value, date) else date.fromisoformat(value)


_ADAPTER_OWNER = aliased(Tenant, name="adapter_owner")


def _adapter_name() -> ColumnElement[Any]:
    """The adapter as the caller named it: its name, ``owner/name`` for one another tenant
    shared with it, a composition's versions and weights (its ``model``, the one kind that
    holds a ``*``: ``adapter_mix``); NULL for the base model."""
    shared = _ADAPTER_OWNER.name + "/" + Adapter.name
    composed = UsageRecord.adapter_id.is_(None) & UsageRecord.model.contains("*", autoescape=True)
    return case(
        (composed, UsageRecord.model),
        (Adapter.tenant_id == UsageRecord.tenant_id, Adapter.name),
        else_=shared,
    )


def _key_columns(group_by: str, dialect: str) -> list[ColumnElement[Any]]:
    adapter = _adapter_name().label("adapter")
    if group_by == "day":
        return [UsageRecord.tenant_id, _utc_day(dialect).label("day")]
    if group_by == "adapter":
        return [UsageRecord.tenant_id, adapter]
    return [
        UsageRecord.tenant_id,
        UsageRecord.request_id,
        UsageRecord.created_at,
        UsageRecord.model,
        adapter,
        AdapterVersion.version.label("adapter_version"),
        AdapterVersion.sha256.label("adapter_sha256"),
        UsageRecord.end_user.label("user"),
        UsageRecord.finish_reason,
        UsageRecord.latency_ms,
    ]


def _metrics(group_by: str) -> dict[str, ColumnElement[Any]]:
    """Each metric of one row: sums over the group, or one record's own values."""
    if group_by == "request":
        return {
            "requests": literal_column("1", Integer),
            **{name: getattr(UsageRecord, name) for name in METRICS[1:]},
        }
    return {
        "requests": func.count(UsageRecord.id),
        **{name: func.sum(getattr(UsageRecord, name)) for name in METRICS[1:]},
    }


def _order_by(group_by: str) -> list[ColumnElement[Any]]:
    if group_by == "day":
        return [UsageRecord.tenant_id, literal_column("day")]
    if group_by == "adapter":
        return [UsageRecord.tenant_id, literal_column("adapter").nulls_first()]
    return [UsageRecord.tenant_id, UsageRecord.created_at, UsageRecord.request_id]


def usage_report(
    session: Session,
    *,
    tenant_id: str | None = None,
    start: datetime | None = None,
    end: datetime | None = None,
    group_by: str = "day",
) -> UsageReport:
    """Usage with ``start <= created_at < end`` (of one tenant, or all), grouped; see module.

    ``start`` / ``end`` must be timezone-aware; ``start > end`` and an unknown ``group_by``
    raise ``ValueError``. An unknown ``tenant_id`` simply has no usage.
    """
    if group_by not in GROUP_BYS:
        raise ValueError(f"group_by must be one of {', '.join(GROUP_BYS)}, got {group_by!r}")
    for name, bound in (("start", start), ("end", end)):
        if bound is not None and bound.utcoffset() is None:
            raise ValueError(f"{name} must be timezone-aware")
    if start is not None and end is not None and start > end:
        raise ValueError("start is after end")

    keys = _key_columns(group_by, session.get_bind().dialect.name)
    metrics = _metrics(group_by)
    statement = (
        select(
            *keys,
            *(value.label(name) for name, value in metrics.items()),
            # Grand totals in the same statement: one snapshot for rows and totals.
            *(func.sum(value).over().label(f"total_{name}") for name, value in metrics.items()),
        )
        .select_from(UsageRecord)
        .outerjoin(Adapter, Adapter.id == UsageRecord.adapter_id)
        .outerjoin(_ADAPTER_OWNER, _ADAPTER_OWNER.id == Adapter.tenant_id)
        .outerjoin(AdapterVersion, AdapterVersion.id == UsageRecord.adapter_version_id)
        .order_by(*_order_by(group_by))
    )
    if tenant_id is not None:
        statement = statement.where(UsageRecord.tenant_id == tenant_id)
    if start is not None:
        statement = statement.where(UsageRecord.created_at >= start)
    if end is not None:
        statement = statement.where(UsageRecord.created_at < end)
    if group_by != "request":
        statement = statement.group_by(*keys)

    columns = KEY_COLUMNS[group_by] + METRICS
    rows: list[dict[str, Any]] = []
    totals = dict.fromkeys(METRICS, 0)
    for result in session.execute(statement).mappings():
        row = {name: result[name] for name in columns}
        for name in METRICS:
            row[name] = int(row[name])
            totals[name] = int(result[f"total_{name}"])
        if "day" in row:
            row["day"] = _as_date(row["day"])
        rows.append(row)
    return UsageReport(group_by=group_by, columns=columns, rows=rows, totals=totals)


def format_cell(value: Any) -> str:
    """A CSV cell: empty for ``None``, ISO 8601 for dates and (UTC, ``Z``) datetimes."""
    if value is None:
        return ""
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if isinstance(value, date):
        return value.isoformat()
    return str(value)


def to_csv(report: UsageReport) -> str:
    """The report's rows as CSV: a header row of ``columns``, then one line per row.

    Totals are not a CSV row (sum the columns); CRLF line ends as RFC 4180 says.
    """
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(report.columns)
    for row in report.rows:
        writer.writerow([format_cell(row[name]) for name in report.columns])
    return buffer.getvalue()
