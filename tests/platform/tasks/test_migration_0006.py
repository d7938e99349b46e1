"""Revision 0006 (billing export versions) up and down on PostgreSQL and SQLite: an export
written before it is final version 1; afterwards a period takes a provisional and a final
version but never two finals; going down keeps the final versions only."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.exc import IntegrityError

from loramux.platform.db.migrate import current, downgrade, upgrade
from loramux.platform.db.session import create_engine_for

COLUMNS = "id, period_start, period_end, group_by, format, store_key, sha256, size_bytes, rows"
DAY = "'2026-11-24 00:00:00+00:00', '2026-11-25 00:00:00+00:00', 'request'"
OLD_EXPORT = (
    f"INSERT INTO billing_exports ({COLUMNS}, created_at) VALUES "
    f"('e1', {DAY}, 'csv', 'sha256/ab/ab', '{'a' * 64}', 10, 1, CURRENT_TIMESTAMP)"
)


def _version(export_id: str, version: int, provisional: bool) -> str:
    flag = "TRUE" if provisional else "FALSE"
    return (
        f"INSERT INTO billing_exports ({COLUMNS}, version, provisional, created_at) VALUES "
        f"('{export_id}', {DAY}, 'csv', 'billing/x.v{version}.csv', '{'b' * 64}', 10, 1, "
        f"{version}, {flag}, CURRENT_TIMESTAMP)"
    )


@pytest.fixture(params=["postgresql", "sqlite"])
def url(request, tmp_path) -> str:
    if request.param == "postgresql":
        return request.getfixturevalue("postgres_database_url")
    return f"sqlite:///{tmp_path / 'migrations.db'}"


def _execute(url: str, sql: str) -> list:
    engine = create_engine_for(url)
    try:
        with engine.begin() as connection:
            result = connection.execute(text(sql))
            return result.all() if result.returns_rows else []
    finally:
        engine.dispose()


def _shape(url: str) -> tuple[set[str], set[str]]:
    """billing_exports' columns and the names of its unique constraints and indexes."""
    engine = create_engine_for(url)
    try:
        with engine.connect() as connection:
            inspector = inspect(connection)
            columns = {c["name"] for c in inspector.get_columns("billing_exports")}
            unique = {c["name"] for c in inspector.get_unique_constraints("billing_exports")}
            unique |= {i["name"] for i in inspector.get_indexes("billing_exports") if i["unique"]}
    finally:
        engine.dispose()
    return columns, unique


def test_0006_versions_exports_and_goes_back(url):
    upgrade(url, "0005")
    _execute(url, OLD_EXPORT)

    upgrade(url, "0006")
    assert current(url) == "0006"
    columns, unique = _shape(url)
    assert {"version", "provisional"} <= columns
    assert "uq_billing_exports_final" in unique
    assert "uq_billing_exports_period_start_period_end_group_by_version" in unique
    assert "uq_billing_exports_period_start_period_end_group_by" not in unique
    assert _execute(url, "SELECT id, version, provisional FROM billing_exports") == [
        ("e1", 1, False)
    ]

    # A provisional version 2 of the same period fits; a second final or a taken version,
    # or a version 0, do not.
    _execute(url, _version("e2", 2, provisional=True))
    with pytest.raises(IntegrityError):
        _execute(url, _version("e3", 3, provisional=False))
    with pytest.raises(IntegrityError):
        _execute(url, _version("e4", 2, provisional=True))
    with pytest.raises(IntegrityError):
        _execute(url, _version("e5", 0, provisional=True))

    downgrade(url, "0005")
    columns, unique = _shape(url)
    assert not {"version", "provisional"} & columns
    assert "uq_billing_exports_period_start_period_end_group_by" in unique
    assert _execute(url, "SELECT id FROM billing_exports") == [("e1",)]

    upgrade(url, "0006")
    assert _execute(url, "SELECT id, version, provisional FROM billing_exports") == [
        ("e1", 1, False)
    ]
