"""The packaged Alembic migrations: empty → head → base → head, matching the models."""

from __future__ import annotations

import io

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from loramux.platform.db.migrate import (
    alembic_config,
    current,
    downgrade,
    head,
    migrations_folder,
    upgrade,
)
from loramux.platform.db.models import Base
from loramux.platform.db.session import create_engine_for

MODEL_TABLES = set(Base.metadata.tables)


def _tables(url: str) -> set[str]:
    engine = create_engine_for(url)
    try:
        with engine.connect() as connection:
            return set(inspect(connection).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def _schema_differences(url: str) -> list:
    engine = create_engine_for(url)
    try:
        with engine.connect() as connection:
            return compare_metadata(MigrationContext.configure(connection), Base.metadata)
    finally:
        engine.dispose()


def _unique_indexes(url: str, table: str) -> dict[str, list[str]]:
    engine = create_engine_for(url)
    try:
        with engine.connect() as connection:
            indexes = inspect(connection).get_indexes(table)
    finally:
        engine.dispose()
    return {index["name"]: index["column_names"] for index in indexes if index["unique"]}


def test_packaged_migrations_have_one_head():
    assert (migrations_folder() / "env.py").is_file()
    # head() raises if the history forks; the newest file in versions/ must be the head.
    newest = max(p.name.split("_")[0] for p in (migrations_folder() / "versions").glob("0*.py"))
    assert head() == newest


def test_upgrade_creates_every_table_matching_the_models(empty_database_url):
    assert current(empty_database_url) is None
    assert _tables(empty_database_url) == set()

    upgrade(empty_database_url)

    assert current(empty_database_url) == head()
    assert _tables(empty_database_url) == MODEL_TABLES
    assert _schema_differences(empty_database_url) == []
    unique = _unique_indexes(empty_database_url, "adapters")
    assert unique.get("uq_adapters_tenant_id_name_live") == ["tenant_id", "name"]


def test_downgrade_to_base_drops_everything_and_upgrade_works_again(empty_database_url):
    upgrade(empty_database_url)

    downgrade(empty_database_url, "base")
    assert _tables(empty_database_url) == set()
    assert current(empty_database_url) is None

    upgrade(empty_database_url, "head")
    assert _tables(empty_database_url) == MODEL_TABLES
    assert _schema_differences(empty_database_url) == []


def test_upgrade_is_a_no_op_at_head(empty_database_url):
    upgrade(empty_database_url)
    upgrade(empty_database_url)
    assert current(empty_database_url) == head()


@pytest.mark.parametrize("dialect", ["postgresql+psycopg://u@h/db", "sqlite:///offline.db"])
def test_offline_mode_renders_sql(dialect):
    config = alembic_config(dialect)
    config.output_buffer = io.StringIO()
    command.upgrade(config, "head", sql=True)
    sql = config.output_buffer.getvalue()
    assert "CREATE TABLE usage_records" in sql
    assert "CREATE UNIQUE INDEX uq_adapters_tenant_id_name_live" in sql
    assert "WHERE deleted_at IS NULL" in sql
