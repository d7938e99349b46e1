"""Daily roll-ups on PostgreSQL: equal to the raw records, final, caught up, read by the budget.

Usage is spread over 2025-05-30 .. 2025-06-03 (across a month boundary) for two tenants, on
the base model and on adapters, with records exactly on the days' edges. Expected sums are
computed in Python from the records the test wrote, not with the SQL under test.
"""

from __future__ import annotations

import random
import threading
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

import pytest
from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session, sessionmaker

from loramux.platform.db.models import UsageDaily, UsageRecord
from loramux.platform.db.types import utc_now
from loramux.platform.errors import QuotaExceeded
from loramux.platform.services.admission import check_budget
from loramux.platform.services.rollups import (
    ROLLUP_GRACE,
    InvalidPeriod,
    month_bounds,
    month_spend,
    rollup_closed_days,
    rollup_day,
    run_rollup,
    utc_day_bounds,
)
from tests.platform.db.factories import add_adapter, add_tenant, usage_record

DAYS = [date(2025, 5, 30) + timedelta(days=i) for i in range(5)]  # May 30 .. June 3
MAY, JUNE = datetime(2025, 5, 20, tzinfo=UTC), datetime(2025, 6, 20, tzinfo=UTC)
METRICS = ("prompt_tokens", "cached_prompt_tokens", "completion_tokens", "cost_micro_usd")
Key = tuple[date, str, str | None, str]  # day, tenant, adapter, model


def _midnight(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


@dataclass
class Usage:
    """What the test wrote: tenant ids and every record's values."""

    tenants: list[str]
    records: list[dict]

    def daily(self, days: set[date] | None = None) -> dict[Key, tuple[int, ...]]:
        """(requests, *METRICS) per (day, tenant, adapter, model) over ``days`` (all)."""
        sums: dict[Key, list[int]] = defaultdict(lambda: [0] * (1 + len(METRICS)))
        for record in self.records:
            day = record["created_at"].astimezone(UTC).date()
            if days is None or day in days:
                key = (day, record["tenant_id"], record["adapter_id"], record["model"])
                sums[key][0] += 1
                for i, metric in enumerate(METRICS, start=1):
                    sums[key][i] += record[metric]
        return {key: tuple(values) for key, values in sums.items()}

    def spend(self, tenant_id: str, month: datetime) -> int:
        return sum(
            r["cost_micro_usd"]
            for r in self.records
            if r["tenant_id"] == tenant_id
            and (r["created_at"].year, r["created_at"].month) == (month.year, month.month)
        )


def _write(sessions: sessionmaker[Session], usage: Usage, records: list[dict]) -> None:
    with sessions.begin() as session:
        for values in records:
            session.add(UsageRecord(**values))
    usage.records.extend(records)


@pytest.fixture
def usage(sessions: sessionmaker[Session]) -> Usage:
    rng = random.Random(20250530)
    with sessions.begin() as session:
        tenants = [add_tenant(session), add_tenant(session)]
        adapters = {t.id: [add_adapter(session, t).id, add_adapter(session, t).id] for t in tenants}
    result = Usage([t.id for t in tenants], [])
    records = []
    for day in DAYS:
        start = _midnight(day)
        moments = [start, start + timedelta(days=1, microseconds=-1)]  # both edges
        moments += [start + timedelta(seconds=rng.randrange(86400)) for _ in range(10)]
        for moment in moments:
            tenant = rng.choice(tenants)
            adapter_id = rng.choice([None, *adapters[tenant.id]])
            prompt = rng.randrange(1, 400)
            record = usage_record(
                tenant,
                created_at=moment,
                adapter_id=adapter_id,
                model="base" if adapter_id is None else f"adapter-{adapter_id[:6]}",
                prompt_tokens=prompt,
                cached_prompt_tokens=rng.randrange(prompt + 1),
                completion_tokens=rng.randrange(1, 300),
                cost_micro_usd=rng.randrange(1, 5000),
            )
            records.append({c.key: getattr(record, c.key) for c in UsageRecord.__table__.columns})
    _write(sessions, result, records)
    return result


def _rolled(sessions: sessionmaker[Session]) -> dict[Key, tuple[int, ...]]:
    with sessions() as session:
        rows = session.scalars(select(UsageDaily)).all()
    keys = [(r.day, r.tenant_id, r.adapter_id, r.model) for r in rows]
    assert len(set(keys)) == len(keys), "one row per (day, tenant, adapter, model)"
    return {
        (r.day, r.tenant_id, r.adapter_id, r.model): (r.requests, *(getattr(r, m) for m in METRICS))
        for r in rows
    }


def _roll(sessions: sessionmaker[Session], days) -> None:
    for day in days:
        with sessions.begin() as session:
            rollup_day(session, day)


def test_rollup_day_equals_the_raw_aggregates_and_is_idempotent(sessions, usage):
    _roll(sessions, DAYS)
    rolled = _rolled(sessions)
    assert rolled == usage.daily()
    assert any(adapter is None for _, _, adapter, _ in rolled)  # base model rows
    assert {tenant for _, tenant, _, _ in rolled} == set(usage.tenants)

    _roll(sessions, DAYS)
    assert _rolled(sessions) == rolled

    # Rolling a day up again replaces its rows (a backfilled record is counted once).
    late = _copy(usage.records[0], "late", adapter_id=None, created_at=_midnight(DAYS[1]))
    _write(sessions, usage, [dict(late, model="base")])
    _roll(sessions, [DAYS[1]])
    assert _rolled(sessions) == usage.daily()


def test_a_day_is_rolled_up_only_once_closed(sessions, usage):
    assert timedelta(minutes=5) == ROLLUP_GRACE
    end_of_last = _midnight(DAYS[-1]) + timedelta(days=1)

    rolled = rollup_closed_days(sessions, now=end_of_last + timedelta(minutes=4, seconds=59))
    assert rolled == DAYS[:-1]
    assert _rolled(sessions) == usage.daily(set(DAYS[:-1]))

    assert rollup_closed_days(sessions, now=end_of_last + timedelta(minutes=5)) == [DAYS[-1]]
    assert _rolled(sessions) == usage.daily()
    assert rollup_closed_days(sessions, now=end_of_last + timedelta(days=3)) == []


def test_catch_up_respects_max_days_and_resumes(sessions, usage):
    now = _midnight(DAYS[-1]) + timedelta(days=1, minutes=10)
    assert rollup_closed_days(sessions, now=now, max_days=2) == DAYS[:2]
    assert _rolled(sessions) == usage.daily(set(DAYS[:2]))
    assert rollup_closed_days(sessions, now=now, max_days=2) == DAYS[2:4]
    assert rollup_closed_days(sessions, now=now, max_days=2) == DAYS[4:]
    assert rollup_closed_days(sessions, now=now, max_days=2) == []
    assert _rolled(sessions) == usage.daily()


def _copy(record: dict, request_id: str, **changes) -> dict:
    """Another record like ``record``."""
    return {**record, "id": f"{request_id:x>32}", "request_id": request_id, **changes}


def test_days_without_usage_are_rolled_once_then_skipped(sessions, usage):
    later = date(2025, 8, 1)
    august = _copy(usage.records[0], "august", created_at=_midnight(later) + timedelta(hours=5))
    _write(sessions, usage, [august])
    now = _midnight(later) + timedelta(days=1, minutes=5)

    first = rollup_closed_days(sessions, now=now, max_days=10)
    assert first == [DAYS[0] + timedelta(days=i) for i in range(10)]  # 5 with usage, 5 empty
    # The next run jumps over the empty days to the next day with usage.
    assert rollup_closed_days(sessions, now=now, max_days=10) == [later]
    assert rollup_closed_days(sessions, now=now, max_days=10) == []
    assert _rolled(sessions) == usage.daily()


def test_an_operator_run_says_what_it_rolled_and_what_is_still_open(sessions, usage):
    # 00:03 on DAYS[3]: DAYS[2] ended 3 minutes ago, still within the grace.
    now = _midnight(DAYS[3]) + timedelta(minutes=3)

    run = run_rollup(sessions, now=now, max_days=1)
    assert (run.rolled, run.more_pending) == ([DAYS[0]], True)
    run = run_rollup(sessions, now=now)

    assert run.rolled == [DAYS[1]] and not run.more_pending
    assert run.last_closed == DAYS[1]
    assert run.open_days == [DAYS[2], DAYS[3]]
    assert run.next_close == _midnight(DAYS[3]) + ROLLUP_GRACE
    assert _rolled(sessions) == usage.daily({DAYS[0], DAYS[1]})
    assert run_rollup(sessions, now=now).rolled == []

    # One closed day again (after a backfill); an open or future one is refused.
    late = _copy(usage.records[0], "late", adapter_id=None, created_at=_midnight(DAYS[0]))
    _write(sessions, usage, [dict(late, model="base")])
    assert run_rollup(sessions, now=now, day=DAYS[0]).rolled == [DAYS[0]]
    assert _rolled(sessions) == usage.daily({DAYS[0], DAYS[1]})
    with pytest.raises(InvalidPeriod, match=r"not closed yet.*00:05:00Z"):
        run_rollup(sessions, now=now, day=DAYS[2])
    with pytest.raises(InvalidPeriod, match="in the future"):
        run_rollup(sessions, now=now, day=DAYS[4])
    assert _rolled(sessions) == usage.daily({DAYS[0], DAYS[1]})


@pytest.mark.parametrize(
    "rolled_days",
    [[], [DAYS[3]], [DAYS[0], DAYS[2], DAYS[4]], [DAYS[1], DAYS[2]], DAYS],
    ids=["none", "one", "scattered", "across-the-boundary", "all"],
)
def test_month_spend_equals_the_raw_sum_whatever_is_rolled_up(sessions, usage, rolled_days):
    _roll(sessions, rolled_days)
    with sessions() as session:
        for tenant_id in usage.tenants:
            for now in (MAY, JUNE):
                expected = usage.spend(tenant_id, now)
                assert expected > 0
                assert month_spend(session, tenant_id, now=now) == expected, (tenant_id, now)
        assert month_spend(session, usage.tenants[0], now=JUNE + timedelta(days=40)) == 0


def test_month_spend_reads_the_rollups(sessions, usage):
    """With the raw records of rolled-up days deleted, the month's spend is unchanged."""
    rollup_closed_days(sessions, now=_midnight(DAYS[3]) + timedelta(minutes=5))  # up to June 2
    with sessions() as session:
        before = {t: month_spend(session, t, now=JUNE) for t in usage.tenants}
    assert before == {t: usage.spend(t, JUNE) for t in usage.tenants}

    with sessions.begin() as session:
        gone = session.execute(
            delete(UsageRecord).where(UsageRecord.created_at < _midnight(DAYS[3]))
        ).rowcount
    assert gone > 0
    with sessions() as session:
        after = {t: month_spend(session, t, now=JUNE) for t in usage.tenants}
        raw_left = session.scalar(select(func.count()).select_from(UsageRecord))
    assert after == before
    assert raw_left == sum(1 for r in usage.records if r["created_at"].date() >= DAYS[3])


def test_two_rollups_of_one_day_at_once_write_it_once(sessions, usage):
    """The second waits for the first (an advisory lock), then replaces its rows."""
    holder = sessions()
    holder.begin()
    rollup_day(holder, DAYS[0])  # rows inserted, not committed
    done = threading.Event()

    def second() -> None:
        with sessions.begin() as session:
            rollup_day(session, DAYS[0])
        done.set()

    thread = threading.Thread(target=second, daemon=True)
    thread.start()
    try:
        waited = not done.wait(0.5)
    finally:
        holder.commit()
        holder.close()
        thread.join(10)
    assert waited, "the second roll-up must wait for the first"
    assert done.is_set()
    assert _rolled(sessions) == usage.daily({DAYS[0]})


def test_check_budget_refuses_from_rollup_data(sessions):
    start, _ = utc_day_bounds(month_bounds(utc_now())[0])
    with sessions.begin() as session:
        tenant = add_tenant(session, monthly_budget_micro_usd=1_000)
        session.add(usage_record(tenant, created_at=start, cost_micro_usd=600))
        session.add(usage_record(tenant, created_at=start + timedelta(microseconds=1)))
    _roll(sessions, [start.date()])
    with sessions.begin() as session:
        session.execute(delete(UsageRecord))  # only the roll-up knows the spend now

    with sessions() as session:
        tenant = session.merge(tenant)
        check_budget(session, tenant)  # 630 of 1000: allowed
        tenant.monthly_budget_micro_usd = 630
        with pytest.raises(QuotaExceeded) as refused:
            check_budget(session, tenant)
    assert refused.value.code == "budget_exceeded"
    assert "$0.000630 of a $0.000630 budget" in refused.value.message
