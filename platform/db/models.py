"""The metadata schema: tenants, their prices and API keys, adapters and versions, usage, exports.

Conventions every table follows:

* primary keys are random UUID4s as 32 hex characters (``new_id``);
* timestamps are timezone-aware UTC (``UtcDateTime``);
* money is an integer number of micro-dollars (1 USD = 1_000_000), never a float;
* tenants and adapters are soft-deleted (``deleted_at``) so usage history keeps its rows;
* every constraint and index has a name from ``NAMING_CONVENTION``, so Alembic migrations
  are deterministic and can drop them by name.

The schema history lives in ``loramux.migrations``; a change here needs a new revision there
(``tests/platform/db/test_migrations.py`` fails while the two disagree).
"""

from __future__ import annotations

from datetime import date, datetime
from enum import StrEnum

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Date,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
    text,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, MappedColumn, mapped_column, relationship

from loramux.platform.db.types import UtcDateTime, new_id, utc_now

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

ID_LENGTH = 32
NAME_LENGTH = 200
END_USER_LENGTH = 256  # OpenAI's `user`: the tenant's own id for its end user
SHA256_HEX_LENGTH = 64
STORE_KEY_LENGTH = 1024
LEASE_OWNER_LENGTH = 200

DEFAULT_PRIORITY = 5
MIN_PRIORITY = 0
MAX_PRIORITY = 9
DEFAULT_WEIGHT = 1.0


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _id_column() -> MappedColumn[str]:
    return mapped_column(String(ID_LENGTH), primary_key=True, default=new_id)


def _created_at_column() -> MappedColumn[datetime]:
    return mapped_column(UtcDateTime(), default=utc_now)


def _updated_at_column() -> MappedColumn[datetime]:
    return mapped_column(UtcDateTime(), default=utc_now, onupdate=utc_now)


def _tenant_fk(ondelete: str | None) -> MappedColumn[str]:
    return mapped_column(String(ID_LENGTH), ForeignKey("tenants.id", ondelete=ondelete))


class Tenant(Base):
    """A customer. Scheduling knobs (priority, weight), limits and an optional budget.

    ``priority``: 0-9, higher is served first. ``weight``: share among tenants of one
    priority (> 0). Limits and budget are ``None`` when unlimited; the request deadline and
    queue limit are ``None`` when the server's apply.
    """

    __tablename__ = "tenants"
    __table_args__ = (
        CheckConstraint(
            f"priority >= {MIN_PRIORITY} AND priority <= {MAX_PRIORITY}", name="priority_range"
        ),
        CheckConstraint("weight > 0", name="weight_positive"),
        CheckConstraint(
            "requests_per_minute IS NULL OR requests_per_minute > 0",
            name="requests_per_minute_positive",
        ),
        CheckConstraint(
            "tokens_per_minute IS NULL OR tokens_per_minute > 0",
            name="tokens_per_minute_positive",
        ),
        CheckConstraint(
            "monthly_budget_micro_usd IS NULL OR monthly_budget_micro_usd >= 0",
            name="monthly_budget_non_negative",
        ),
        CheckConstraint(
            "request_timeout_s IS NULL OR request_timeout_s > 0", name="request_timeout_positive"
        ),
        CheckConstraint(
            "max_queued_requests IS NULL OR max_queued_requests > 0",
            name="max_queued_requests_positive",
        ),
        CheckConstraint(
            "pin_quota_bytes IS NULL OR pin_quota_bytes >= 0", name="pin_quota_non_negative"
        ),
    )

    id: Mapped[str] = _id_column()
    name: Mapped[str] = mapped_column(String(NAME_LENGTH), unique=True)
    priority: Mapped[int] = mapped_column(Integer, default=DEFAULT_PRIORITY)
    weight: Mapped[float] = mapped_column(Float, default=DEFAULT_WEIGHT)
    requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer)
    monthly_budget_micro_usd: Mapped[int | None] = mapped_column(BigInteger)
    # Deadline of its requests (seconds; None: the server's maximum) and its own queue
    # limit (None: the server's per-tenant one); see services/deadlines.py, load_shedding.py.
    request_timeout_s: Mapped[float | None] = mapped_column(Float)
    max_queued_requests: Mapped[int | None] = mapped_column(Integer)
    # Bytes of adapter weights the tenant may pin on the device (set by an operator);
    # None: none.
    pin_quota_bytes: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = _created_at_column()
    updated_at: Mapped[datetime] = _updated_at_column()
    deleted_at: Mapped[datetime | None] = mapped_column(UtcDateTime())


class Price(Base):
    """A tenant's price list from ``effective_from`` on, in micro-dollars per million tokens.

    The price in force at a moment is the row with the latest ``effective_from`` at or before
    it (``loramux.platform.db.pricing.current_price``). Rows are never edited: a new price is
    a new row.
    """

    __tablename__ = "prices"
    __table_args__ = (
        UniqueConstraint("tenant_id", "effective_from"),
        CheckConstraint("input_micro_usd_per_mtok >= 0", name="input_non_negative"),
        CheckConstraint("cached_input_micro_usd_per_mtok >= 0", name="cached_input_non_negative"),
        CheckConstraint("output_micro_usd_per_mtok >= 0", name="output_non_negative"),
    )

    id: Mapped[str] = _id_column()
    tenant_id: Mapped[str] = _tenant_fk(ondelete="CASCADE")
    input_micro_usd_per_mtok: Mapped[int] = mapped_column(BigInteger)
    cached_input_micro_usd_per_mtok: Mapped[int] = mapped_column(BigInteger)
    output_micro_usd_per_mtok: Mapped[int] = mapped_column(BigInteger)
    effective_from: Mapped[datetime] = mapped_column(UtcDateTime())
    created_at: Mapped[datetime] = _created_at_column()


class ApiKey(Base):
    """A tenant's API key, stored as the SHA-256 hex of the secret; never the secret itself.

    ``prefix`` is the first few characters of the secret, kept to tell keys apart in lists.
    A revoked key (``revoked_at`` set) no longer authenticates.
    """

    __tablename__ = "api_keys"

    id: Mapped[str] = _id_column()
    tenant_id: Mapped[str] = mapped_column(
        String(ID_LENGTH), ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(SHA256_HEX_LENGTH), unique=True)
    name: Mapped[str | None] = mapped_column(String(NAME_LENGTH))
    created_at: Mapped[datetime] = _created_at_column()
    last_used_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime())

    tenant: Mapped[Tenant] = relationship()


class Adapter(Base):
    """A tenant's named adapter; its uploads are ``AdapterVersion`` rows (1, 2, ...).

    Names are unique among a tenant's live (not soft-deleted) adapters; a deleted name can be
    used again, and different tenants may use the same name. ``alias_version`` is the
    version the bare name reaches, set by the tenant (a rollback); ``None``: the newest
    ready one.
    """

    __tablename__ = "adapters"
    __table_args__ = (
        Index(
            "uq_adapters_tenant_id_name_live",
            "tenant_id",
            "name",
            unique=True,
            postgresql_where=text("deleted_at IS NULL"),
            sqlite_where=text("deleted_at IS NULL"),
        ),
    )

    id: Mapped[str] = _id_column()
    tenant_id: Mapped[str] = _tenant_fk(ondelete="CASCADE")
    name: Mapped[str] = mapped_column(String(NAME_LENGTH))
    created_at: Mapped[datetime] = _created_at_column()
    deleted_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    alias_version: Mapped[int | None] = mapped_column(Integer)

    versions: Mapped[list[AdapterVersion]] = relationship(
        back_populates="adapter", order_by="AdapterVersion.version"
    )


class AdapterStatus(StrEnum):
    """Life of one upload: uploading → validating → ready, or failed (with a reason)."""

    UPLOADING = "uploading"
    VALIDATING = "validating"
    READY = "ready"
    FAILED = "failed"


_STATUS_VALUES = ", ".join(f"'{status.value}'" for status in AdapterStatus)


class AdapterVersion(Base):
    """One upload of an adapter: its files in the store, what validation found, its status.

    ``weights_store_key`` / ``config_store_key`` name ``adapter_model.safetensors`` and
    ``adapter_config.json`` in the adapter store; ``sha256`` / ``config_sha256`` are their
    digests. ``rank``, ``target_modules`` and ``size_bytes`` are filled in by validation.
    ``status`` holds an ``AdapterStatus`` value; a failed version carries ``failure_reason``.

    An unfinished version (uploading, validating) is held by a live owner: ``lease_owner``
    names it (the platform replica whose request works on it, the task queue, or the worker
    validating it) and it renews ``lease_expires_at`` while it works; a version whose lease
    ran out is swept (``loramux.platform.services.upload_cleanup``). Both are ``None`` once
    the version is ready or failed.
    """

    __tablename__ = "adapter_versions"
    __table_args__ = (
        UniqueConstraint("adapter_id", "version"),
        CheckConstraint(f"status IN ({_STATUS_VALUES})", name="status_known"),
        CheckConstraint(
            f"status <> '{AdapterStatus.FAILED.value}' OR failure_reason IS NOT NULL",
            name="failed_has_reason",
        ),
        CheckConstraint("version >= 1", name="version_positive"),
        CheckConstraint("rank IS NULL OR rank > 0", name="rank_positive"),
        CheckConstraint("size_bytes IS NULL OR size_bytes >= 0", name="size_non_negative"),
        CheckConstraint(
            "pinned_by IS NULL OR pinned_by IN ('tenant', 'operator')", name="pinned_by_known"
        ),
        # The sweep looks for the few unfinished versions among many finished ones.
        Index("ix_adapter_versions_status", "status"),
    )

    id: Mapped[str] = _id_column()
    adapter_id: Mapped[str] = mapped_column(
        String(ID_LENGTH), ForeignKey("adapters.id", ondelete="CASCADE")
    )
    version: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default=AdapterStatus.UPLOADING.value)
    failure_reason: Mapped[str | None] = mapped_column(Text)
    sha256: Mapped[str | None] = mapped_column(String(SHA256_HEX_LENGTH))
    config_sha256: Mapped[str | None] = mapped_column(String(SHA256_HEX_LENGTH))
    weights_store_key: Mapped[str | None] = mapped_column(String(STORE_KEY_LENGTH))
    config_store_key: Mapped[str | None] = mapped_column(String(STORE_KEY_LENGTH))
    rank: Mapped[int | None] = mapped_column(Integer)
    target_modules: Mapped[list[str] | None] = mapped_column(JSON)
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    base_model: Mapped[str] = mapped_column(String(NAME_LENGTH))
    lease_owner: Mapped[str | None] = mapped_column(String(LEASE_OWNER_LENGTH))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    # Pinned on the engines' devices (never evicted), by its tenant (counted against the
    # tenant's pin_quota_bytes) or by an operator; None: not pinned.
    pinned_by: Mapped[str | None] = mapped_column(String(16))
    created_at: Mapped[datetime] = _created_at_column()
    updated_at: Mapped[datetime] = _updated_at_column()

    adapter: Mapped[Adapter] = relationship(back_populates="versions")


class AdapterGrant(Base):
    """Leave for one tenant (the grantee) to call another's adapter, without its weights.

    ``version`` ``None``: every ready version, the bare ``owner/name`` reaching the one the
    owner's name reaches; a number: that version alone, which the bare name then reaches.
    Revoking deletes the row; what the grantee already ran stays in its usage records.
    """

    __tablename__ = "adapter_grants"
    __table_args__ = (
        UniqueConstraint("adapter_id", "grantee_tenant_id"),
        CheckConstraint("version IS NULL OR version >= 1", name="version_positive"),
        # /v1/models and every call by a grantee look its grants up by grantee.
        Index("ix_adapter_grants_grantee_tenant_id", "grantee_tenant_id"),
    )

    id: Mapped[str] = _id_column()
    adapter_id: Mapped[str] = mapped_column(
        String(ID_LENGTH), ForeignKey("adapters.id", ondelete="CASCADE")
    )
    grantee_tenant_id: Mapped[str] = _tenant_fk(ondelete="CASCADE")
    version: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = _created_at_column()
    updated_at: Mapped[datetime] = _updated_at_column()


class UsageRecord(Base):
    """What one request used and cost: exactly one row per request id (the idempotency key).

    Written once a request delivered tokens (``loramux.platform.db.usage``). While a
    streamed request runs, the usage journal checkpoints it as a *provisional* row
    (``final`` false: what it delivered so far, priced as of that write); the request's end
    makes it final with its real numbers, and a final row never changes again. A
    provisional row left behind by a crash is its request's usage as last checkpointed,
    counted and billed like any other. ``created_at`` is the moment of the row's latest
    write. ``cached_prompt_tokens`` is the part of ``prompt_tokens`` served from the prefix
    cache. The adapter columns are ``None`` for requests to the base model. ``end_user`` is
    the id the request named its end user by (OpenAI's ``user``), ``None`` when it sent none.
    """

    __tablename__ = "usage_records"
    __table_args__ = (
        Index("ix_usage_records_tenant_id_created_at", "tenant_id", "created_at"),
        CheckConstraint("prompt_tokens >= 0", name="prompt_tokens_non_negative"),
        CheckConstraint(
            "cached_prompt_tokens >= 0 AND cached_prompt_tokens <= prompt_tokens",
            name="cached_prompt_tokens_range",
        ),
        CheckConstraint("completion_tokens >= 0", name="completion_tokens_non_negative"),
        CheckConstraint("latency_ms >= 0", name="latency_non_negative"),
        CheckConstraint("cost_micro_usd >= 0", name="cost_non_negative"),
    )

    id: Mapped[str] = _id_column()
    request_id: Mapped[str] = mapped_column(String(128), unique=True)
    tenant_id: Mapped[str] = _tenant_fk(ondelete=None)
    adapter_id: Mapped[str | None] = mapped_column(
        String(ID_LENGTH), ForeignKey("adapters.id", ondelete="SET NULL")
    )
    adapter_version_id: Mapped[str | None] = mapped_column(
        String(ID_LENGTH), ForeignKey("adapter_versions.id", ondelete="SET NULL")
    )
    model: Mapped[str] = mapped_column(String(NAME_LENGTH))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    cached_prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    latency_ms: Mapped[int] = mapped_column(Integer)
    cost_micro_usd: Mapped[int] = mapped_column(BigInteger)
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utc_now, index=True)
    final: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    end_user: Mapped[str | None] = mapped_column(String(END_USER_LENGTH))


class UsageDaily(Base):
    """One closed UTC day of usage per (day, tenant, adapter, model): the monthly roll-up.

    ``loramux.platform.services.rollups`` computes these rows from ``usage_records`` only for
    *closed* days (a few minutes past the day's end, when no record of the day can still be
    committed), so a row is final: reading it instead of the day's raw records (the monthly
    budget does) gives the same sums at a fraction of the cost. ``adapter_id`` is ``None``
    for the base model. A day without usage has no rows. ``computed_at`` is when the day was
    rolled up.
    """

    __tablename__ = "usage_daily"
    __table_args__ = (
        Index("ix_usage_daily_tenant_id_day", "tenant_id", "day"),
        CheckConstraint("requests > 0", name="requests_positive"),
        CheckConstraint("prompt_tokens >= 0", name="prompt_tokens_non_negative"),
        CheckConstraint(
            "cached_prompt_tokens >= 0 AND cached_prompt_tokens <= prompt_tokens",
            name="cached_prompt_tokens_range",
        ),
        CheckConstraint("completion_tokens >= 0", name="completion_tokens_non_negative"),
        CheckConstraint("cost_micro_usd >= 0", name="cost_non_negative"),
    )

    id: Mapped[str] = _id_column()
    day: Mapped[date] = mapped_column(Date, index=True)  # rolled up and replaced by day
    tenant_id: Mapped[str] = _tenant_fk(ondelete=None)
    adapter_id: Mapped[str | None] = mapped_column(
        String(ID_LENGTH), ForeignKey("adapters.id", ondelete="SET NULL")
    )
    model: Mapped[str] = mapped_column(String(NAME_LENGTH))
    # Sums over a day can pass 2**31 where one record cannot: BIGINT throughout.
    requests: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    cost_micro_usd: Mapped[int] = mapped_column(BigInteger)
    computed_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utc_now)


class BillingExport(Base):
    """One stored billing export: the usage CSV of every tenant over ``[period_start, period_end)``.

    The CSV (``loramux.platform.services.billing.to_csv``) lies in the object store under
    ``store_key`` (a readable name, ``billing/<period>.by-<group_by>[.v<version>].csv``; a
    content address for exports made before names); ``sha256`` and ``size_bytes`` describe
    it (reads are verified against ``sha256``) and ``rows`` counts its data lines.

    A period and grouping may have several *versions* (1, 2, ...): an export of a period
    that is not closed yet is ``provisional`` (its usage may still grow), and exporting the
    period again once it is closed makes a new, final version, never overwriting the old
    one. At most one version per period and grouping is final, and exporting that period
    again returns it (see ``loramux.platform.services.billing_exports``).
    """

    __tablename__ = "billing_exports"
    __table_args__ = (
        UniqueConstraint("period_start", "period_end", "group_by", "version"),
        Index(
            "uq_billing_exports_final",
            "period_start",
            "period_end",
            "group_by",
            unique=True,
            postgresql_where=text("NOT provisional"),
            sqlite_where=text("NOT provisional"),
        ),
        CheckConstraint("period_start < period_end", name="period_ordered"),
        CheckConstraint("format IN ('csv')", name="format_known"),
        CheckConstraint("size_bytes >= 0", name="size_non_negative"),
        CheckConstraint("rows >= 0", name="rows_non_negative"),
        CheckConstraint("version >= 1", name="version_positive"),
    )

    id: Mapped[str] = _id_column()
    period_start: Mapped[datetime] = mapped_column(UtcDateTime())
    period_end: Mapped[datetime] = mapped_column(UtcDateTime())
    group_by: Mapped[str] = mapped_column(String(16))
    version: Mapped[int] = mapped_column(Integer, default=1, server_default=text("1"))
    provisional: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    format: Mapped[str] = mapped_column(String(8), default="csv")
    store_key: Mapped[str] = mapped_column(String(STORE_KEY_LENGTH))
    sha256: Mapped[str] = mapped_column(String(SHA256_HEX_LENGTH))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    rows: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = _created_at_column()


__all__ = [
    "NAMING_CONVENTION",
    "Adapter",
    "AdapterStatus",
    "AdapterVersion",
    "ApiKey",
    "Base",
    "BillingExport",
    "Price",
    "Tenant",
    "UsageDaily",
    "UsageRecord",
]
