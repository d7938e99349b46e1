"""Run the Alembic migrations in ``loramux.migrations`` from code; no alembic.ini needed.

The Alembic ``Config`` is built here with ``script_location`` set to the folder of the
installed ``loramux.migrations`` package, so this works from a wheel as well as from a
checkout. ``migrations/env.py`` reads the database URL from the ``sqlalchemy.url`` option.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import URL, create_engine
from sqlalchemy.pool import NullPool

import loramux.migrations
from loramux.platform.db.session import database_url


def migrations_folder() -> Path:
    """The folder holding env.py, script.py.mako and versions/."""
    return Path(loramux.migrations.__file__).resolve().parent


def alembic_config(url: str | URL) -> Config:
    """An Alembic config for the database at ``url`` using the packaged migrations."""
    config = Config()
    config.set_main_option("script_location", str(migrations_folder()))
    rendered = database_url(url).render_as_string(hide_password=False)
    # Config values go through ConfigParser interpolation: a literal % must be doubled.
    config.set_main_option("sqlalchemy.url", rendered.replace("%", "%%"))
    return config


def upgrade(url: str | URL, revision: str = "head") -> None:
    """Migrate the database at ``url`` up to ``revision`` (default: the newest)."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str | URL, revision: str) -> None:
    """Migrate the database at ``url`` down to ``revision`` (``"base"``: an empty schema)."""
    command.downgrade(alembic_config(url), revision)


def current(url: str | URL) -> str | None:
    """The revision the database at ``url`` is at; ``None`` when never migrated."""
    engine = create_engine(database_url(url), poolclass=NullPool)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()


def head() -> str | None:
    """The newest revision the packaged migrations define."""
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
