"""Engines and sessions for the metadata database; the caller owns and passes them around.

``create_engine_for(url)`` knows the two backends we run on:

* SQLite (the embedded default): foreign keys switched on for every connection, WAL journal
  for file databases (readers do not block the writer), usable from any thread;
  ``sqlite://`` (in memory) keeps one shared connection so every session sees the same data.
* PostgreSQL (production): ``pool_pre_ping`` so connections dropped by the server are
  replaced. ``postgres://`` and ``postgresql://`` URLs are read as psycopg 3.

Typical use::

    engine = create_engine_for(settings.resolved_database_url)
    upgrade(settings.resolved_database_url)      # loramux.platform.db.migrate
    make_session = session_factory(engine)
    with make_session.begin() as session:          # commits, or rolls back on error
        session.add(Tenant(name="acme"))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

POSTGRES_DRIVER = "postgresql+psycopg"
SQLITE_BUSY_TIMEOUT_MS = 5000


def database_url(url: str | URL) -> URL:
    """Parse ``url``, reading ``postgres://`` / ``postgresql://`` as the psycopg 3 driver."""
    parsed = make_url(url)
    if parsed.drivername in {"postgres", "postgresql"}:
        parsed = parsed.set(drivername=POSTGRES_DRIVER)
    return parsed


def _is_sqlite_memory(url: URL) -> bool:
    return url.database in {None, "", ":memory:"} or url.query.get("mode") == "memory"


def _enable_sqlite_pragmas(engine: Engine, *, wal: bool) -> None:
    """Run the pragmas every new SQLite connection needs (they do not persist, except WAL)."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            if wal:
                cursor.execute("PRAGMA journal_mode=WAL")
        finally:
            cursor.close()


def _create_sqlite_engine(url: URL, **kwargs: Any) -> Engine:
    connect_args = {"check_same_thread": False, **kwargs.pop("connect_args", {})}
    in_memory = _is_sqlite_memory(url)
    if in_memory:
        kwargs.setdefault("poolclass", StaticPool)
    else:
        Path(url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args=connect_args, **kwargs)
    _enable_sqlite_pragmas(engine, wal=not in_memory)
    return engine


def create_engine_for(url: str | URL, **kwargs: Any) -> Engine:
    """An engine for ``url`` set up for its backend; extra ``kwargs`` go to ``create_engine``.

    For a SQLite file the parent directory is created if missing.
    """
    parsed = database_url(url)
    if parsed.get_backend_name() == "sqlite":
        return _create_sqlite_engine(parsed, **kwargs)
    if parsed.get_backend_name() == "postgresql":
        kwargs.setdefault("pool_pre_ping", True)
    return create_engine(parsed, **kwargs)


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions bound to ``engine``. Objects stay readable after commit (no expiry on commit)."""
    return sessionmaker(bind=engine, expire_on_commit=False)


class ConnectionErrors:
    """Counts the errors of an engine's connections that say the database cannot be
    reached (refused, dropped, restarting; SQLAlchemy's operational and interface errors),
    as opposed to errors in statements. For the platform's ``/metrics``."""

    def __init__(self, engine: Engine):
        self.count = 0
        event.listen(engine, "handle_error", self._on_error)

    def _on_error(self, context: Any) -> None:
        error = context.sqlalchemy_exception
        if context.is_disconnect or isinstance(error, (OperationalError, InterfaceError)):
            self.count += 1
