"""Writing usage records, one row per request id, on PostgreSQL and SQLite alike.

A request's row goes through at most two kinds of write:

* ``checkpoint_usage``: *provisional* rows (``final`` false) for requests still running,
  inserted or overwritten with their latest numbers; a final row is never touched.
* ``record_usage``: the request's *final* row, inserted or made final over its provisional
  one. Exactly once: a request id that already has a final row is left alone.

Both are single statements (``INSERT ... ON CONFLICT (request_id) DO UPDATE ... WHERE NOT
final``), so two writers racing on one request id serialize on the row and the final write
always wins, whichever commits first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import false
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from loramux.platform.db.models import UsageRecord
from loramux.platform.db.types import new_id, utc_now

_INSERTS_WITH_ON_CONFLICT = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}
_KEPT_ON_UPDATE = {"id", "request_id"}  # a row keeps its identity across its writes


def _make_insert(session: Session):
    dialect = session.get_bind().dialect.name
    try:
        return _INSERTS_WITH_ON_CONFLICT[dialect]
    except KeyError:
        raise NotImplementedError(f"usage writes do not support {dialect!r}") from None


def _values(record: UsageRecord, *, final: bool) -> dict[str, Any]:
    """Every column's value (defaults filled in), so the insert and the update agree."""
    if record.id is None:
        record.id = new_id()
    if record.created_at is None:
        record.created_at = utc_now()
    if record.cached_prompt_tokens is None:
        record.cached_prompt_tokens = 0
    record.final = final
    return {column.key: getattr(record, column.key) for column in UsageRecord.__table__.columns}


def _upsert(session: Session, rows: list[dict[str, Any]]):
    """Insert ``rows``; a row whose request id exists overwrites it unless that one is final."""
    statement = _make_insert(session)(UsageRecord).values(rows)
    updated = {
        column.key: statement.excluded[column.key]
        for column in UsageRecord.__table__.columns
        if column.key not in _KEPT_ON_UPDATE
    }
    return statement.on_conflict_do_update(
        index_elements=[UsageRecord.request_id],
        set_=updated,
        where=UsageRecord.__table__.c.final == false(),
    ).returning(UsageRecord.id)


def record_usage(session: Session, record: UsageRecord) -> str | None:
    """Write ``record`` as its request's final row; the row's id, or ``None`` when the
    request id already has a final row (then nothing changes).

    ``record`` is a new, unsaved ``UsageRecord``; it is not added to the session. When it
    was written, its ``id`` is set to the row's (a provisional row keeps its id), so it
    stands for the stored row. Retries and duplicate deliveries of the same request are
    therefore harmless: the first final write wins. Runs in the session's transaction.
    """
    row_id = session.execute(_upsert(session, [_values(record, final=True)])).scalar()
    if row_id is not None:
        record.id = row_id
    return row_id


def checkpoint_usage(session: Session, records: Sequence[UsageRecord]) -> int:
    """Write ``records`` (distinct request ids) as provisional rows in one statement; how
    many were written (a request whose row is already final is skipped).

    Runs in the session's transaction; the records are not added to the session.
    """
    if not records:
        return 0
    rows = [_values(record, final=False) for record in records]
    return len(session.execute(_upsert(session, rows)).all())
