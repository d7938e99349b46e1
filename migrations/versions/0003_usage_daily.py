"""Daily usage roll-ups: one row per closed UTC day, tenant, adapter and model.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-05

Written out in full (not imported from the models), like 0001 and 0002. Constraint names
follow the models' naming convention.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.String(length=32)


def _count(name: str) -> sa.Column:
    return sa.Column(name, sa.BigInteger(), nullable=False)


def upgrade() -> None:
    op.create_table(
        "usage_daily",
        sa.Column("id", ID, nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("adapter_id", ID, nullable=True),
        sa.Column("model", sa.String(length=200), nullable=False),
        _count("requests"),
        _count("prompt_tokens"),
        _count("cached_prompt_tokens"),
        _count("completion_tokens"),
        _count("cost_micro_usd"),
        sa.Column("computed_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("requests > 0", name=op.f("ck_usage_daily_requests_positive")),
        sa.CheckConstraint(
            "prompt_tokens >= 0", name=op.f("ck_usage_daily_prompt_tokens_non_negative")
        ),
        sa.CheckConstraint(
            "cached_prompt_tokens >= 0 AND cached_prompt_tokens <= prompt_tokens",
            name=op.f("ck_usage_daily_cached_prompt_tokens_range"),
        ),
        sa.CheckConstraint(
            "completion_tokens >= 0", name=op.f("ck_usage_daily_completion_tokens_non_negative")
        ),
        sa.CheckConstraint("cost_micro_usd >= 0", name=op.f("ck_usage_daily_cost_non_negative")),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_usage_daily_tenant_id_tenants")
        ),
        sa.ForeignKeyConstraint(
            ["adapter_id"],
            ["adapters.id"],
            name=op.f("fk_usage_daily_adapter_id_adapters"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_daily")),
    )
    op.create_index(op.f("ix_usage_daily_day"), "usage_daily", ["day"])
    op.create_index(op.f("ix_usage_daily_tenant_id_day"), "usage_daily", ["tenant_id", "day"])


def downgrade() -> None:
    # Dropping the table drops its indexes and constraints with it.
    op.drop_table("usage_daily")
