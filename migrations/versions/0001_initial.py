"""Initial schema: tenants, prices, API keys, adapters and their versions, usage records.

Revision ID: 0001
Revises:
Create Date: 2026-11-21

Written out in full (not imported from the models) so it stays what it was when later
revisions change the models. Constraint names follow the models' naming convention.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.String(length=32)
NAME = sa.String(length=200)
SHA256_HEX = sa.String(length=64)
STORE_KEY = sa.String(length=1024)
LIVE_ADAPTER = sa.text("deleted_at IS NULL")


def _timestamp(name: str, *, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _id() -> sa.Column:
    return sa.Column("id", ID, nullable=False)


def _create_tenants() -> None:
    op.create_table(
        "tenants",
        _id(),
        sa.Column("name", NAME, nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("requests_per_minute", sa.Integer(), nullable=True),
        sa.Column("tokens_per_minute", sa.Integer(), nullable=True),
        sa.Column("monthly_budget_micro_usd", sa.BigInteger(), nullable=True),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        _timestamp("deleted_at", nullable=True),
        sa.CheckConstraint(
            "priority >= 0 AND priority <= 9", name=op.f("ck_tenants_priority_range")
        ),
        sa.CheckConstraint("weight > 0", name=op.f("ck_tenants_weight_positive")),
        sa.CheckConstraint(
            "requests_per_minute IS NULL OR requests_per_minute > 0",
            name=op.f("ck_tenants_requests_per_minute_positive"),
        ),
        sa.CheckConstraint(
            "tokens_per_minute IS NULL OR tokens_per_minute > 0",
            name=op.f("ck_tenants_tokens_per_minute_positive"),
        ),
        sa.CheckConstraint(
            "monthly_budget_micro_usd IS NULL OR monthly_budget_micro_usd >= 0",
            name=op.f("ck_tenants_monthly_budget_non_negative"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )


def _create_prices() -> None:
    op.create_table(
        "prices",
        _id(),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("input_micro_usd_per_mtok", sa.BigInteger(), nullable=False),
        sa.Column("cached_input_micro_usd_per_mtok", sa.BigInteger(), nullable=False),
        sa.Column("output_micro_usd_per_mtok", sa.BigInteger(), nullable=False),
        _timestamp("effective_from"),
        _timestamp("created_at"),
        sa.CheckConstraint(
            "input_micro_usd_per_mtok >= 0", name=op.f("ck_prices_input_non_negative")
        ),
        sa.CheckConstraint(
            "cached_input_micro_usd_per_mtok >= 0",
            name=op.f("ck_prices_cached_input_non_negative"),
        ),
        sa.CheckConstraint(
            "output_micro_usd_per_mtok >= 0", name=op.f("ck_prices_output_non_negative")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_prices_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_prices")),
        sa.UniqueConstraint(
            "tenant_id", "effective_from", name=op.f("uq_prices_tenant_id_effective_from")
        ),
    )


def _create_api_keys() -> None:
    op.create_table(
        "api_keys",
        _id(),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("key_hash", SHA256_HEX, nullable=False),
        sa.Column("name", NAME, nullable=True),
        _timestamp("created_at"),
        _timestamp("last_used_at", nullable=True),
        _timestamp("revoked_at", nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_api_keys_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"])


def _create_adapters() -> None:
    op.create_table(
        "adapters",
        _id(),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("name", NAME, nullable=False),
        _timestamp("created_at"),
        _timestamp("deleted_at", nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_adapters_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapters")),
    )
    op.create_index(
        op.f("uq_adapters_tenant_id_name_live"),
        "adapters",
        ["tenant_id", "name"],
        unique=True,
        postgresql_where=LIVE_ADAPTER,
        sqlite_where=LIVE_ADAPTER,
    )


def _create_adapter_versions() -> None:
    op.create_table(
        "adapter_versions",
        _id(),
        sa.Column("adapter_id", ID, nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("failure_reason", sa.Text(), nullable=True),
        sa.Column("sha256", SHA256_HEX, nullable=True),
        sa.Column("config_sha256", SHA256_HEX, nullable=True),
        sa.Column("weights_store_key", STORE_KEY, nullable=True),
        sa.Column("config_store_key", STORE_KEY, nullable=True),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("target_modules", sa.JSON(), nullable=True),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("base_model", NAME, nullable=False),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        sa.CheckConstraint(
            "status IN ('uploading', 'validating', 'ready', 'failed')",
            name=op.f("ck_adapter_versions_status_known"),
        ),
        sa.CheckConstraint(
            "status <> 'failed' OR failure_reason IS NOT NULL",
            name=op.f("ck_adapter_versions_failed_has_reason"),
        ),
        sa.CheckConstraint("version >= 1", name=op.f("ck_adapter_versions_version_positive")),
        sa.CheckConstraint(
            "rank IS NULL OR rank > 0", name=op.f("ck_adapter_versions_rank_positive")
        ),
        sa.CheckConstraint(
            "size_bytes IS NULL OR size_bytes >= 0",
            name=op.f("ck_adapter_versions_size_non_negative"),
        ),
        sa.ForeignKeyConstraint(
            ["adapter_id"],
            ["adapters.id"],
            name=op.f("fk_adapter_versions_adapter_id_adapters"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapter_versions")),
        sa.UniqueConstraint(
            "adapter_id", "version", name=op.f("uq_adapter_versions_adapter_id_version")
        ),
    )


def _create_usage_records() -> None:
    op.create_table(
        "usage_records",
        _id(),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("adapter_id", ID, nullable=True),
        sa.Column("adapter_version_id", ID, nullable=True),
        sa.Column("model", NAME, nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("latency_ms", sa.Integer(), nullable=False),
        sa.Column("cost_micro_usd", sa.BigInteger(), nullable=False),
        sa.Column("finish_reason", sa.String(length=32), nullable=True),
        _timestamp("created_at"),
        sa.CheckConstraint(
            "prompt_tokens >= 0", name=op.f("ck_usage_records_prompt_tokens_non_negative")
        ),
        sa.CheckConstraint(
            "cached_prompt_tokens >= 0 AND cached_prompt_tokens <= prompt_tokens",
            name=op.f("ck_usage_records_cached_prompt_tokens_range"),
        ),
        sa.CheckConstraint(
            "completion_tokens >= 0",
            name=op.f("ck_usage_records_completion_tokens_non_negative"),
        ),
        sa.CheckConstraint("latency_ms >= 0", name=op.f("ck_usage_records_latency_non_negative")),
        sa.CheckConstraint("cost_micro_usd >= 0", name=op.f("ck_usage_records_cost_non_negative")),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_usage_records_tenant_id_tenants")
        ),
        sa.ForeignKeyConstraint(
            ["adapter_id"],
            ["adapters.id"],
            name=op.f("fk_usage_records_adapter_id_adapters"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["adapter_version_id"],
            ["adapter_versions.id"],
            name=op.f("fk_usage_records_adapter_version_id_adapter_versions"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_records")),
        sa.UniqueConstraint("request_id", name=op.f("uq_usage_records_request_id")),
    )
    op.create_index(op.f("ix_usage_records_created_at"), "usage_records", ["created_at"])
    op.create_index(
        op.f("ix_usage_records_tenant_id_created_at"),
        "usage_records",
        ["tenant_id", "created_at"],
    )


def upgrade() -> None:
    _create_tenants()
    _create_prices()
    _create_api_keys()
    _create_adapters()
    _create_adapter_versions()
    _create_usage_records()


def downgrade() -> None:
    # Children before parents; dropping a table drops its indexes and constraints with it.
    for table in (
        "usage_records",
        "adapter_versions",
        "adapters",
        "api_keys",
        "prices",
        "tenants",
    ):
        op.drop_table(table)
