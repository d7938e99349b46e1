"""Tenants: create, read, change and soft-delete them; their price lists; engine knobs.

Every function takes the caller's ``Session``. Functions that write commit before they
return (the request's session dependency would only commit after the response is sent),
so a conflict surfaces as a ``Conflict`` inside the request (not after the response was
sent) and the engine is only told about values that are stored.

Money is integer micro-dollars here (``Price`` and ``Tenant.monthly_budget_micro_usd``);
``usd_to_micro_usd`` / ``micro_usd_to_usd`` convert at the API edge, exactly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from loramux.platform.db.models import DEFAULT_PRIORITY, DEFAULT_WEIGHT, ApiKey, Price, Tenant
from loramux.platform.db.pricing import current_price
from loramux.platform.db.types import utc_now
from loramux.platform.engine_fleet.client import EngineClient
from loramux.platform.errors import Conflict, NotFound

MICRO_USD_PER_USD = 1_000_000

# The tenant settings the admin API, ``NewTenant`` and the row all call by the same name
# (the budget is converted between USD and micro-USD on the way).
SETTINGS_NAMED_ALIKE = (
    "name",
    "priority",
    "weight",
    "requests_per_minute",
    "tokens_per_minute",
    "request_timeout_s",
    "max_queued_requests",
    "pin_quota_bytes",
)
# Tenant columns ``update_tenant`` may set (prices go through ``PriceChange``).
TENANT_SETTINGS = frozenset({*SETTINGS_NAMED_ALIKE, "monthly_budget_micro_usd"})
SCHEDULING_SETTINGS = frozenset({"priority", "weight"})


# --- money -----------------------------------------------------------------------------------


def usd_to_micro_usd(usd: float) -> int:
    """``usd`` dollars as whole micro-dollars, exactly: ``Decimal(str(usd)) * 10**6``.

    Going through ``str`` keeps the decimal the client wrote (``0.15`` → ``150000``, never
    ``149999``). ``ValueError`` for negative or non-finite amounts and for amounts finer than
    one micro-dollar (more than 6 decimal places).
    """
    amount = Decimal(str(usd))
    if not amount.is_finite():
        raise ValueError("must be a finite number")
    if amount < 0:
        raise ValueError("must not be negative")
    micro = amount * MICRO_USD_PER_USD
    if micro != micro.to_integral_value():
        raise ValueError("must have at most 6 decimal places (whole micro-dollars)")
    return int(micro)


def micro_usd_to_usd(micro_usd: int) -> float:
    """Micro-dollars as a dollar float (the nearest double to the exact quotient)."""
    return micro_usd / MICRO_USD_PER_USD


# --- inputs and outputs ----------------------------------------------------------------------


@dataclass(frozen=True)
class PriceSpec:
    """A full price list, micro-dollars per million tokens."""

    input: int = 0
    cached_input: int = 0
    output: int = 0


@dataclass(frozen=True)
class PriceChange:
    """Parts of a price list to change; ``None`` keeps the value in force.

    Like at creation, the cached-input price follows the input price: changing ``input``
    without giving ``cached_input`` sets both to the new input price.
    """

    input: int | None = None
    cached_input: int | None = None
    output: int | None = None

    def applied_to(self, current: Price | None) -> PriceSpec:
        base = (
            PriceSpec()
            if current is None
            else PriceSpec(
                input=current.input_micro_usd_per_mtok,
                cached_input=current.cached_input_micro_usd_per_mtok,
                output=current.output_micro_usd_per_mtok,
            )
        )
        new_input = base.input if self.input is None else self.input
        if self.cached_input is not None:
            new_cached = self.cached_input
        elif self.input is not None:
            new_cached = self.input
        else:
            new_cached = base.cached_input
        return PriceSpec(
            input=new_input,
            cached_input=new_cached,
            output=base.output if self.output is None else self.output,
        )


@dataclass(frozen=True)
class NewTenant:
    """What ``create_tenant`` needs; limits and budget ``None`` mean unlimited."""

    name: str
    priority: int = DEFAULT_PRIORITY
    weight: float = DEFAULT_WEIGHT
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    monthly_budget_micro_usd: int | None = None
    request_timeout_s: float | None = None  # None: the server's maximum
    max_queued_requests: int | None = None  # None: the server's per-tenant limit
    pin_quota_bytes: int | None = None  # None: it may pin nothing
    price: PriceSpec = field(default_factory=PriceSpec)


@dataclass(frozen=True)
class TenantView:
    """A tenant with the price in force now (``None`` if it never had one)."""

    tenant: Tenant
    price: Price | None


# --- reads -----------------------------------------------------------------------------------


def tenant_not_found(tenant_id: str) -> NotFound:
    return NotFound(f"No tenant with id {tenant_id!r}.", code="tenant_not_found")


def live_tenant(session: Session, tenant_id: str, *, for_update: bool = False) -> Tenant:
    """The tenant ``tenant_id`` unless unknown or deleted (404 then)."""
    statement = select(Tenant).where(Tenant.id == tenant_id, Tenant.deleted_at.is_(None))
    if for_update:
        statement = statement.with_for_update()
    tenant = session.scalars(statement).first()
    if tenant is None:
        raise tenant_not_found(tenant_id)
    return tenant


def get_tenant(session: Session, tenant_id: str) -> TenantView:
    tenant = live_tenant(session, tenant_id)
    return TenantView(tenant, current_price(session, tenant.id))


def list_tenants(session: Session) -> list[TenantView]:
    """Live tenants, oldest first."""
    tenants = session.scalars(
        select(Tenant).where(Tenant.deleted_at.is_(None)).order_by(Tenant.created_at, Tenant.id)
    ).all()
    return [TenantView(tenant, current_price(session, tenant.id)) for tenant in tenants]


def tenant_names(session: Session, tenant_ids: Iterable[str]) -> dict[str, str]:
    """Tenant id -> name for the ids that exist (deleted tenants included)."""
    ids = sorted(set(tenant_ids))
    if not ids:
        return {}
    return dict(session.execute(select(Tenant.id, Tenant.name).where(Tenant.id.in_(ids))).all())


# --- writes ----------------------------------------------------------------------------------


def _name_taken(session: Session, name: str, *, other_than: str | None = None) -> bool:
    # Names stay reserved after a soft delete: the unique constraint covers every row.
    statement = select(Tenant.id).where(Tenant.name == name)
    if other_than is not None:
        statement = statement.where(Tenant.id != other_than)
    return session.scalars(statement.limit(1)).first() is not None


def _conflict(name: str) -> Conflict:
    return Conflict(
        f"A tenant named {name!r} already exists (names of deleted tenants stay reserved).",
        code="tenant_name_taken",
    )


@contextmanager
def _name_guard(session: Session, name: str) -> Iterator[None]:
    """Flushes inside are checked: losing a race for ``name`` at the database is a 409 too."""
    try:
        yield
    except IntegrityError:
        # This session's transaction is spoilt (its owner rolls it back): ask a fresh one
        # whether a competitor committed the name meanwhile.
        with Session(session.get_bind()) as fresh:
            taken = _name_taken(fresh, name)
        if taken:
            raise _conflict(name) from None
        raise


def _add_price(session: Session, tenant: Tenant, spec: PriceSpec, previous: Price | None) -> Price:
    effective_from = utc_now()
    if previous is not None and effective_from <= previous.effective_from:
        # (tenant_id, effective_from) is unique and the newest row must win: stay after it.
        effective_from = previous.effective_from + timedelta(microseconds=1)
    price = Price(
        tenant_id=tenant.id,
        input_micro_usd_per_mtok=spec.input,
        cached_input_micro_usd_per_mtok=spec.cached_input,
        output_micro_usd_per_mtok=spec.output,
        effective_from=effective_from,
    )
    session.add(price)
    return price


def create_tenant(session: Session, new: NewTenant) -> TenantView:
    """Add a tenant and its first price list (effective now); 409 if the name is taken."""
    if _name_taken(session, new.name):
        raise _conflict(new.name)
    tenant = Tenant(
        **{name: getattr(new, name) for name in SETTINGS_NAMED_ALIKE},
        monthly_budget_micro_usd=new.monthly_budget_micro_usd,
    )
    session.add(tenant)
    with _name_guard(session, new.name):
        session.flush()  # assigns the id the price row refers to
        price = _add_price(session, tenant, new.price, previous=None)
        session.flush()
    session.commit()
    return TenantView(tenant, price)


def update_tenant(
    session: Session,
    tenant_id: str,
    settings: Mapping[str, object],
    price: PriceChange | None = None,
) -> TenantView:
    """Set the given tenant columns (keys from ``TENANT_SETTINGS``) and, if ``price`` is
    given, start a new price list (a new ``Price`` row, effective now) from the current one.
    """
    unknown = set(settings) - TENANT_SETTINGS
    if unknown:
        raise ValueError(f"not tenant settings: {sorted(unknown)}")
    tenant = live_tenant(session, tenant_id, for_update=True)
    name = settings.get("name", tenant.name)
    if "name" in settings and _name_taken(session, str(name), other_than=tenant.id):
        raise _conflict(str(name))
    in_force = current_price(session, tenant.id)  # before the changes: no autoflush of them
    for column, value in settings.items():
        setattr(tenant, column, value)
    if price is not None:
        in_force = _add_price(session, tenant, price.applied_to(in_force), previous=in_force)
        tenant.updated_at = utc_now()  # a price change is a change of the tenant
    with _name_guard(session, str(name)):
        session.flush()
    session.commit()
    return TenantView(tenant, in_force)


def delete_tenant(session: Session, tenant_id: str) -> None:
    """Soft-delete the tenant (its usage history stays) and revoke all its API keys."""
    tenant = live_tenant(session, tenant_id, for_update=True)
    now = utc_now()
    tenant.deleted_at = now
    session.execute(
        update(ApiKey)
        .where(ApiKey.tenant_id == tenant.id, ApiKey.revoked_at.is_(None))
        .values(revoked_at=now)
    )
    session.commit()


# --- the engine ------------------------------------------------------------------------------


async def push_scheduling(engine: EngineClient, tenant: Tenant) -> None:
    """Tell the running engine the tenant's weight and priority (it knows tenants by id).

    The priority also moves the tenant's queued and running requests.
    """
    await engine.set_tenant_weight(tenant.id, tenant.weight)
    await engine.set_tenant_priority(tenant.id, tenant.priority)


async def push_all_scheduling(sessions: sessionmaker[Session], engine: EngineClient) -> int:
    """Tell a (re)started engine every live tenant's weight and priority; returns how many.

    The engine keeps these in memory only: without this a restart would run every tenant
    at the default share until an operator changed it again.
    """

    def live() -> list[Tenant]:
        with sessions() as session:
            return list(session.scalars(select(Tenant).where(Tenant.deleted_at.is_(None))))

    tenants = await asyncio.to_thread(live)
    for tenant in tenants:
        await push_scheduling(engine, tenant)
    return len(tenants)
