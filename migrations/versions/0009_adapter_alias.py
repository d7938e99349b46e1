"""The version an adapter's bare name reaches: ``adapters.alias_version``.

Revision ID: 0009
Revises: 0008
Create Date: 2027-01-10

A tenant points its adapter's name at one of its versions (a rollback) or back at the
newest ready one (NULL, the default and every existing adapter's). A plain ALTER TABLE ADD
COLUMN, so no batch copy on SQLite and --sql works.

Written out in full (not imported from the models), like 0001-0008.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("adapters", sa.Column("alias_version", sa.Integer(), nullable=True))


def downgrade() -> None:
    # Plain DROP COLUMN (SQLite 3.35+): the column has no constraint or index to carry.
    op.drop_column("adapters", "alias_version")
