"""FastAPI dependencies: the platform context and who is calling."""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from datetime import timedelta
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from loramux.platform.api.errors import APIError
from loramux.platform.context import PlatformContext
from loramux.platform.db.models import ApiKey, Tenant
from loramux.platform.db.types import utc_now
from loramux.platform.services.adapter_runtime import AdapterRuntime
from loramux.platform.services.api_keys import api_key_hash


def get_context(request: Request) -> PlatformContext:
    return request.app.state.context


ContextDep = Annotated[PlatformContext, Depends(get_context)]


def bearer_token(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(
            401,
            "Missing bearer token: send `Authorization: Bearer <api key or admin token>`.",
            code="missing_api_key",
        )
    return token.strip()


BearerDep = Annotated[str, Depends(bearer_token)]


def is_admin_token(context: PlatformContext, token: str) -> bool:
    """Whether ``token`` is the operator's admin token.

    Timing-safe: the comparison takes as long whatever prefix matches.
    """
    return hmac.compare_digest(token.encode(), context.admin_token.encode())


def require_admin(context: ContextDep, token: BearerDep) -> None:
    if not is_admin_token(context, token):
        raise APIError(401, "Invalid admin token.", code="invalid_api_key")


AdminDep = Annotated[None, Depends(require_admin)]


def get_session(context: ContextDep) -> Iterator[Session]:
    """One database session per request, committed when the route returns normally."""
    with context.sessions.begin() as session:
        yield session


# scope="function": commit before the response is sent, so a failed commit is an error
# response rather than a success the database then doesn't hold.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]


LAST_USED_RESOLUTION = timedelta(minutes=1)
"""``ApiKey.last_used_at`` is rewritten at most this often per key (not on every request)."""


def _touch_api_key(session: Session, key: ApiKey) -> None:
    """Record that ``key`` was used now, unless that was already recorded within a minute.

    A write transaction of its own on ``session`` (which holds no other), so the row is
    never locked for the length of a request; the condition is in the UPDATE, so callers
    racing on one key write it once.
    """
    now = utc_now()
    stale = now - LAST_USED_RESOLUTION
    if key.last_used_at is not None and key.last_used_at > stale:
        return  # fresh enough: no write at all
    with session.begin():
        session.execute(
            update(ApiKey)
            .where(
                ApiKey.id == key.id,
                or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at <= stale),
            )
            .values(last_used_at=now)
        )


def current_tenant(session: SessionDep, token: BearerDep) -> Tenant:
    """The live tenant owning a live API key; 401 otherwise (same message either way).

    The key is read and touched on a short session of its own before the request's session
    holds a connection, and the tenant is then attached to the request's session without a
    query: holding the request's connection while the touch waited for a second one let a
    burst of requests (as many as the pool has connections) take every connection and wait
    on each other until the pool timed out, failing them all with 503s.
    """
    with Session(session.get_bind(), expire_on_commit=False) as own:
        with own.begin():
            row = own.execute(
                select(ApiKey, Tenant)
                .join(Tenant, ApiKey.tenant_id == Tenant.id)
                .where(ApiKey.key_hash == api_key_hash(token))
            ).first()
        if row is None or row.ApiKey.revoked_at is not None or row.Tenant.deleted_at is not None:
            raise APIError(401, "Invalid or revoked API key.", code="invalid_api_key")
        _touch_api_key(own, row.ApiKey)
    return session.merge(row.Tenant, load=False)


ADMIN_TOKEN_IS_NOT_A_KEY = (
    "This is the operator's admin token: it works on the /admin routes and the UI (/ui), "
    "not on a tenant's routes, which run as a tenant with its API key. Make one: "
    'POST /admin/tenants with {"name": "<tenant name>"}, then '
    "POST /admin/tenants/<tenant id>/api-keys (its `key` is shown once), both with the admin "
    "token (or in the UI: Tenants, then API keys); send that key as the bearer token."
)


def tenant_caller(context: ContextDep, session: SessionDep, token: BearerDep) -> Tenant:
    """:func:`current_tenant`, except that the admin token, which a new operator tries first
    (``loramux serve`` prints it), is told what it is and how to get a tenant's key."""
    if is_admin_token(context, token):
        raise APIError(401, ADMIN_TOKEN_IS_NOT_A_KEY, code="invalid_api_key")
    return current_tenant(session, token)


CurrentTenant = Annotated[Tenant, Depends(tenant_caller)]


def get_adapter_runtime(request: Request) -> AdapterRuntime:
    return request.app.state.adapter_runtime


AdapterRuntimeDep = Annotated[AdapterRuntime, Depends(get_adapter_runtime)]


def admin_or_tenant(context: ContextDep, session: SessionDep, token: BearerDep) -> Tenant | None:
    """``None`` for the admin token, the tenant for a live API key; 401 otherwise."""
    if is_admin_token(context, token):
        return None
    return current_tenant(session, token)


AdminOrTenant = Annotated[Tenant | None, Depends(admin_or_tenant)]
