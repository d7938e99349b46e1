"""Revision 0002 (billing_exports) up and down on PostgreSQL, matching the model."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import MetaData, inspect

from loramux.platform.db.migrate import current, downgrade, upgrade
from loramux.platform.db.models import NAMING_CONVENTION, Base
from loramux.platform.db.session import create_engine_for

LATER_TABLES = {"usage_daily", "adapter_grants"}  # added by revisions after 0002
# Columns and indexes later revisions add to 0002's tables: what the models have beyond it.
LATER_ADDITIONS = {
    ("add_column", "adapter_versions", "lease_owner"),  # 0005
    ("add_column", "adapter_versions", "lease_expires_at"),  # 0005
    ("add_index", "adapter_versions", "ix_adapter_versions_status"),  # 0005
    ("add_column", "usage_records", "final"),  # 0004
    ("add_column", "billing_exports", "version"),  # 0006
    ("add_column", "billing_exports", "provisional"),  # 0006
    ("add_index", "billing_exports", "uq_billing_exports_final"),  # 0006
    # 0006: unique per (period, grouping, version) instead of per (period, grouping)
    ("add_constraint", "billing_exports", "period_start,period_end,group_by,version"),
    ("remove_constraint", "billing_exports", "period_start,period_end,group_by"),
    ("add_column", "tenants", "request_timeout_s"),  # 0007
    ("add_column", "tenants", "max_queued_requests"),  # 0007
    ("add_column", "usage_records", "end_user"),  # 0008
    ("add_column", "adapters", "alias_version"),  # 0009
    ("add_column", "adapter_versions", "pinned_by"),  # 0011
    ("add_column", "tenants", "pin_quota_bytes"),  # 0011
}


def _beyond_0002(differences: list) -> set[tuple[str, str, str]]:
    """The differences as (kind, table, column or index name), to compare with LATER_ADDITIONS."""
    found = set()
    for difference in differences:
        kind = difference[0]
        if kind == "add_column":
            found.add((kind, difference[2], difference[3].name))
        elif kind == "add_index":
            found.add((kind, difference[1].table.name, difference[1].name))
        elif kind in ("add_constraint", "remove_constraint"):
            constraint = difference[1]
            columns = ",".join(column.name for column in constraint.columns)
            found.add((kind, constraint.table.name, columns))
        else:
            found.add((kind, "", repr(difference)))
    return found


def _models_at_0002() -> MetaData:
    """The models' tables as of revision 0002: all but the ones later revisions add."""
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    for name, table in Base.metadata.tables.items():
        if name not in LATER_TABLES:
            table.to_metadata(metadata)
    return metadata


def _inspect(url: str) -> tuple[set[str], list, dict[str, list[str]]]:
    """Tables, differences from the models of 0002, and billing_exports' unique constraints."""
    engine = create_engine_for(url)
    try:
        with engine.connect() as connection:
            inspector = inspect(connection)
            tables = set(inspector.get_table_names()) - {"alembic_version"}
            differences = compare_metadata(
                MigrationContext.configure(connection), _models_at_0002()
            )
            unique = (
                {u["name"]: u["column_names"] for u in inspector.get_unique_constraints(t)}
                if (t := "billing_exports") in tables
                else {}
            )
            return tables, differences, unique
    finally:
        engine.dispose()


def test_0002_adds_and_drops_billing_exports(postgres_database_url):
    url = postgres_database_url
    upgrade(url, "0001")
    tables, _, _ = _inspect(url)
    assert "billing_exports" not in tables and "usage_records" in tables

    upgrade(url, "0002")
    assert current(url) == "0002"
    tables, differences, unique = _inspect(url)
    assert tables == set(Base.metadata.tables) - LATER_TABLES
    assert _beyond_0002(differences) == LATER_ADDITIONS
    assert unique == {
        "uq_billing_exports_period_start_period_end_group_by": [
            "period_start",
            "period_end",
            "group_by",
        ]
    }

    downgrade(url, "0001")
    assert current(url) == "0001"
    tables, _, _ = _inspect(url)
    assert tables == set(Base.metadata.tables) - LATER_TABLES - {"billing_exports"}

    upgrade(url, "0002")
    assert _beyond_0002(_inspect(url)[1]) == LATER_ADDITIONS
