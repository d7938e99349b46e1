"""Billing exports: one stored usage CSV per period and grouping.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-28

Written out in full (not imported from the models), like 0001. Constraint names follow the
models' naming convention.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _timestamp(name: str) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=False)


def upgrade() -> None:
    op.create_table(
        "billing_exports",
        sa.Column("id", sa.String(length=32), nullable=False),
        _timestamp("period_start"),
        _timestamp("period_end"),
        sa.Column("group_by", sa.String(length=16), nullable=False),
        sa.Column("format", sa.String(length=8), nullable=False),
        sa.Column("store_key", sa.String(length=1024), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("rows", sa.Integer(), nullable=False),
        _timestamp("created_at"),
        sa.CheckConstraint(
            "period_start < period_end", name=op.f("ck_billing_exports_period_ordered")
        ),
        sa.CheckConstraint("format IN ('csv')", name=op.f("ck_billing_exports_format_known")),
        sa.CheckConstraint("size_bytes >= 0", name=op.f("ck_billing_exports_size_non_negative")),
        sa.CheckConstraint("rows >= 0", name=op.f("ck_billing_exports_rows_non_negative")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_billing_exports")),
        sa.UniqueConstraint(
            "period_start",
            "period_end",
            "group_by",
            name=op.f("uq_billing_exports_period_start_period_end_group_by"),
        ),
    )


def downgrade() -> None:
    op.drop_table("billing_exports")
