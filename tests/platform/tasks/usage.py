"""Usage records for the task tests: two tenants inside one UTC day, and some outside it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy.orm import Session, sessionmaker

from tests.platform.db.factories import add_adapter, add_tenant, usage_record

DAY_START = datetime(2025, 3, 4, tzinfo=UTC)  # a closed day: the tasks refuse others
DAY_END = DAY_START + timedelta(days=1)


def add_day_of_usage(sessions: sessionmaker[Session]) -> int:
    """Add records in and around ``[DAY_START, DAY_END)``; return how many fall inside."""
    with sessions.begin() as session:
        first, second = add_tenant(session), add_tenant(session)
        adapter = add_adapter(session, first, name="support")
        inside = [
            usage_record(first, created_at=DAY_START),  # the start is included
            usage_record(first, created_at=DAY_START + timedelta(hours=3), adapter_id=adapter.id),
            usage_record(second, created_at=DAY_END - timedelta(microseconds=1), prompt_tokens=7),
        ]
        outside = [
            usage_record(first, created_at=DAY_START - timedelta(microseconds=1)),
            usage_record(second, created_at=DAY_END),  # the end is excluded
        ]
        session.add_all(inside + outside)
    return len(inside)
