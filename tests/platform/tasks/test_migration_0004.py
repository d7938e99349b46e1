"""Revision 0004 (``usage_records.final``) up and down: rows written before it are final."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect, text

from loramux.platform.db.migrate import current, downgrade, upgrade
from loramux.platform.db.session import create_engine_for

TENANT = (
    "INSERT INTO tenants (id, name, priority, weight, created_at, updated_at) "
    "VALUES ('t1', 'acme', 5, 1.0, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
)
USAGE = (
    "INSERT INTO usage_records (id, request_id, tenant_id, model, prompt_tokens, "
    "cached_prompt_tokens, completion_tokens, latency_ms, cost_micro_usd, created_at) "
    "VALUES ('u1', 'req-1', 't1', 'base', 3, 0, 2, 5, 7, CURRENT_TIMESTAMP)"
)


@pytest.fixture(params=["postgresql", "sqlite"])
def database_url(request) -> str:
    if request.param == "postgresql":
        return request.getfixturevalue("postgres_database_url")
    return f"sqlite:///{request.getfixturevalue('tmp_path') / 'loramux.db'}"


def _usage_columns(url: str) -> set[str]:
    engine = create_engine_for(url)
    try:
        with engine.connect() as connection:
            return {c["name"] for c in inspect(connection).get_columns("usage_records")}
    finally:
        engine.dispose()


def test_0004_adds_final_and_existing_rows_are_final(database_url):
    upgrade(database_url, "0003")
    engine = create_engine_for(database_url)
    try:
        with engine.begin() as connection:
            connection.execute(text(TENANT))
            connection.execute(text(USAGE))
        upgrade(database_url, "0004")
        assert current(database_url) == "0004"
        with engine.connect() as connection:
            final = connection.execute(text("SELECT final FROM usage_records")).scalar_one()
        assert final in (True, 1)
    finally:
        engine.dispose()

    downgrade(database_url, "0003")
    assert "final" not in _usage_columns(database_url)
    upgrade(database_url, "0004")
    assert "final" in _usage_columns(database_url)
