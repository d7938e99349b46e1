"""Build rows for the db tests with sensible defaults; keyword arguments override them."""

from __future__ import annotations

import hashlib
import uuid
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from loramux.platform.db.models import (
    Adapter,
    AdapterVersion,
    ApiKey,
    Price,
    Tenant,
    UsageRecord,
)
from loramux.platform.db.types import utc_now


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def add_tenant(session: Session, **fields: Any) -> Tenant:
    tenant = Tenant(**{"name": _unique("tenant"), **fields})
    session.add(tenant)
    session.flush()
    return tenant


def add_api_key(session: Session, tenant: Tenant, secret: str | None = None, **fields) -> ApiKey:
    secret = secret or _unique("lmx")
    key = ApiKey(
        tenant_id=tenant.id,
        prefix=secret[:8],
        key_hash=hashlib.sha256(secret.encode()).hexdigest(),
        **fields,
    )
    session.add(key)
    session.flush()
    return key


def add_adapter(session: Session, tenant: Tenant, name: str | None = None, **fields) -> Adapter:
    adapter = Adapter(tenant_id=tenant.id, name=name or _unique("adapter"), **fields)
    session.add(adapter)
    session.flush()
    return adapter


def add_adapter_version(
    session: Session, adapter: Adapter, version: int = 1, **fields: Any
) -> AdapterVersion:
    row = AdapterVersion(
        **{"adapter_id": adapter.id, "version": version, "base_model": "base", **fields}
    )
    session.add(row)
    session.flush()
    return row


def add_price(
    session: Session,
    tenant: Tenant,
    effective_from: datetime,
    input_per_mtok: int = 1_000_000,
    cached_input_per_mtok: int = 500_000,
    output_per_mtok: int = 2_000_000,
) -> Price:
    price = Price(
        tenant_id=tenant.id,
        input_micro_usd_per_mtok=input_per_mtok,
        cached_input_micro_usd_per_mtok=cached_input_per_mtok,
        output_micro_usd_per_mtok=output_per_mtok,
        effective_from=effective_from,
    )
    session.add(price)
    session.flush()
    return price


def usage_record(tenant: Tenant, request_id: str | None = None, **fields: Any) -> UsageRecord:
    """An unsaved usage record (add it, or pass it to ``record_usage``)."""
    values: dict[str, Any] = {
        "request_id": request_id or _unique("req"),
        "tenant_id": tenant.id,
        "model": "base",
        "prompt_tokens": 10,
        "cached_prompt_tokens": 0,
        "completion_tokens": 5,
        "latency_ms": 12,
        "cost_micro_usd": 30,
        "created_at": utc_now(),
        **fields,
    }
    return UsageRecord(**values)
