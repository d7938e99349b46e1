"""Pinning: ``adapter_versions.pinned_by`` and ``tenants.pin_quota_bytes``.

Revision ID: 0011
Revises: 0010
Create Date: 2027-01-24

A version pinned on the engines' devices says who pinned it (``tenant`` or ``operator``;
NULL: not pinned); a tenant may pin up to ``pin_quota_bytes`` of adapter weights (NULL:
none, every existing tenant's). Each column carries its own CHECK, which plain ALTER TABLE
ADD COLUMN can add on SQLite too, so no batch copy and --sql works.

Written out in full (not imported from the models), like 0001-0010.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "adapter_versions",
        sa.Column(
            "pinned_by",
            sa.String(length=16),
            sa.CheckConstraint(
                "pinned_by IS NULL OR pinned_by IN ('tenant', 'operator')",
                name=op.f("ck_adapter_versions_pinned_by_known"),
            ),
            nullable=True,
        ),
    )
    op.add_column(
        "tenants",
        sa.Column(
            "pin_quota_bytes",
            sa.BigInteger(),
            sa.CheckConstraint(
                "pin_quota_bytes IS NULL OR pin_quota_bytes >= 0",
                name=op.f("ck_tenants_pin_quota_non_negative"),
            ),
            nullable=True,
        ),
    )


def downgrade() -> None:
    # Plain DROP COLUMN (SQLite 3.35+ drops a column with its own CHECK).
    op.drop_column("tenants", "pin_quota_bytes")
    op.drop_column("adapter_versions", "pinned_by")
