"""The operator API under ``/admin``: tenants, their API keys, every tenant's adapters and
the engine's live snapshot (admin token required).

Routes only translate between HTTP and ``loramux.platform.services``; every one of them
needs ``Authorization: Bearer <admin token>`` (a router-wide dependency, so none can forget
it). Routes that also talk to the engine are ``async`` and run their database work in the
thread pool.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Depends, Query
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from loramux.engine import AsyncEngineError, EngineStats
from loramux.platform.api.admin.engine_schemas import EngineSnapshotOut
from loramux.platform.api.admin.schemas import (
    AdminAdapterList,
    AdminAdapterOut,
    ApiKeyCreate,
    ApiKeyCreated,
    ApiKeyOut,
    TenantCreate,
    TenantOut,
    TenantUpdate,
)
from loramux.platform.api.deps import ContextDep, SessionDep, require_admin
from loramux.platform.api.errors import APIError
from loramux.platform.db.types import utc_now
from loramux.platform.engine_fleet.merge import merge_stats
from loramux.platform.services import adapters, api_keys, tenants
from loramux.platform.services.adapters import VersionLabel

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])


# --- tenants ---------------------------------------------------------------------------------


@router.post("/tenants", status_code=201)
async def create_tenant(body: TenantCreate, session: SessionDep, context: ContextDep) -> TenantOut:
    view = await run_in_threadpool(tenants.create_tenant, session, body.to_new_tenant())
    if context.engine is not None:
        await tenants.push_scheduling(context.engine, view.tenant)
    return TenantOut.from_view(view)


@router.get("/tenants")
def list_tenants(session: SessionDep) -> list[TenantOut]:
    return [TenantOut.from_view(view) for view in tenants.list_tenants(session)]


@router.get("/tenants/{tenant_id}")
def get_tenant(tenant_id: str, session: SessionDep) -> TenantOut:
    return TenantOut.from_view(tenants.get_tenant(session, tenant_id))


@router.patch("/tenants/{tenant_id}")
async def update_tenant(
    tenant_id: str, body: TenantUpdate, session: SessionDep, context: ContextDep
) -> TenantOut:
    view = await run_in_threadpool(
        tenants.update_tenant, session, tenant_id, body.tenant_settings(), body.price_change()
    )
    # After the commit: the engine only ever hears values that are stored.
    if context.engine is not None and body.changes_scheduling():
        await tenants.push_scheduling(context.engine, view.tenant)
    return TenantOut.from_view(view)


@router.delete("/tenants/{tenant_id}", status_code=204)
def delete_tenant(tenant_id: str, session: SessionDep) -> None:
    tenants.delete_tenant(session, tenant_id)


# --- API keys --------------------------------------------------------------------------------


@router.post("/tenants/{tenant_id}/api-keys", status_code=201)
def create_api_key(
    tenant_id: str,
    session: SessionDep,
    body: Annotated[ApiKeyCreate | None, Body()] = None,
) -> ApiKeyCreated:
    name = None if body is None else body.name
    return ApiKeyCreated.from_issued(api_keys.issue_api_key(session, tenant_id, name))


@router.get("/tenants/{tenant_id}/api-keys")
def list_api_keys(tenant_id: str, session: SessionDep) -> list[ApiKeyOut]:
    return [ApiKeyOut.model_validate(row) for row in api_keys.list_api_keys(session, tenant_id)]


@router.delete("/api-keys/{key_id}", status_code=204)
def revoke_api_key(key_id: str, session: SessionDep) -> None:
    api_keys.revoke_api_key(session, key_id)


# --- every tenant's adapters -----------------------------------------------------------------


@router.get("/adapters")
def list_all_adapters(
    session: SessionDep,
    tenant_id: Annotated[
        str | None, Query(description="Only this tenant's (404 if unknown).")
    ] = None,
) -> AdminAdapterList:
    """Live adapters of every live tenant (or of one), each with its latest version."""
    if tenant_id is not None:
        tenants.live_tenant(session, tenant_id)  # 404 for an unknown or deleted tenant
    owned = adapters.list_all_adapters(session, tenant_id)
    return AdminAdapterList(data=[AdminAdapterOut.from_tenant_view(item) for item in owned])


# --- the engine ------------------------------------------------------------------------------


def _engine_labels(
    session: Session, stats: EngineStats
) -> tuple[dict[str, VersionLabel], dict[str, str]]:
    """The names behind the engine's ids: adapter versions (those registered, and those
    speculation counted for; "" is the base model) and tenants."""
    versions = {*stats.adapter_residency, *stats.speculation} - {""}
    labels = adapters.version_labels(session, versions)
    return labels, tenants.tenant_names(session, stats.tenant_ids)


@router.get("/engine")
async def engine_snapshot(session: SessionDep, context: ContextDep) -> EngineSnapshotOut:
    """The engines now, merged (requests, KV cache, adapters per tier, recent latency and
    the tenants' scheduling as the engines hold it), with each engine's own row."""
    if context.engine is None:
        raise APIError(503, "No engine runs in this platform process.", code="engine_unavailable")
    try:
        reports = await context.engine.engine_reports()
    except AsyncEngineError as exc:  # the in-process engine stopped
        raise APIError(503, f"The engine cannot report: {exc}", code="engine_unavailable") from exc
    parts = [report.stats for report in reports if report.stats is not None]
    if not parts:
        raise APIError(
            503,
            f"The engines cannot report: no live engine serves {context.base_model.model_id} "
            f"({len(reports)} registered, none answered; `loramux engines` lists them).",
            code="engine_unavailable",
        )
    stats = merge_stats(parts)
    taken_at = utc_now()
    labels, names = await run_in_threadpool(_engine_labels, session, stats)
    return EngineSnapshotOut.from_stats(
        stats, taken_at=taken_at, labels=labels, tenant_names=names, engines=reports
    )
