"""Sharing: ``adapter_grants``, one tenant's leave to call another's adapter.

Revision ID: 0010
Revises: 0009
Create Date: 2027-01-20

One row per (adapter, grantee); ``version`` NULL grants every version, a number that one
alone. Deleting the adapter or either tenant deletes its grants.

Written out in full (not imported from the models), like 0001-0009. Constraint names
follow the models' naming convention.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.String(length=32)


def upgrade() -> None:
    op.create_table(
        "adapter_grants",
        sa.Column("id", ID, nullable=False),
        sa.Column("adapter_id", ID, nullable=False),
        sa.Column("grantee_tenant_id", ID, nullable=False),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "version IS NULL OR version >= 1", name=op.f("ck_adapter_grants_version_positive")
        ),
        sa.ForeignKeyConstraint(
            ["adapter_id"],
            ["adapters.id"],
            name=op.f("fk_adapter_grants_adapter_id_adapters"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["grantee_tenant_id"],
            ["tenants.id"],
            name=op.f("fk_adapter_grants_grantee_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapter_grants")),
        sa.UniqueConstraint(
            "adapter_id",
            "grantee_tenant_id",
            name=op.f("uq_adapter_grants_adapter_id_grantee_tenant_id"),
        ),
    )
    op.create_index(
        op.f("ix_adapter_grants_grantee_tenant_id"), "adapter_grants", ["grantee_tenant_id"]
    )


def downgrade() -> None:
    # Dropping the table drops its index and constraints with it.
    op.drop_table("adapter_grants")
