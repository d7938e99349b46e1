"""Sharing an adapter: ``/v1/adapters/{name}/grants``, the owner's side of ``adapter_grants``.

The owner grants a tenant (by name) every version of an adapter or one version, lists its
grants and revokes them; grantees call the adapter as ``<owner>/<name>`` and find it in
``/v1/models``. Every route here acts on the caller's own adapter: a grantee (or anyone
else) naming an adapter it does not own gets the 404 of an adapter that does not exist.
``GET /v1/usage/shared`` tells the owner what grantees ran on its adapters.
"""

from __future__ import annotations

from fastapi import APIRouter

from loramux.platform.api.deps import CurrentTenant, SessionDep
from loramux.platform.api.tenant.adapter_schemas import GrantIn, GrantList, GrantOut
from loramux.platform.services import adapter_grants as service
from loramux.platform.services import adapters

router = APIRouter(prefix="/v1/adapters", tags=["adapters"])


@router.get("/{name}/grants")
def list_grants(name: str, session: SessionDep, tenant: CurrentTenant) -> GrantList:
    """Who may call the adapter, by grantee name."""
    adapter = adapters.live_adapter(session, tenant, name)
    views = service.grants_of(session, adapter)
    return GrantList(data=[GrantOut.of(tenant.name, adapter.name, view) for view in views])


@router.put("/{name}/grants/{grantee:path}")
def grant(
    name: str, grantee: str, body: GrantIn, session: SessionDep, tenant: CurrentTenant
) -> GrantOut:
    """Let the tenant named ``grantee`` call the adapter (every version, or one); granting
    again changes the version. Its requests after the answer may call it."""
    view = service.grant(session, tenant, name, grantee, body.version)
    return GrantOut.of(tenant.name, name, view)


@router.delete("/{name}/grants/{grantee:path}", status_code=204)
def revoke(name: str, grantee: str, session: SessionDep, tenant: CurrentTenant) -> None:
    """End the grant: the grantee's requests after the answer are 404s; those already
    running finish."""
    service.revoke(session, tenant, name, grantee)
