"""Pinning an adapter on the device: ``/v1/adapters/{name}/pin`` (``services/adapter_pins``).

``PUT`` pins one ready version (the bare name's, unless a number is given; moving the
adapter's pin if it had one) within the tenant's pin quota; ``GET`` says which version is
pinned and whether the engines hold it; ``DELETE`` lifts the pin. Requests resolved after
the answer find the version on the device; the engines never evict it.
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from loramux.platform.api.deps import AdapterRuntimeDep, CurrentTenant, SessionDep
from loramux.platform.api.tenant.adapter_schemas import PinIn, PinOut
from loramux.platform.db.models import Adapter, AdapterVersion, Tenant
from loramux.platform.services import adapter_pins as service
from loramux.platform.services import adapters
from loramux.platform.services.adapter_runtime import AdapterRuntime

router = APIRouter(prefix="/v1/adapters", tags=["adapters"])


async def pin_out(
    session, tenant: Tenant, adapter: Adapter, runtime: AdapterRuntime, pinned=None
) -> PinOut:
    """The adapter's pin as the tenant sees it (``pinned``: the version, when known)."""
    version: AdapterVersion | None = pinned or await run_in_threadpool(
        service.pinned_version, session, adapter
    )
    used = await run_in_threadpool(service.tenant_pinned_bytes, session, tenant.id, None)
    state = None
    if version is not None:
        states = await runtime.pin_states()
        state = states.get(runtime.engine_name(version), "not on the engines yet")
    return PinOut(
        adapter=adapter.name,
        version=None if version is None else version.version,
        pinned_by=None if version is None else version.pinned_by,
        size_bytes=None if version is None else version.size_bytes,
        state=state,
        quota_bytes=tenant.pin_quota_bytes or 0,
        pinned_bytes=used,
    )


async def apply_pin(
    session, owner: Tenant, adapter: Adapter, version: int | None, by, runtime: AdapterRuntime
) -> PinOut:
    """Pin the version (``services/adapter_pins.pin``), move the engines' pin to it, and
    answer with the pin as the owner sees it."""
    moved, pinned = await run_in_threadpool(service.pin, session, owner, adapter, version, by)
    if moved is not None:
        await runtime.unpin(moved)
    await runtime.pin(pinned)
    return await pin_out(session, owner, adapter, runtime, pinned)


@router.get("/{name}/pin")
async def get_pin(
    name: str, session: SessionDep, tenant: CurrentTenant, runtime: AdapterRuntimeDep
) -> PinOut:
    """The adapter's pinned version, if any, and whether the engines hold it."""
    adapter = await run_in_threadpool(adapters.live_adapter, session, tenant, name)
    return await pin_out(session, tenant, adapter, runtime)


@router.put("/{name}/pin")
async def pin(
    name: str,
    body: PinIn,
    session: SessionDep,
    tenant: CurrentTenant,
    runtime: AdapterRuntimeDep,
) -> PinOut:
    """Keep one version of the adapter on the device (within the tenant's pin quota)."""
    adapter = await run_in_threadpool(adapters.live_adapter, session, tenant, name)
    return await apply_pin(session, tenant, adapter, body.version, "tenant", runtime)


@router.delete("/{name}/pin", status_code=204)
async def unpin(
    name: str, session: SessionDep, tenant: CurrentTenant, runtime: AdapterRuntimeDep
) -> None:
    """Lift the pin: the engines may evict the version again when idle."""
    adapter = await run_in_threadpool(adapters.live_adapter, session, tenant, name)
    version = await run_in_threadpool(service.unpin, session, adapter, "tenant")
    await runtime.unpin(version)
