"""The operator's pins: ``/admin/adapters/{adapter_id}/pin`` (``services/adapter_pins``).

An operator pins any tenant's adapter version on the engines' devices, outside every
tenant's quota, and lifts any pin; a tenant cannot lift an operator's. ``GET /admin/engine``
shows each pinned version and whether the engines hold it.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool

from loramux.platform.api.deps import AdapterRuntimeDep, SessionDep, require_admin
from loramux.platform.api.tenant.adapter_pins import apply_pin
from loramux.platform.api.tenant.adapter_schemas import PinIn, PinOut
from loramux.platform.services import adapter_pins as service
from loramux.platform.services import adapters

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])


@router.put("/adapters/{adapter_id}/pin")
async def pin(
    adapter_id: str, body: PinIn, session: SessionDep, runtime: AdapterRuntimeDep
) -> PinOut:
    """Keep one version of any tenant's adapter on the device (no quota applies)."""
    adapter, tenant = await run_in_threadpool(adapters.live_adapter_by_id, session, adapter_id)
    return await apply_pin(session, tenant, adapter, body.version, "operator", runtime)


@router.delete("/adapters/{adapter_id}/pin", status_code=204)
async def unpin(adapter_id: str, session: SessionDep, runtime: AdapterRuntimeDep) -> None:
    """Lift any pin of the adapter, the tenant's or an operator's."""
    adapter, _ = await run_in_threadpool(adapters.live_adapter_by_id, session, adapter_id)
    version = await run_in_threadpool(service.unpin, session, adapter, "operator")
    await runtime.unpin(version)
