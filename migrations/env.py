"""Alembic environment: the URL comes from the config, the target schema from the models.

``loramux.platform.db.migrate`` builds the config in code and sets ``sqlalchemy.url``. From
the command line (``alembic -c migrations/alembic.ini ...``) set it with
``-x url=...`` or the ``LORAMUX_DATABASE_URL`` environment variable.
"""

from __future__ import annotations

import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

from loramux.platform.db.models import Base
from loramux.platform.db.session import database_url


def _url() -> str:
    url = (
        context.get_x_argument(as_dictionary=True).get("url")
        or context.config.get_main_option("sqlalchemy.url")
        or os.environ.get("LORAMUX_DATABASE_URL")
    )
    if not url:
        raise RuntimeError(
            "no database URL: set sqlalchemy.url, pass -x url=..., or set LORAMUX_DATABASE_URL"
        )
    return url


def _configure_options(dialect_name: str) -> dict:
    return {
        "target_metadata": Base.metadata,
        # SQLite cannot ALTER most things in place; batch mode rebuilds the table instead.
        "render_as_batch": dialect_name == "sqlite",
        "compare_type": True,
    }


def run_migrations_offline() -> None:
    url = database_url(_url())
    context.configure(
        url=url,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        **_configure_options(url.get_backend_name()),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(database_url(_url()), poolclass=NullPool)
    try:
        with engine.connect() as connection:
            context.configure(connection=connection, **_configure_options(connection.dialect.name))
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.config.config_file_name is not None:
    # Run from the alembic command line: use the ini file's logging set-up.
    fileConfig(context.config.config_file_name, disable_existing_loggers=False)

if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
