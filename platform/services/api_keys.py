"""Tenants' API keys: issue (the secret is returned once), list, revoke.

Only ``api_key_hash(secret)`` (SHA-256 hex) and a short display prefix are stored; the
secret itself never reaches the database. Requests authenticate with the same hash, which
refuses revoked keys and deleted tenants.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from loramux.platform.db.models import ApiKey
from loramux.platform.db.types import utc_now
from loramux.platform.errors import NotFound
from loramux.platform.services.tenants import live_tenant

KEY_PREFIX = "lmx-"
KEY_RANDOM_BYTES = 32  # token_urlsafe(32): 256 random bits, 43 characters
DISPLAY_PREFIX_LENGTH = 12  # "lmx-" and 8 random characters: enough to tell keys apart


def api_key_hash(key: str) -> str:
    """Keys are stored only as their sha256 (they are random, so no salt is needed)."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class IssuedKey:
    """A new key's row and its secret; the secret cannot be recovered later."""

    row: ApiKey
    secret: str


def generate_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(KEY_RANDOM_BYTES)


def issue_api_key(session: Session, tenant_id: str, name: str | None = None) -> IssuedKey:
    """A new key for the live tenant ``tenant_id`` (404 otherwise)."""
    tenant = live_tenant(session, tenant_id)
    secret = generate_secret()
    row = ApiKey(
        tenant_id=tenant.id,
        prefix=secret[:DISPLAY_PREFIX_LENGTH],
        key_hash=api_key_hash(secret),
        name=name,
    )
    session.add(row)
    session.commit()
    return IssuedKey(row, secret)


def list_api_keys(session: Session, tenant_id: str) -> list[ApiKey]:
    """All keys of the live tenant ``tenant_id``, revoked ones included, oldest first."""
    tenant = live_tenant(session, tenant_id)
    statement = (
        select(ApiKey).where(ApiKey.tenant_id == tenant.id).order_by(ApiKey.created_at, ApiKey.id)
    )
    return list(session.scalars(statement).all())


def revoke_api_key(session: Session, key_id: str) -> None:
    """Revoke key ``key_id`` (404 if unknown). Revoking twice keeps the first time."""
    row = session.get(ApiKey, key_id)
    if row is None:
        raise NotFound(f"No API key with id {key_id!r}.", code="api_key_not_found")
    if row.revoked_at is None:
        row.revoked_at = utc_now()
    session.commit()
