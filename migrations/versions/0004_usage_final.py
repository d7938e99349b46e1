"""Provisional usage: ``usage_records.final`` tells a request's last write from its checkpoints.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-12

While a request streams, the usage journal checkpoints what it has delivered as a
provisional row (``final`` false), so a crash loses at most the last checkpoint's tokens;
the request's end makes the row final. Existing rows were all written at their request's
end: they are final (the server default).

Written out in full (not imported from the models), like 0001-0003.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ALTER TABLE ADD COLUMN (SQLite has it): no batch copy, so --sql mode works too.
    op.add_column(
        "usage_records",
        sa.Column("final", sa.Boolean(), server_default=sa.true(), nullable=False),
    )


def downgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_column("final")
