"""Column types shared by the models: timezone-aware UTC timestamps and id/time helpers."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from sqlalchemy import DateTime
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator


def new_id() -> str:
    """A fresh primary key: a random UUID4 as 32 lowercase hex characters."""
    return uuid.uuid4().hex


def utc_now() -> datetime:
    """The current time, timezone-aware, in UTC."""
    return datetime.now(UTC)


class UtcDateTime(TypeDecorator[datetime]):
    """``TIMESTAMP WITH TIME ZONE`` that always hands back aware UTC datetimes.

    PostgreSQL stores the instant; SQLite has no time zones, so values are converted to UTC
    before they are written and marked UTC when read back. Naive datetimes are refused on
    the way in: their meaning would depend on the machine's local zone.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value!r}: pass a timezone-aware datetime")
        value = value.astimezone(UTC)
        # SQLite stores the text as given; drop the offset so every row sorts the same way.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)
