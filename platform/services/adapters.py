"""Tenants' adapters: names, look-ups, lists and soft-delete.

Uploads (and their validation) are ``loramux.platform.services.adapter_upload``. Every
function here is blocking; async routes call them through the thread pool. Functions that
write commit before returning.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from loramux.platform.db.models import Adapter, AdapterStatus, AdapterVersion, Tenant
from loramux.platform.db.types import utc_now
from loramux.platform.errors import Conflict, Invalid, NotFound
from loramux.platform.services.adapter_refs import AdapterRef

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class AdapterView:
    """An adapter with its latest version (``None`` only while no version exists)."""

    adapter: Adapter
    version: AdapterVersion | None
    # An upload whose bytes a ready version already holds answers with that version.
    reused: bool = False


# --- names and look-ups ----------------------------------------------------------------------


def check_adapter_name(name: str, *, base_model_id: str | None = None) -> str:
    """``name`` if a tenant may call an adapter so: 422 for a malformed name, 409 for the
    base model's own (requests naming it reach the base model, so the adapter never would)."""
    if not NAME_PATTERN.fullmatch(name):
        raise Invalid(
            f"Invalid adapter name {name!r}: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit.",
            code="invalid_adapter_name",
        )
    if name == base_model_id:
        raise Conflict(
            f"The adapter name {name!r} is the base model's name: requests for it would reach "
            "the base model, never the adapter. Choose another name.",
            code="adapter_name_conflict",
        )
    return name


def _not_found(name: str) -> NotFound:
    # The same answer whether the name is unknown or another tenant's: names never leak.
    return NotFound(f"No adapter named {name!r}.", code="adapter_not_found")


def _find_live_adapter(session: Session, tenant_id: str, name: str) -> Adapter | None:
    return session.scalar(
        select(Adapter).where(
            Adapter.tenant_id == tenant_id, Adapter.name == name, Adapter.deleted_at.is_(None)
        )
    )


def live_adapter(session: Session, tenant: Tenant, name: str) -> Adapter:
    """The tenant's live adapter called ``name``; 404 otherwise."""
    adapter = _find_live_adapter(session, tenant.id, name)
    if adapter is None:
        raise _not_found(name)
    return adapter


def live_adapter_by_id(session: Session, adapter_id: str) -> tuple[Adapter, Tenant]:
    """A live adapter of a live tenant by its id, with the tenant (operators' routes); 404
    otherwise."""
    found = session.execute(
        select(Adapter, Tenant)
        .join(Tenant, Adapter.tenant_id == Tenant.id)
        .where(Adapter.id == adapter_id, Adapter.deleted_at.is_(None), Tenant.deleted_at.is_(None))
    ).first()
    if found is None:
        raise NotFound(f"No adapter with id {adapter_id!r}.", code="adapter_not_found")
    return found[0], found[1]


def latest_version(
    session: Session, adapter: Adapter, *, ready: bool = False
) -> AdapterVersion | None:
    query = select(AdapterVersion).where(AdapterVersion.adapter_id == adapter.id)
    if ready:
        query = query.where(AdapterVersion.status == AdapterStatus.READY.value)
    return session.scalar(query.order_by(AdapterVersion.version.desc()).limit(1))


def ready_version(
    session: Session, tenant_id: str, ref: AdapterRef
) -> tuple[Adapter, AdapterVersion] | None:
    """The tenant's live adapter ``ref`` names and the ready version it means (the bare
    name: the version its alias names, else its newest; or by number or digest prefix), if
    both exist; a 400 for a digest prefix that two of its versions share. ``ref``'s owner
    is not read here (``adapter_grants.callable_version`` reads it)."""
    adapter = _find_live_adapter(session, tenant_id, ref.name)
    if adapter is None:
        return None
    version = ready_version_of(session, adapter, ref)
    return None if version is None else (adapter, version)


def ready_version_of(
    session: Session, adapter: Adapter, ref: AdapterRef, *, only: int | None = None
) -> AdapterVersion | None:
    """The ready version of ``adapter`` that ``ref`` means (see ``ready_version``); with
    ``only``, that version number alone can be meant, and the bare name means it."""
    number = ref.number if not ref.is_bare else (only or adapter.alias_version)
    if only is not None and number not in (None, only):
        return None
    if number is None and ref.digest_prefix is None:  # the bare name, no alias set
        return latest_version(session, adapter, ready=True)
    query = select(AdapterVersion).where(
        AdapterVersion.adapter_id == adapter.id,
        AdapterVersion.status == AdapterStatus.READY.value,
    )
    if number is not None or only is not None:
        query = query.where(AdapterVersion.version == (number or only))
    if ref.digest_prefix is not None:
        query = query.where(AdapterVersion.sha256.startswith(ref.digest_prefix, autoescape=True))
    found = session.scalars(query.limit(2)).all()
    if len(found) > 1:
        raise Invalid(
            f"{str(ref)!r} matches more than one version of {ref.name!r}: give more digits "
            "of its sha256, or its version number.",
            code="invalid_model",
        )
    return found[0] if found else None


def versions_of(session: Session, adapter: Adapter) -> list[AdapterVersion]:
    """Every version of the adapter, newest first."""
    query = select(AdapterVersion).where(AdapterVersion.adapter_id == adapter.id)
    return list(session.scalars(query.order_by(AdapterVersion.version.desc())).all())


def ready_numbered_version(session: Session, adapter: Adapter, version: int) -> AdapterVersion:
    """The adapter's version ``version``: 404 if it has none, 409 if it is not ready."""
    found = session.scalar(
        select(AdapterVersion).where(
            AdapterVersion.adapter_id == adapter.id, AdapterVersion.version == version
        )
    )
    if found is None:
        raise NotFound(
            f"Adapter {adapter.name!r} has no version {version}.",
            code="adapter_version_not_found",
        )
    if found.status != AdapterStatus.READY.value:
        raise Conflict(
            f"Version {version} of {adapter.name!r} is {found.status}, not ready: only a "
            "ready version can be named so.",
            code="adapter_version_not_ready",
        )
    return found


def set_alias(session: Session, tenant: Tenant, name: str, version: int | None) -> Adapter:
    """Point the adapter's bare name at its ready version ``version`` (None: back to the
    newest ready). Flushed, not committed: the request's session commits before the answer
    is sent, so requests resolved after the answer reach it. 404 for a version the adapter
    does not have, 409 for one that is not ready."""
    adapter = live_adapter(session, tenant, name)
    if version is not None:
        ready_numbered_version(session, adapter, version)
    adapter.alias_version = version
    session.flush()
    return adapter


def get_adapter(session: Session, adapter: Adapter) -> AdapterView:
    return AdapterView(adapter, latest_version(session, adapter))


def _live_adapters(session: Session, tenant: Tenant) -> list[Adapter]:
    return list(
        session.scalars(
            select(Adapter)
            .where(Adapter.tenant_id == tenant.id, Adapter.deleted_at.is_(None))
            .order_by(Adapter.name)
        ).all()
    )


def list_adapters(session: Session, tenant: Tenant) -> list[AdapterView]:
    """The tenant's live adapters, by name, each with its latest version."""
    return [get_adapter(session, adapter) for adapter in _live_adapters(session, tenant)]


def ready_adapters(session: Session, tenant: Tenant) -> list[AdapterView]:
    """The tenant's live adapters that can serve, each with its latest ready version."""
    views = []
    for adapter in _live_adapters(session, tenant):
        ready = latest_version(session, adapter, ready=True)
        if ready is not None:
            views.append(AdapterView(adapter, ready))
    return views


def delete_adapter(session: Session, adapter: Adapter) -> list[AdapterVersion]:
    """Soft-delete ``adapter``; returns its versions (for the caller to unload)."""
    versions = list(adapter.versions)
    adapter.deleted_at = utc_now()
    session.commit()
    return versions


# --- operators' views ------------------------------------------------------------------------


@dataclass(frozen=True)
class TenantAdapterView:
    """An adapter with its owner, for operators (who see every tenant's)."""

    tenant: Tenant
    view: AdapterView


def list_all_adapters(session: Session, tenant_id: str | None = None) -> list[TenantAdapterView]:
    """Live adapters of live tenants (only ``tenant_id``'s when given), by tenant name then
    adapter name, each with its latest version."""
    statement = (
        select(Adapter, Tenant)
        .join(Tenant, Adapter.tenant_id == Tenant.id)
        .where(Adapter.deleted_at.is_(None), Tenant.deleted_at.is_(None))
        .order_by(Tenant.name, Adapter.name)
    )
    if tenant_id is not None:
        statement = statement.where(Tenant.id == tenant_id)
    return [
        TenantAdapterView(tenant, get_adapter(session, adapter))
        for adapter, tenant in session.execute(statement).all()
    ]


@dataclass(frozen=True)
class VersionLabel:
    """Who an adapter version belongs to, in the names people use."""

    tenant_id: str
    tenant_name: str
    adapter: str
    version: int


def version_labels(session: Session, version_ids: Iterable[str]) -> dict[str, VersionLabel]:
    """Version id -> its tenant and adapter names; unknown ids are left out.

    The engine knows adapters by version id (``AdapterRuntime.engine_name``); operators
    read them as "tenant / adapter v2".
    """
    ids = sorted(set(version_ids))
    if not ids:
        return {}
    rows = session.execute(
        select(AdapterVersion.id, AdapterVersion.version, Adapter.name, Tenant.id, Tenant.name)
        .join(Adapter, AdapterVersion.adapter_id == Adapter.id)
        .join(Tenant, Adapter.tenant_id == Tenant.id)
        .where(AdapterVersion.id.in_(ids))
    ).all()
    return {
        version_id: VersionLabel(tenant_id, tenant_name, adapter, version)
        for version_id, version, adapter, tenant_id, tenant_name in rows
    }
