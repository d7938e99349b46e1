"""Tenant deadlines and queue limits.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-27

``tenants.request_timeout_s`` (the default deadline of the tenant's requests, seconds) and
``tenants.max_queued_requests`` (the tenant's own queue limit), both nullable: existing
tenants get the server's settings, as before. Each column carries its own CHECK (> 0), which
plain ALTER TABLE ADD COLUMN can add on SQLite too, so no batch copy and --sql works.

Written out in full (not imported from the models), like 0001-0006.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "tenants",
        sa.Column(
            "request_timeout_s",
            sa.Float(),
            sa.CheckConstraint(
                "request_timeout_s IS NULL OR request_timeout_s > 0",
                name=op.f("ck_tenants_request_timeout_positive"),
            ),
            nullable=True,
        ),
    )
    op.add_column(
        "tenants",
        sa.Column(
            "max_queued_requests",
            sa.Integer(),
            sa.CheckConstraint(
                "max_queued_requests IS NULL OR max_queued_requests > 0",
                name=op.f("ck_tenants_max_queued_requests_positive"),
            ),
            nullable=True,
        ),
    )


def downgrade() -> None:
    # Plain DROP COLUMN (SQLite 3.35+ drops a column with its own CHECK); a batch copy would
    # carry the reflected CHECKs of the dropped columns into the new table.
    op.drop_column("tenants", "max_queued_requests")
    op.drop_column("tenants", "request_timeout_s")
