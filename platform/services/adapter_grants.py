"""Sharing: an owner lets named tenants (grantees) call one of its adapters.

A grant is a row of ``adapter_grants``: every version (``version`` null, the bare name then
reaching what the owner's name reaches) or one version alone. Grantees call it as
``owner/name`` (and ``owner/name@3``, ``owner/name@sha256:<prefix>``), see it in
``/v1/models`` under that name, and pay for what they run with it at their own prices: the
usage record is theirs, naming the owner's adapter. They never see its weights, its other
versions or its grants. Revoking deletes the row, so the grantee's next request is a 404.

Every way of naming an adapter that is neither the caller's nor granted to it answers
exactly as an adapter that does not exist does: a tenant learns nothing of another's
adapters by probing. Functions that write flush; the request's session commits.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session, aliased

from loramux.platform.db.models import Adapter, AdapterGrant, AdapterVersion, Tenant, UsageRecord
from loramux.platform.errors import Invalid, NotFound
from loramux.platform.services import adapters
from loramux.platform.services.adapter_refs import AdapterRef


def _live_tenant_named(session: Session, name: str) -> Tenant | None:
    return session.scalar(select(Tenant).where(Tenant.name == name, Tenant.deleted_at.is_(None)))


# --- calling -----------------------------------------------------------------------------


def callable_version(
    session: Session, caller: Tenant, ref: AdapterRef
) -> tuple[Adapter, AdapterVersion] | None:
    """The adapter and ready version ``ref`` names, if the caller may call it: its own, or
    one granted to it (``owner/...``); ``None`` otherwise, whatever the reason."""
    if ref.owner is None or ref.owner == caller.name:
        return adapters.ready_version(session, caller.id, ref.own())
    found = session.execute(
        select(Adapter, AdapterGrant)
        .join(Tenant, Adapter.tenant_id == Tenant.id)
        .join(AdapterGrant, AdapterGrant.adapter_id == Adapter.id)
        .where(
            Tenant.name == ref.owner,
            Tenant.deleted_at.is_(None),
            Adapter.name == ref.name,
            Adapter.deleted_at.is_(None),
            AdapterGrant.grantee_tenant_id == caller.id,
        )
    ).first()
    if found is None:
        return None
    adapter, grant = found
    version = adapters.ready_version_of(session, adapter, ref, only=grant.version)
    return None if version is None else (adapter, version)


@dataclass(frozen=True)
class SharedAdapter:
    """An adapter granted to the caller, with the version its bare ``owner/name`` reaches."""

    owner: Tenant
    adapter: Adapter
    version: AdapterVersion

    @property
    def name(self) -> str:
        return f"{self.owner.name}/{self.adapter.name}"


def shared_with(session: Session, grantee: Tenant) -> list[SharedAdapter]:
    """Adapters granted to ``grantee`` that can serve now (live, with a ready version), by
    owner then name."""
    rows = session.execute(
        select(Adapter, AdapterGrant, Tenant)
        .join(Tenant, Adapter.tenant_id == Tenant.id)
        .join(AdapterGrant, AdapterGrant.adapter_id == Adapter.id)
        .where(
            AdapterGrant.grantee_tenant_id == grantee.id,
            Adapter.deleted_at.is_(None),
            Tenant.deleted_at.is_(None),
        )
        .order_by(Tenant.name, Adapter.name)
    ).all()
    shared = []
    for adapter, grant, owner in rows:
        version = adapters.ready_version_of(
            session, adapter, AdapterRef(adapter.name), only=grant.version
        )
        if version is not None:
            shared.append(SharedAdapter(owner, adapter, version))
    return shared


# --- the owner's side --------------------------------------------------------------------


@dataclass(frozen=True)
class GrantView:
    grant: AdapterGrant
    grantee: Tenant


def grants_of(session: Session, adapter: Adapter) -> list[GrantView]:
    """The adapter's grants to live tenants, by grantee name."""
    rows = session.execute(
        select(AdapterGrant, Tenant)
        .join(Tenant, AdapterGrant.grantee_tenant_id == Tenant.id)
        .where(AdapterGrant.adapter_id == adapter.id, Tenant.deleted_at.is_(None))
        .order_by(Tenant.name)
    ).all()
    return [GrantView(grant, grantee) for grant, grantee in rows]


def _grantee(session: Session, owner: Tenant, name: str) -> Tenant:
    grantee = _live_tenant_named(session, name)
    if grantee is None:
        raise NotFound(f"No tenant named {name!r}.", code="grantee_not_found")
    if grantee.id == owner.id:
        raise Invalid(
            "A tenant calls its own adapters already: grant to another tenant.",
            code="invalid_grant",
        )
    return grantee


def grant(
    session: Session, owner: Tenant, adapter_name: str, grantee_name: str, version: int | None
) -> GrantView:
    """Let ``grantee_name`` call the owner's adapter: every version (``None``) or one ready
    version. Granting again replaces the version. 404 for an adapter, version or tenant
    that does not exist, 409 for a version not ready, 400 for the owner itself."""
    adapter = adapters.live_adapter(session, owner, adapter_name)
    grantee = _grantee(session, owner, grantee_name)
    if version is not None:
        adapters.ready_numbered_version(session, adapter, version)
    found = session.scalar(
        select(AdapterGrant).where(
            AdapterGrant.adapter_id == adapter.id, AdapterGrant.grantee_tenant_id == grantee.id
        )
    )
    if found is None:
        found = AdapterGrant(adapter_id=adapter.id, grantee_tenant_id=grantee.id)
        session.add(found)
    found.version = version
    session.flush()
    return GrantView(found, grantee)


def revoke(session: Session, owner: Tenant, adapter_name: str, grantee_name: str) -> None:
    """End the grant: the grantee's requests resolved after this commits are 404s (those
    already running finish). 404 if there is no such grant."""
    adapter = adapters.live_adapter(session, owner, adapter_name)
    found = session.scalar(
        select(AdapterGrant)
        .join(Tenant, AdapterGrant.grantee_tenant_id == Tenant.id)
        .where(AdapterGrant.adapter_id == adapter.id, Tenant.name == grantee_name)
    )
    if found is None:
        raise NotFound(
            f"Adapter {adapter_name!r} is not granted to {grantee_name!r}.",
            code="grant_not_found",
        )
    session.delete(found)
    session.flush()


SHARED_USAGE_METRICS = ("requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens")


def shared_usage(
    session: Session, owner: Tenant, *, start: datetime | None, end: datetime | None
) -> list[dict]:
    """Other tenants' use of the owner's adapters, per adapter and grantee: counts and
    tokens (never prompts, nor what the grantee paid), ``start <= created_at < end``."""
    grantee = aliased(Tenant)
    statement = (
        select(
            Adapter.name.label("adapter"),
            grantee.name.label("grantee"),
            func.count(UsageRecord.id).label("requests"),
            *(func.sum(getattr(UsageRecord, n)).label(n) for n in SHARED_USAGE_METRICS[1:]),
        )
        .select_from(UsageRecord)
        .join(Adapter, Adapter.id == UsageRecord.adapter_id)
        .join(grantee, grantee.id == UsageRecord.tenant_id)
        .where(Adapter.tenant_id == owner.id, UsageRecord.tenant_id != owner.id)
        .group_by(Adapter.name, grantee.name)
        .order_by(Adapter.name, grantee.name)
    )
    if start is not None:
        statement = statement.where(UsageRecord.created_at >= start)
    if end is not None:
        statement = statement.where(UsageRecord.created_at < end)
    return [
        {"adapter": row.adapter, "grantee": row.grantee}
        | {name: int(getattr(row, name)) for name in SHARED_USAGE_METRICS}
        for row in session.execute(statement)
    ]
