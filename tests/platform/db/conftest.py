"""Databases for the db tests: a migrated PostgreSQL or SQLite database per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from loramux.platform.db.migrate import upgrade
from loramux.platform.db.session import create_engine_for, session_factory

BACKENDS = ["postgresql", "sqlite"]


@pytest.fixture
def sqlite_database_url(tmp_path: Path) -> str:
    """URL of an empty SQLite file database in the test's temp dir."""
    return f"sqlite:///{tmp_path / 'loramux.db'}"


@pytest.fixture(params=BACKENDS)
def empty_database_url(request: pytest.FixtureRequest) -> str:
    """An empty database on each backend in turn."""
    if request.param == "postgresql":
        return request.getfixturevalue("postgres_database_url")
    return request.getfixturevalue("sqlite_database_url")


@pytest.fixture
def make_session(empty_database_url: str) -> Iterator[sessionmaker[Session]]:
    """Sessions on a database migrated to head, on each backend in turn."""
    upgrade(empty_database_url)
    engine = create_engine_for(empty_database_url)
    try:
        yield session_factory(engine)
    finally:
        engine.dispose()
