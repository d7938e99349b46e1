"""Revision 0003 (usage_daily) up and down on PostgreSQL, matching the model."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from loramux.platform.db.migrate import current, downgrade, head, upgrade
from loramux.platform.db.models import Base
from loramux.platform.db.session import create_engine_for


def _inspect(url: str) -> tuple[set[str], list, dict[str, list[str]], dict[str, str | None]]:
    """Tables, differences from the models, usage_daily's indexes and foreign keys' ondelete."""
    engine = create_engine_for(url)
    try:
        with engine.connect() as connection:
            inspector = inspect(connection)
            tables = set(inspector.get_table_names()) - {"alembic_version"}
            differences = compare_metadata(MigrationContext.configure(connection), Base.metadata)
            indexes, ondelete = {}, {}
            if (table := "usage_daily") in tables:
                indexes = {i["name"]: i["column_names"] for i in inspector.get_indexes(table)}
                ondelete = {
                    fk["referred_table"]: fk["options"].get("ondelete")
                    for fk in inspector.get_foreign_keys(table)
                }
            return tables, differences, indexes, ondelete
    finally:
        engine.dispose()


def test_0003_adds_and_drops_usage_daily(postgres_database_url):
    url = postgres_database_url
    upgrade(url)  # from an empty database to head
    assert current(url) == head()
    tables, differences, indexes, ondelete = _inspect(url)
    assert tables == set(Base.metadata.tables)
    assert differences == []
    assert indexes == {
        "ix_usage_daily_day": ["day"],
        "ix_usage_daily_tenant_id_day": ["tenant_id", "day"],
    }
    assert ondelete == {"tenants": None, "adapters": "SET NULL"}

    downgrade(url, "0002")
    assert current(url) == "0002"
    tables, _, _, _ = _inspect(url)
    assert tables == set(Base.metadata.tables) - {"usage_daily", "adapter_grants"}  # both later

    upgrade(url)
    assert current(url) == head()
    assert _inspect(url)[1] == []

    downgrade(url, "base")
    assert _inspect(url)[0] == set()
