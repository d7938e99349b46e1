"""Writing usage records exactly once per request id, on PostgreSQL and SQLite alike."""

from __future__ import annotations

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from loramux.platform.db.models import UsageRecord
from loramux.platform.db.types import new_id

_INSERTS_WITH_ON_CONFLICT = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}


def record_usage(session: Session, record: UsageRecord) -> str | None:
    """Insert ``record`` unless a record with its ``request_id`` exists; the new row's id, or
    ``None`` when nothing was inserted.

    ``record`` is a new, unsaved ``UsageRecord``; it is not added to the session. When it
    was inserted, its ``id`` is set to the row's, so it stands for the stored row. Retries and duplicate deliveries of the same
    request are therefore harmless: the first write wins. Runs in the session's transaction.
    """
    dialect = session.get_bind().dialect.name
    try:
        make_insert = _INSERTS_WITH_ON_CONFLICT[dialect]
    except KeyError:
        raise NotImplementedError(f"record_usage does not support {dialect!r}") from None
    if record.id is None:
        record.id = new_id()
    values = {
        column.key: value
        for column in UsageRecord.__table__.columns
        if (value := getattr(record, column.key)) is not None
    }
    statement = (
        make_insert(UsageRecord)
        .values(values)
        .on_conflict_do_nothing(index_elements=[UsageRecord.request_id])
        .returning(UsageRecord.id)
    )
    # RETURNING yields the new row's id, or nothing when the request id was already there.
    return session.execute(statement).scalar_one_or_none()
