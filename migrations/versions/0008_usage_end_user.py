"""The end user of a request: ``usage_records.end_user``.

Revision ID: 0008
Revises: 0007
Create Date: 2027-01-04

OpenAI's ``user`` field (the tenant's own id for the end user behind a request, at most 256
characters) is stored with the request's usage and exported with it. Nullable: existing
records and requests that send none have no end user. A plain ALTER TABLE ADD COLUMN, so no
batch copy on SQLite and --sql works.

Written out in full (not imported from the models), like 0001-0007.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("usage_records", sa.Column("end_user", sa.String(length=256), nullable=True))


def downgrade() -> None:
    # Plain DROP COLUMN (SQLite 3.35+): the column has no constraint or index to carry.
    op.drop_column("usage_records", "end_user")
