"""The service tests run on a migrated PostgreSQL and SQLite database, as the db tests do."""

from __future__ import annotations

# Reuse the db tests' per-backend database fixtures (``make_session`` on each backend).
from tests.platform.db.conftest import (  # noqa: F401
    empty_database_url,
    make_session,
    sqlite_database_url,
)
