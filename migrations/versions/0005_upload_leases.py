"""Upload leases: who keeps an unfinished adapter version alive, and until when.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-14

``adapter_versions.lease_owner`` and ``lease_expires_at`` (both nullable): an uploading or
validating version is held by a live owner that renews its lease; the platform sweeps the
versions whose lease ran out. Existing rows get no lease: finished ones need none, and an
unfinished one without a lease falls under the rule before leases (swept once it has not
changed for an hour). ``ix_adapter_versions_status`` lets the sweep find the few unfinished
versions quickly.

Written out in full (not imported from the models), like 0001-0004.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ALTER TABLE ADD COLUMN (SQLite has it): no batch copy, so --sql mode works too.
    op.add_column("adapter_versions", sa.Column("lease_owner", sa.String(200), nullable=True))
    op.add_column(
        "adapter_versions",
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index(op.f("ix_adapter_versions_status"), "adapter_versions", ["status"])


def downgrade() -> None:
    with op.batch_alter_table("adapter_versions") as batch:
        batch.drop_index(op.f("ix_adapter_versions_status"))
        batch.drop_column("lease_expires_at")
        batch.drop_column("lease_owner")
