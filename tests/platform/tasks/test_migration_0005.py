"""Revision 0005 (upload leases) up and down on PostgreSQL and SQLite; rows written before it
keep their values and get no lease."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect, text

from loramux.platform.db.migrate import current, downgrade, upgrade
from loramux.platform.db.session import create_engine_for

LEASE_COLUMNS = {"lease_owner", "lease_expires_at"}


@pytest.fixture(params=["postgresql", "sqlite"])
def url(request, tmp_path) -> str:
    if request.param == "postgresql":
        return request.getfixturevalue("postgres_database_url")
    return f"sqlite:///{tmp_path / 'migrations.db'}"


def _shape(url: str) -> tuple[set[str], set[str]]:
    """adapter_versions' lease columns and indexes."""
    engine = create_engine_for(url)
    try:
        with engine.connect() as connection:
            inspector = inspect(connection)
            columns = {c["name"] for c in inspector.get_columns("adapter_versions")}
            indexes = {i["name"] for i in inspector.get_indexes("adapter_versions")}
    finally:
        engine.dispose()
    return columns & LEASE_COLUMNS, indexes


def _execute(url: str, sql: str, **params) -> list:
    engine = create_engine_for(url)
    try:
        with engine.begin() as connection:
            result = connection.execute(text(sql), params)
            return result.all() if result.returns_rows else []
    finally:
        engine.dispose()


def test_0005_adds_and_drops_the_lease_columns(url):
    upgrade(url, "0004")
    _execute(
        url,
        "INSERT INTO tenants (id, name, priority, weight, created_at, updated_at) "
        "VALUES ('t1', 'acme', 5, 1.0, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)",
    )
    _execute(
        url,
        "INSERT INTO adapters (id, tenant_id, name, created_at) "
        "VALUES ('a1', 't1', 'bot', CURRENT_TIMESTAMP)",
    )
    _execute(
        url,
        "INSERT INTO adapter_versions (id, adapter_id, version, status, base_model, "
        "created_at, updated_at) VALUES ('v1', 'a1', 1, 'validating', 'm', "
        "CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)",
    )

    upgrade(url, "0005")
    assert current(url) == "0005"
    columns, indexes = _shape(url)
    assert columns == LEASE_COLUMNS
    assert "ix_adapter_versions_status" in indexes
    assert _execute(url, "SELECT status, lease_owner, lease_expires_at FROM adapter_versions") == [
        ("validating", None, None)
    ]

    downgrade(url, "0004")
    columns, indexes = _shape(url)
    assert columns == set() and "ix_adapter_versions_status" not in indexes
    assert _execute(url, "SELECT id, status FROM adapter_versions") == [("v1", "validating")]

    upgrade(url, "0005")
    assert _shape(url)[0] == LEASE_COLUMNS
