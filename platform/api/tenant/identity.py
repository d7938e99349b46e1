"""``GET /v1/me``: who is calling, so a client (the admin UI) can show the right pages.

Any valid bearer token may ask: the admin token answers ``operator``, a live API key
``tenant`` with its tenant; anything else is the usual 401.
"""

from __future__ import annotations

from fastapi import APIRouter

from loramux.platform.api.deps import AdminOrTenant
from loramux.platform.api.tenant.identity_schemas import IdentityOut

router = APIRouter(tags=["identity"])


@router.get("/v1/me")
def whoami(caller: AdminOrTenant) -> IdentityOut:
    if caller is None:
        return IdentityOut(role="operator")
    return IdentityOut(role="tenant", tenant_id=caller.id, tenant_name=caller.name)
