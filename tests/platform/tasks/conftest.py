"""A migrated PostgreSQL database, its sessions and a local object store for the task tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from loramux.platform.db.migrate import upgrade
from loramux.platform.db.session import create_engine_for, session_factory
from loramux.platform.store import LocalObjectStore


@pytest.fixture
def database_url(postgres_database_url: str) -> str:
    """A fresh PostgreSQL database migrated to head."""
    upgrade(postgres_database_url)
    return postgres_database_url


@pytest.fixture
def sessions(database_url: str) -> Iterator[sessionmaker[Session]]:
    engine = create_engine_for(database_url)
    try:
        yield session_factory(engine)
    finally:
        engine.dispose()


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def store(data_dir: Path) -> LocalObjectStore:
    """The store ``build_store`` makes for ``Settings(data_dir=data_dir)``."""
    return LocalObjectStore(data_dir / "store")
