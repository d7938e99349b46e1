"""Request and response bodies of the operator API (``/admin``), apart from the ORM models.

Money is dollars (floats) here and integer micro-dollars everywhere behind it; a dollar
amount with more than 6 decimal places, a negative one or a non-finite one is refused
(422 naming the field). Request bodies refuse unknown fields and take JSON types as they
are (``"5"`` is not a priority).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
)
from pydantic.json_schema import SkipJsonSchema

from loramux.platform.api.admin.fields import (
    Name,
    PerMinute,
    PinQuota,
    Priority,
    QueueLimit,
    TimeoutSeconds,
    Usd,
    Weight,
    micro,
    usd,
)
from loramux.platform.api.tenant.adapter_schemas import AdapterOut
from loramux.platform.db.models import (
    DEFAULT_PRIORITY,
    DEFAULT_WEIGHT,
)
from loramux.platform.services.adapters import TenantAdapterView
from loramux.platform.services.api_keys import IssuedKey
from loramux.platform.services.tenants import (
    SCHEDULING_SETTINGS,
    SETTINGS_NAMED_ALIKE,
    NewTenant,
    PriceChange,
    TenantView,
    usd_to_micro_usd,
)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# --- tenants ---------------------------------------------------------------------------------


class TenantCreate(_Request):
    """``POST /admin/tenants``. Unset limits and budget mean unlimited; unset prices are 0
    and the cached-input price defaults to the input price."""

    name: Name
    priority: Priority = DEFAULT_PRIORITY
    weight: Weight = DEFAULT_WEIGHT
    requests_per_minute: PerMinute | None = None
    tokens_per_minute: PerMinute | None = None
    monthly_budget_usd: Usd | None = None
    request_timeout_s: TimeoutSeconds | None = None
    max_queued_requests: QueueLimit | None = None
    pin_quota_bytes: PinQuota | None = None
    input_price_per_mtok: Usd = 0.0
    cached_input_price_per_mtok: Usd | None = None
    output_price_per_mtok: Usd = 0.0

    def to_new_tenant(self) -> NewTenant:
        # Every part given (input always is), so nothing comes from the empty price list;
        # PriceChange applies the rule that the cached-input price follows the input price.
        price = PriceChange(
            input=usd_to_micro_usd(self.input_price_per_mtok),
            cached_input=micro(self.cached_input_price_per_mtok),
            output=usd_to_micro_usd(self.output_price_per_mtok),
        ).applied_to(None)
        return NewTenant(
            **self.model_dump(include=set(SETTINGS_NAMED_ALIKE)),
            monthly_budget_micro_usd=micro(self.monthly_budget_usd),
            price=price,
        )


def _not_sent() -> Any:
    """A field's default when the request leaves it out, kept out of the JSON schema."""
    return Field(None, json_schema_extra=lambda schema: schema.pop("default", None))


_NOT_NULLABLE = (
    "name",
    "priority",
    "weight",
    "input_price_per_mtok",
    "cached_input_price_per_mtok",
    "output_price_per_mtok",
)
_PRICE_FIELDS = {
    "input_price_per_mtok": "input",
    "cached_input_price_per_mtok": "cached_input",
    "output_price_per_mtok": "output",
}


class TenantUpdate(_Request):
    """``PATCH /admin/tenants/{id}``: any subset of the fields. ``null`` clears a limit or
    the budget (unlimited), or the deadline or queue limit (the server's apply); a price field starts a new price list, effective now, and an
    input price given without a cached-input price sets both."""

    # ``null`` is refused (``_not_null``) for all but the limits and the budget, so
    # /openapi.json offers neither it nor the default ``None`` (a field not sent) for them.
    name: Name | SkipJsonSchema[None] = _not_sent()
    priority: Priority | SkipJsonSchema[None] = _not_sent()
    weight: Weight | SkipJsonSchema[None] = _not_sent()
    requests_per_minute: PerMinute | None = None
    tokens_per_minute: PerMinute | None = None
    monthly_budget_usd: Usd | None = None
    request_timeout_s: TimeoutSeconds | None = None
    max_queued_requests: QueueLimit | None = None
    pin_quota_bytes: PinQuota | None = None
    input_price_per_mtok: Usd | SkipJsonSchema[None] = _not_sent()
    cached_input_price_per_mtok: Usd | SkipJsonSchema[None] = _not_sent()
    output_price_per_mtok: Usd | SkipJsonSchema[None] = _not_sent()

    @field_validator(*_NOT_NULLABLE)
    @classmethod
    def _not_null(cls, value: Any) -> Any:
        if value is None:
            raise ValueError("may not be null")
        return value

    def tenant_settings(self) -> dict[str, object]:
        """The tenant columns to set (only fields the request carried)."""
        sent = self.model_fields_set
        settings: dict[str, object] = {
            name: getattr(self, name) for name in SETTINGS_NAMED_ALIKE if name in sent
        }
        if "monthly_budget_usd" in sent:
            settings["monthly_budget_micro_usd"] = micro(self.monthly_budget_usd)
        return settings

    def price_change(self) -> PriceChange | None:
        changes = {
            part: micro(getattr(self, name))
            for name, part in _PRICE_FIELDS.items()
            if name in self.model_fields_set
        }
        return PriceChange(**changes) if changes else None

    def changes_scheduling(self) -> bool:
        return bool(self.model_fields_set & SCHEDULING_SETTINGS)


class TenantOut(BaseModel):
    """A tenant as the operator sees it; prices are the ones in force now (USD per million
    tokens, ``null`` only for a tenant that never had a price)."""

    id: str
    name: str
    priority: int
    weight: float
    requests_per_minute: int | None
    tokens_per_minute: int | None
    monthly_budget_usd: float | None
    request_timeout_s: float | None  # null: the server's maximum applies
    max_queued_requests: int | None  # null: the server's per-tenant limit applies
    pin_quota_bytes: int | None  # null: it may pin no adapter on the device
    input_price_per_mtok: float | None
    cached_input_price_per_mtok: float | None
    output_price_per_mtok: float | None
    created_at: datetime
    updated_at: datetime

    @classmethod
    def from_view(cls, view: TenantView) -> TenantOut:
        tenant, price = view.tenant, view.price
        copied = ("id", *SETTINGS_NAMED_ALIKE, "created_at", "updated_at")
        return cls(
            **{name: getattr(tenant, name) for name in copied},
            monthly_budget_usd=usd(tenant.monthly_budget_micro_usd),
            input_price_per_mtok=usd(price and price.input_micro_usd_per_mtok),
            cached_input_price_per_mtok=usd(price and price.cached_input_micro_usd_per_mtok),
            output_price_per_mtok=usd(price and price.output_micro_usd_per_mtok),
        )


# --- API keys --------------------------------------------------------------------------------


class ApiKeyCreate(_Request):
    """``POST /admin/tenants/{id}/api-keys`` (the body is optional)."""

    name: Name | None = None


class ApiKeyCreated(BaseModel):
    """A new key. ``key`` is shown this once: only its hash is stored."""

    id: str
    key: str
    prefix: str
    name: str | None
    created_at: datetime

    @classmethod
    def from_issued(cls, issued: IssuedKey) -> ApiKeyCreated:
        row = issued.row
        return cls(
            id=row.id,
            key=issued.secret,
            prefix=row.prefix,
            name=row.name,
            created_at=row.created_at,
        )


class ApiKeyOut(BaseModel):
    """A key in a list: never the secret nor its hash."""

    model_config = ConfigDict(from_attributes=True)

    id: str
    prefix: str
    name: str | None
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None


# --- every tenant's adapters -----------------------------------------------------------------


class AdminAdapterOut(AdapterOut):
    """An adapter with its owner (``GET /admin/adapters``)."""

    tenant_id: str
    tenant_name: str

    @classmethod
    def from_tenant_view(cls, owned: TenantAdapterView) -> AdminAdapterOut:
        base = AdapterOut.from_view(owned.view).model_dump()
        return cls(**base, tenant_id=owned.tenant.id, tenant_name=owned.tenant.name)


class AdminAdapterList(BaseModel):
    object: str = "list"
    data: list[AdminAdapterOut]
