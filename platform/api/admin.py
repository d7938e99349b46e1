"""The operator API under ``/admin``: tenants and their API keys (admin token required).

Routes only translate between HTTP and ``loramux.platform.services``; every one of them
needs ``Authorization: Bearer <admin token>`` (a router-wide dependency, so none can forget
it). Routes that also talk to the engine are ``async`` and run their database work in the
thread pool.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Depends
from starlette.concurrency import run_in_threadpool

from loramux.platform.api.deps import ContextDep, SessionDep, require_admin
from loramux.platform.api.schemas_admin import (
    ApiKeyCreate,
    ApiKeyCreated,
    ApiKeyOut,
    TenantCreate,
    TenantOut,
    TenantUpdate,
)
from loramux.platform.services import api_keys, tenants

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
