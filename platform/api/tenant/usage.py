"""Usage and billing export: ``GET /admin/usage`` (operators) and ``GET /v1/usage`` (tenants),
and ``GET /v1/usage/shared`` (an owner's view of what grantees ran on its shared adapters).

Both answer ``{"rows": [...], "totals": {...}}`` (or, with ``format=csv``, the same rows as a
CSV attachment) from ``loramux.platform.services.billing.usage_report``; the period and
its parameters are described in ``loramux.platform.api.tenant.usage_schemas``. The totals equal
exactly the sum of the rows, and of the ``usage`` objects the API returned for the same
requests.
"""

from __future__ import annotations

from datetime import datetime, time
from typing import Annotated

from fastapi import APIRouter, Query, Response

from loramux.platform.api.deps import AdminDep, CurrentTenant, SessionDep
from loramux.platform.api.tenant.usage_schemas import (
    REPORT_SCHEMAS,
    AdminUsageQuery,
    PeriodQuery,
    SharedUsageReport,
    UsageQuery,
    UsageReportOut,
)
from loramux.platform.db.models import Tenant
from loramux.platform.services.adapter_grants import SHARED_USAGE_METRICS, shared_usage
from loramux.platform.services.billing import UsageReport, to_csv, usage_report
from loramux.platform.services.tenants import tenant_not_found

router = APIRouter(tags=["usage"])

CSV_RESPONSE = {200: {"content": {"text/csv": {}}, "description": "JSON, or CSV with format=csv"}}


def _label(moment: datetime | None, unbounded: str) -> str:
    """A bound in a file name: ``2031-05-01`` at midnight, else ``2031-05-01T120000Z``."""
    if moment is None:
        return unbounded
    if moment.time() == time(0):
        return moment.date().isoformat()
    return moment.strftime("%Y-%m-%dT%H%M%S.%fZ" if moment.microsecond else "%Y-%m-%dT%H%M%SZ")


def _render(report: UsageReport, query: UsageQuery) -> Response | UsageReportOut:
    if query.format == "csv":
        filename = f"usage-{_label(query.start, 'beginning')}-{_label(query.end, 'now')}.csv"
        return Response(
            content=to_csv(report),
            media_type="text/csv",
            headers={"Content-Disposition": f'attachment; filename="{filename}"'},
        )
    schema = REPORT_SCHEMAS[report.group_by]
    return schema.model_validate({"rows": report.rows, "totals": report.totals})


@router.get("/admin/usage", response_model=UsageReportOut, responses=CSV_RESPONSE)
def admin_usage(
    _: AdminDep, session: SessionDep, query: Annotated[AdminUsageQuery, Query()]
) -> Response | UsageReportOut:
    """Any tenant's usage (every tenant's without ``tenant_id``), grouped and totalled."""
    if query.tenant_id is not None and session.get(Tenant, query.tenant_id) is None:
        raise tenant_not_found(query.tenant_id)
    report = usage_report(
        session,
        tenant_id=query.tenant_id,
        start=query.start,
        end=query.end,
        group_by=query.group_by,
    )
    return _render(report, query)


@router.get("/v1/usage", response_model=UsageReportOut, responses=CSV_RESPONSE)
def tenant_usage(
    tenant: CurrentTenant, session: SessionDep, query: Annotated[UsageQuery, Query()]
) -> Response | UsageReportOut:
    """The calling tenant's own usage (by day unless ``group_by`` says otherwise)."""
    report = usage_report(
        session, tenant_id=tenant.id, start=query.start, end=query.end, group_by=query.group_by
    )
    return _render(report, query)


@router.get("/v1/usage/shared")
def shared_adapter_usage(
    tenant: CurrentTenant, session: SessionDep, query: Annotated[PeriodQuery, Query()]
) -> SharedUsageReport:
    """What other tenants ran on the caller's shared adapters, per adapter and grantee:
    requests and tokens (never their prompts or what they paid). Their usage is billed to
    them, at their prices."""
    rows = shared_usage(session, tenant, start=query.start, end=query.end)
    totals = {name: sum(row[name] for row in rows) for name in SHARED_USAGE_METRICS}
    return SharedUsageReport.model_validate({"rows": rows, "totals": totals})
