"""Billing export versions: provisional exports of open periods, then a final one.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-20

``billing_exports.version`` (1, 2, ...) and ``provisional`` (the period was not closed when
exported). A period and grouping may now have several versions: the unique constraint on
(period_start, period_end, group_by) becomes one on (..., version), and a partial unique
index keeps at most one final version per period and grouping. Existing rows were all
written by the daily schedule, which exports closed days only: they are final version 1
(the server defaults).

Written out in full (not imported from the models), like 0001-0005. SQLite cannot drop a
constraint in place: the batch operation copies the table there (PostgreSQL alters it),
from the table's shape written out below rather than reflected, so ``--sql`` mode works.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_UNIQUE = "uq_billing_exports_period_start_period_end_group_by"
NEW_UNIQUE = "uq_billing_exports_period_start_period_end_group_by_version"
FINAL_UNIQUE = "uq_billing_exports_final"
VERSION_CHECK = "ck_billing_exports_version_positive"
PERIOD = ["period_start", "period_end", "group_by"]
FINAL = sa.text("NOT provisional")


def _table(*, versioned: bool) -> sa.Table:
    """billing_exports as 0002 made it (``versioned``: as this revision leaves it)."""

    def timestamp(name: str) -> sa.Column:
        return sa.Column(name, sa.DateTime(timezone=True), nullable=False)

    if versioned:
        versions: list[sa.SchemaItem] = [
            sa.Column("version", sa.Integer(), server_default=sa.text("1"), nullable=False),
            sa.Column("provisional", sa.Boolean(), server_default=sa.false(), nullable=False),
            sa.UniqueConstraint(*PERIOD, "version", name=NEW_UNIQUE),
            sa.CheckConstraint("version >= 1", name=VERSION_CHECK),
        ]
    else:
        versions = [sa.UniqueConstraint(*PERIOD, name=OLD_UNIQUE)]
    return sa.Table(
        "billing_exports",
        sa.MetaData(),
        sa.Column("id", sa.String(length=32), nullable=False),
        timestamp("period_start"),
        timestamp("period_end"),
        sa.Column("group_by", sa.String(length=16), nullable=False),
        sa.Column("format", sa.String(length=8), nullable=False),
        sa.Column("store_key", sa.String(length=1024), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("rows", sa.Integer(), nullable=False),
        timestamp("created_at"),
        sa.CheckConstraint("period_start < period_end", name="ck_billing_exports_period_ordered"),
        sa.CheckConstraint("format IN ('csv')", name="ck_billing_exports_format_known"),
        sa.CheckConstraint("size_bytes >= 0", name="ck_billing_exports_size_non_negative"),
        sa.CheckConstraint("rows >= 0", name="ck_billing_exports_rows_non_negative"),
        sa.PrimaryKeyConstraint("id", name="pk_billing_exports"),
        *versions,
    )


def upgrade() -> None:
    with op.batch_alter_table("billing_exports", copy_from=_table(versioned=False)) as batch:
        batch.add_column(
            sa.Column("version", sa.Integer(), server_default=sa.text("1"), nullable=False)
        )
        batch.add_column(
            sa.Column("provisional", sa.Boolean(), server_default=sa.false(), nullable=False)
        )
        batch.drop_constraint(op.f(OLD_UNIQUE), type_="unique")
        batch.create_unique_constraint(op.f(NEW_UNIQUE), [*PERIOD, "version"])
        batch.create_check_constraint(op.f(VERSION_CHECK), "version >= 1")
    op.create_index(
        op.f(FINAL_UNIQUE),
        "billing_exports",
        PERIOD,
        unique=True,
        postgresql_where=FINAL,
        sqlite_where=FINAL,
    )


def downgrade() -> None:
    # Only final exports fit the old shape (one row per period and grouping): the
    # provisional versions go (their objects stay in the store).
    op.execute("DELETE FROM billing_exports WHERE provisional")
    op.drop_index(op.f(FINAL_UNIQUE), table_name="billing_exports")
    with op.batch_alter_table("billing_exports", copy_from=_table(versioned=True)) as batch:
        batch.drop_constraint(op.f(VERSION_CHECK), type_="check")
        batch.drop_constraint(op.f(NEW_UNIQUE), type_="unique")
        batch.create_unique_constraint(op.f(OLD_UNIQUE), PERIOD)
        batch.drop_column("provisional")
        batch.drop_column("version")
