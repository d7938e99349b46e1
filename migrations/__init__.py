"""Alembic schema history (packaged so `pip install .` ships it)."""
