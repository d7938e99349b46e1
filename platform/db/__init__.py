"""Metadata database: SQLAlchemy models, engine/session set-up, Alembic migrations, pricing.

Modules: ``models`` (the tables), ``types`` (column types), ``session`` (engines and
sessions), ``migrate`` (Alembic run from code), ``pricing`` (money arithmetic and the
current price), ``usage`` (the idempotent usage write). Nothing happens at import time.
"""
