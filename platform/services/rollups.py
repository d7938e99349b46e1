"""Daily usage roll-ups: closed UTC days summed into ``usage_daily``, and the month's spend.

A UTC day is *closed* once ``now >= day end + ROLLUP_GRACE``. Usage records are stamped with
the moment they are written (``Meter.record`` takes ``utc_now()`` just before its short
transaction), so a record of a closed day can only still appear if its commit was delayed by
more than the grace, or if it is a backfill with an explicit ``created_at``. Either case is
repaired by rolling that day up again (``rollup_day``, or the task with ``day`` set).
Provisional records (a running request's checkpoints, ``UsageRecord.final`` false) follow
the same rule: each checkpoint and the final write restamp the row, so a running request's
row moves to the new day within a checkpoint interval of midnight, long before the old day
closes; they are summed like any record (a crashed request's last checkpoint is its usage).

* ``rollup_day(session, day)`` replaces the day's rows with fresh sums, grouped by
  (tenant, adapter, model): idempotent, in the caller's transaction.
* ``rollup_closed_days(sessions, now=...)`` catches up: every closed day after the newest
  rolled-up day, oldest first, each in its own transaction.
* ``month_spend(session, tenant_id, now=...)`` is what the monthly budget reads: roll-up rows
  for the days that have them, raw records for the rest. Exact whatever days are rolled up.
* ``run_rollup(sessions, now=..., day=None)`` is what an operator runs (the admin API, the
  CLI): the catch-up above, or one closed day again, and a ``RollupRun`` saying which days
  are still open and when the oldest of them closes.

Everything filters ``created_at`` by ``[start, end)`` bounds computed here, so the same SQL
runs on PostgreSQL and SQLite.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

from sqlalchemy import and_, delete, func, insert, or_, select
from sqlalchemy.orm import Session, sessionmaker

from loramux.platform.db.models import UsageDaily, UsageRecord
from loramux.platform.db.types import utc_now
from loramux.platform.services.billing import METRICS

ROLLUP_GRACE = timedelta(minutes=5)
DEFAULT_MAX_DAYS = 31
# pg_advisory_xact_lock(namespace, day) serializes two roll-ups of one day (see rollup_day).
_ROLLUP_LOCK_NAMESPACE = 0x10_0A_D1


# --- UTC days -------------------------------------------------------------------------------


def utc_day_bounds(day: date) -> tuple[datetime, datetime]:
    """``[00:00, next 00:00)`` of ``day`` in UTC."""
    start = datetime.combine(day, time(), tzinfo=UTC)
    return start, start + timedelta(days=1)


def utc_day_of(moment: datetime) -> date:
    """The UTC calendar day an aware ``moment`` falls on."""
    return moment.astimezone(UTC).date()


def last_closed_day(now: datetime) -> date:
    """The newest UTC day that is closed at ``now`` (aware): its end is ``ROLLUP_GRACE`` past."""
    return utc_day_of(now - ROLLUP_GRACE) - timedelta(days=1)


def is_closed(day: date, now: datetime) -> bool:
    """Whether ``day`` is closed at ``now``: no record of it can still be committed."""
    return day <= last_closed_day(now)


def closes_at(day: date) -> datetime:
    """When ``day`` closes: the next midnight UTC plus ``ROLLUP_GRACE``."""
    return utc_day_bounds(day)[1] + ROLLUP_GRACE


def utc_text(moment: datetime) -> str:
    """``2026-11-25T00:05:00Z``: an aware moment in UTC, to the second."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class InvalidPeriod(ValueError):
    """A day or period that cannot be used as asked (in the future, not closed yet, too
    long, empty); the message says why and what to do."""


def why_not_closed(day: date, now: datetime) -> str:
    """Why ``day`` is not closed at ``now`` (the caller knows it is not)."""
    today = utc_day_of(now)
    if day > today:
        return f"{day.isoformat()} is in the future (today is {today.isoformat()} UTC)"
    minutes = int(ROLLUP_GRACE.total_seconds() // 60)
    return (
        f"{day.isoformat()} is not closed yet: a UTC day closes {minutes} minutes after the "
        f"midnight that ends it (at {utc_text(closes_at(day))}), so that usage written "
        "at its very end is in"
    )


def days_between(first: date, last: date) -> Iterator[date]:
    """``first``, the day after, ... up to ``last`` included."""
    day = first
    while day <= last:
        yield day
        day += timedelta(days=1)


def first_usage_day(session: Session, *, on_or_after: date | None = None) -> date | None:
    """The UTC day of the oldest usage record (on or after ``on_or_after``), if any."""
    query = select(func.min(UsageRecord.created_at))
    if on_or_after is not None:
        query = query.where(UsageRecord.created_at >= utc_day_bounds(on_or_after)[0])
    oldest = session.scalar(query)
    return None if oldest is None else utc_day_of(oldest)


# --- rolling up -----------------------------------------------------------------------------


def rollup_day(session: Session, day: date) -> int:
    """Replace ``day``'s roll-up rows by sums of its usage records; the number of rows.

    Runs in the caller's transaction (delete then insert), so readers see the old rows or the
    new ones, never a mix. On PostgreSQL a transaction-scoped advisory lock on the day makes a
    second roll-up of the same day wait for the first and then replace its rows, instead of
    both deleting nothing and inserting the day twice. SQLite serializes writers anyway.
    Rolling up an unclosed day is allowed here (it is replaced when rolled up again); the
    callers that run on a schedule only roll up closed days.
    """
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(func.pg_advisory_xact_lock(_ROLLUP_LOCK_NAMESPACE, day.toordinal())))
    start, end = utc_day_bounds(day)
    session.execute(delete(UsageDaily).where(UsageDaily.day == day))
    groups = session.execute(
        select(
            UsageRecord.tenant_id,
            UsageRecord.adapter_id,
            UsageRecord.model,
            func.count().label("requests"),
            *(func.sum(getattr(UsageRecord, m)).label(m) for m in METRICS if m != "requests"),
        )
        .where(UsageRecord.created_at >= start, UsageRecord.created_at < end)
        .group_by(UsageRecord.tenant_id, UsageRecord.adapter_id, UsageRecord.model)
    ).all()
    if not groups:
        return 0
    computed_at = utc_now()
    rows = [
        {
            "day": day,
            "tenant_id": group.tenant_id,
            "adapter_id": group.adapter_id,
            "model": group.model,
            # PostgreSQL's SUM of a BIGINT is NUMERIC (a Decimal here): back to int.
            **{metric: int(getattr(group, metric)) for metric in METRICS},
            "computed_at": computed_at,
        }
        for group in groups
    ]
    session.execute(insert(UsageDaily), rows)
    return len(rows)


def last_rolled_day(session: Session) -> date | None:
    """The newest day with roll-up rows, if any."""
    return session.scalar(select(func.max(UsageDaily.day)))


def rollup_closed_days(
    sessions: sessionmaker[Session], *, now: datetime, max_days: int = DEFAULT_MAX_DAYS
) -> list[date]:
    """Roll up the closed days not rolled up yet, oldest first, at most ``max_days``.

    The run starts at the first day with usage on or after the day after the newest
    rolled-up day (from the oldest record when nothing is rolled up) and ends at the last
    closed day. Days without usage inside the run are rolled up too (they get no rows); the
    next run still starts after the newest day *with* rows, but jumps straight to the next
    day with usage, so empty days are scanned once per gap, not forever. Each day is its own
    transaction: an interrupted catch-up keeps what it did. Returns the days rolled up.
    """
    if max_days < 1:
        raise ValueError("max_days must be at least 1")
    last_closed = last_closed_day(now)
    with sessions() as session:
        last_rolled = last_rolled_day(session)
        after = None if last_rolled is None else last_rolled + timedelta(days=1)
        first = first_usage_day(session, on_or_after=after)
    if first is None or first > last_closed:
        return []
    last = min(last_closed, first + timedelta(days=max_days - 1))
    rolled = []
    for day in days_between(first, last):
        with sessions.begin() as session:
            rollup_day(session, day)
        rolled.append(day)
    return rolled


@dataclass(frozen=True)
class RollupRun:
    """What one operator-run roll-up did, and what it left for later."""

    rolled: list[date]  # the days rolled up now, oldest first
    last_closed: date  # the newest closed day at the run
    open_days: list[date]  # the days after it up to today: still open, not rolled up
    more_pending: bool  # the catch-up stopped at its cap: run again for the rest

    @property
    def next_close(self) -> datetime:
        """When the oldest open day closes (and the next run can roll it up)."""
        return closes_at(self.open_days[0])

    @property
    def note(self) -> str:
        """What the run did, and why the open days were left, in words."""
        minutes = int(ROLLUP_GRACE.total_seconds() // 60)
        if self.rolled:
            done = f"Rolled up {len(self.rolled)} closed day(s): {_days_text(self.rolled)}."
        else:
            done = "Nothing to roll up: every closed day with usage is rolled up already."
        if self.more_pending:
            done += " The run stopped at its cap of days: run it again for the rest."
        them = "it" if len(self.open_days) == 1 else "them"
        return (
            f"{done} Not rolled up: {_days_text(self.open_days)} (today is "
            f"{self.open_days[-1].isoformat()} UTC), still open: usage is still being written "
            f"to {them}. A UTC day closes {minutes} minutes after the midnight that ends it, so "
            f"that requests running at midnight are in; {self.open_days[0].isoformat()} is "
            f"rolled up by the first run after {utc_text(self.next_close)}. Until then the "
            "monthly budget reads its raw usage."
        )


def _days_text(days: list[date]) -> str:
    if len(days) <= 3:
        return ", ".join(day.isoformat() for day in days)
    return f"{days[0].isoformat()} to {days[-1].isoformat()}"


def run_rollup(
    sessions: sessionmaker[Session],
    *,
    now: datetime,
    day: date | None = None,
    max_days: int = DEFAULT_MAX_DAYS,
) -> RollupRun:
    """Roll up the closed days not rolled up yet (``rollup_closed_days``), or, with ``day``,
    that closed day again (after a backfill); :class:`InvalidPeriod` if ``day`` is open."""
    if day is not None and not is_closed(day, now):
        raise InvalidPeriod(f"{why_not_closed(day, now)}; roll up a closed day")
    if day is None:
        rolled = rollup_closed_days(sessions, now=now, max_days=max_days)
    else:
        with sessions.begin() as session:
            rollup_day(session, day)
        rolled = [day]
    last_closed = last_closed_day(now)
    return RollupRun(
        rolled=rolled,
        last_closed=last_closed,
        open_days=list(days_between(last_closed + timedelta(days=1), utc_day_of(now))),
        more_pending=day is None and len(rolled) == max_days and rolled[-1] < last_closed,
    )


# --- reading --------------------------------------------------------------------------------


def month_bounds(now: datetime) -> tuple[date, date]:
    """The first day of ``now``'s UTC calendar month and the first day of the next one."""
    first = utc_day_of(now).replace(day=1)
    following = (first + timedelta(days=32)).replace(day=1)
    return first, following


def _unrolled_ranges(first: date, following: date, rolled: set[date]) -> list[tuple[date, date]]:
    """``[start, end)`` day ranges of ``[first, following)`` that are not in ``rolled``."""
    ranges: list[tuple[date, date]] = []
    for day in days_between(first, following - timedelta(days=1)):
        if day in rolled:
            continue
        if ranges and ranges[-1][1] == day:
            ranges[-1] = (ranges[-1][0], day + timedelta(days=1))
        else:
            ranges.append((day, day + timedelta(days=1)))
    return ranges


def month_spend(session: Session, tenant_id: str, *, now: datetime) -> int:
    """Micro-dollars the tenant's usage costs in ``now``'s UTC calendar month.

    Days on which the tenant has roll-up rows are read from them; every other day of the
    month (not rolled up yet, or rolled up with no usage of this tenant) from the raw
    records, in at most 16 ranges on the ``(tenant_id, created_at)`` index. A roll-up holds
    exactly its day's records, so the sum equals the raw sum over the month whichever days
    are rolled up; in practice only the days since the last roll-up are read raw.
    """
    first, following = month_bounds(now)
    per_day = session.execute(
        select(UsageDaily.day, func.sum(UsageDaily.cost_micro_usd))
        .where(
            UsageDaily.tenant_id == tenant_id,
            UsageDaily.day >= first,
            UsageDaily.day < following,
        )
        .group_by(UsageDaily.day)
    ).all()
    rolled_spend = sum(int(cost) for _, cost in per_day)
    ranges = _unrolled_ranges(first, following, {day for day, _ in per_day})
    if not ranges:
        return rolled_spend
    raw_spend = session.scalar(
        select(func.coalesce(func.sum(UsageRecord.cost_micro_usd), 0)).where(
            UsageRecord.tenant_id == tenant_id,
            or_(
                *(
                    and_(
                        UsageRecord.created_at >= utc_day_bounds(start)[0],
                        UsageRecord.created_at < utc_day_bounds(end)[0],
                    )
                    for start, end in ranges
                )
            ),
        )
    )
    return rolled_spend + int(raw_spend)
