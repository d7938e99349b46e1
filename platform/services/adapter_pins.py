"""Pinning an adapter version on the engines' devices, where it is never evicted.

An adapter has at most one pinned version (pinning another moves the pin). A tenant pins
its own within its ``pin_quota_bytes`` (set by an operator; none by default), counted as the
pinned versions' weights files (``size_bytes``); an operator pins any, outside every quota,
and only an operator lifts an operator's pin. The engines hold pins within their own share
of adapter memory and say how each stands (``AdapterRuntime.pin_states``): pinned, or why
not yet. Functions that write flush; the request's session commits.
"""

from __future__ import annotations

from typing import Literal

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from loramux.platform.db.models import Adapter, AdapterVersion, Tenant
from loramux.platform.errors import Conflict, NotFound
from loramux.platform.services import adapters
from loramux.platform.services.adapter_refs import AdapterRef

PinnedBy = Literal["tenant", "operator"]


def pinned_version(session: Session, adapter: Adapter) -> AdapterVersion | None:
    return session.scalar(
        select(AdapterVersion).where(
            AdapterVersion.adapter_id == adapter.id, AdapterVersion.pinned_by.is_not(None)
        )
    )


def _target(session: Session, adapter: Adapter, version: int | None) -> AdapterVersion:
    """The version to pin: that number (404, 409 as an alias would), else the one the bare
    name reaches now."""
    if version is not None:
        return adapters.ready_numbered_version(session, adapter, version)
    found = adapters.ready_version_of(session, adapter, AdapterRef(adapter.name))
    if found is None:
        raise NotFound(
            f"Adapter {adapter.name!r} has no ready version to pin.",
            code="adapter_version_not_found",
        )
    return found


def tenant_pinned_bytes(session: Session, tenant_id: str, other_than: str | None) -> int:
    """Bytes of the tenant's own pins (but for adapter ``other_than``'s)."""
    query = (
        select(func.coalesce(func.sum(AdapterVersion.size_bytes), 0))
        .join(Adapter, AdapterVersion.adapter_id == Adapter.id)
        .where(
            Adapter.tenant_id == tenant_id,
            Adapter.deleted_at.is_(None),
            AdapterVersion.pinned_by == "tenant",
        )
    )
    if other_than is not None:
        query = query.where(Adapter.id != other_than)
    return int(session.scalar(query))


def pin(
    session: Session, owner: Tenant, adapter: Adapter, version: int | None, by: PinnedBy
) -> tuple[AdapterVersion | None, AdapterVersion]:
    """Pin one ready version of ``adapter`` (of ``owner``), moving the adapter's pin if it
    had one: (the version unpinned, if another, the version pinned). A tenant's pin must
    fit its quota (409 ``pin_quota_exceeded``) and cannot replace an operator's (409
    ``pinned_by_operator``)."""
    target = _target(session, adapter, version)
    current = pinned_version(session, adapter)
    if by == "tenant":
        if current is not None and current.pinned_by == "operator":
            raise _operators(adapter)
        quota = owner.pin_quota_bytes or 0
        used = tenant_pinned_bytes(session, owner.id, other_than=adapter.id)
        size = target.size_bytes or 0
        if used + size > quota:
            raise Conflict(
                f"Pinning version {target.version} of {adapter.name!r} ({size:,} bytes) "
                f"would pass your pin quota: {used:,} of {quota:,} bytes are pinned already. "
                "Unpin another adapter, or ask your operator for a larger quota.",
                code="pin_quota_exceeded",
            )
    moved = None
    if current is not None and current.id != target.id:
        current.pinned_by = None
        moved = current
    target.pinned_by = by
    session.flush()
    return moved, target


def unpin(session: Session, adapter: Adapter, by: PinnedBy) -> AdapterVersion:
    """Lift the adapter's pin: the version unpinned. 404 ``pin_not_found`` without one,
    409 ``pinned_by_operator`` for a tenant lifting an operator's."""
    current = pinned_version(session, adapter)
    if current is None:
        raise NotFound(f"Adapter {adapter.name!r} is not pinned.", code="pin_not_found")
    if by == "tenant" and current.pinned_by == "operator":
        raise _operators(adapter)
    current.pinned_by = None
    session.flush()
    return current


def _operators(adapter: Adapter) -> Conflict:
    return Conflict(
        f"Adapter {adapter.name!r} was pinned by an operator: only an operator can move or "
        "lift that pin.",
        code="pinned_by_operator",
    )


def all_pinned(session: Session) -> list[AdapterVersion]:
    """Every pinned version of a live adapter (what the engines must hold)."""
    return list(
        session.scalars(
            select(AdapterVersion)
            .join(Adapter, AdapterVersion.adapter_id == Adapter.id)
            .where(AdapterVersion.pinned_by.is_not(None), Adapter.deleted_at.is_(None))
        ).all()
    )


def stored_pins(sessions) -> list[AdapterVersion]:
    """``all_pinned`` in a session of its own, detached (what a starting platform pins)."""
    with sessions() as session:
        versions = all_pinned(session)
        session.expunge_all()
    return versions
