"""Provisional usage: the journal's checkpoints of running requests and the final record
that takes over, on PostgreSQL and SQLite; reports, roll-ups and the budget count them."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

from sqlalchemy import select

from loramux.platform.db.models import UsageRecord
from loramux.platform.db.types import utc_now
from loramux.platform.services.billing import usage_report
from loramux.platform.services.metering import Meter, UsageEvent
from loramux.platform.services.rollups import month_spend, rollup_day
from loramux.platform.services.usage_journal import UsageJournal
from tests.platform.db.factories import add_price, add_tenant

# The factory's default price: $1 per million input tokens, $2 output.


def _tenant(make_session) -> str:
    with make_session.begin() as session:
        tenant = add_tenant(session)
        add_price(session, tenant, utc_now() - timedelta(days=1))
        return tenant.id


def _event(tenant_id: str, request_id: str, completion_tokens: int, **fields) -> UsageEvent:
    return UsageEvent(
        request_id=request_id,
        tenant_id=tenant_id,
        model="base",
        prompt_tokens=100,
        completion_tokens=completion_tokens,
        **fields,
    )


def _rows(make_session) -> list[UsageRecord]:
    with make_session() as session:
        return list(session.scalars(select(UsageRecord).order_by(UsageRecord.request_id)))


def test_checkpoints_are_provisional_and_the_final_record_takes_over(make_session):
    tenant_id = _tenant(make_session)
    meter = Meter(make_session)
    assert meter.checkpoint([_event(tenant_id, "req-a", 10), _event(tenant_id, "req-b", 0)]) == 1
    assert meter.checkpoint([_event(tenant_id, "req-a", 30)]) == 1
    [row] = _rows(make_session)
    assert (row.request_id, row.completion_tokens, row.final) == ("req-a", 30, False)
    assert row.cost_micro_usd == 100 + 60  # its cost follows its tokens
    provisional_id = row.id

    final = meter.record(_event(tenant_id, "req-a", 42, finish_reason="stop", latency_ms=9))
    assert final is not None and final.id == provisional_id
    assert meter.checkpoint([_event(tenant_id, "req-a", 50)]) == 0  # a late checkpoint: no-op
    assert meter.record(_event(tenant_id, "req-a", 99)) is None  # exactly once
    [row] = _rows(make_session)
    assert (row.completion_tokens, row.final, row.finish_reason) == (42, True, "stop")
    assert (row.cost_micro_usd, row.latency_ms) == (100 + 84, 9)


def test_provisional_rows_count_in_reports_rollups_and_the_budget(make_session):
    tenant_id = _tenant(make_session)
    meter = Meter(make_session)
    meter.checkpoint([_event(tenant_id, "req-running", 10)])
    meter.record(_event(tenant_id, "req-done", 5))

    with make_session() as session:
        report = usage_report(session, tenant_id=tenant_id, group_by="request")
        spent = month_spend(session, tenant_id, now=utc_now())
    assert report.totals["requests"] == 2
    assert report.totals["completion_tokens"] == 15
    assert report.totals["cost_micro_usd"] == spent == (100 + 20) + (100 + 10)
    with make_session.begin() as session:
        rollup_day(session, utc_now().date())
        assert month_spend(session, tenant_id, now=utc_now()) == spent


def test_the_journal_checkpoints_what_running_requests_delivered(make_session):
    tenant_id = _tenant(make_session)
    delivered = {"a": 0, "b": 0}
    ids = {name: f"req-{name}-{uuid.uuid4().hex[:6]}" for name in delivered}

    async def scenario() -> list[int]:
        journal = UsageJournal(Meter(make_session), interval_s=0.05)
        for name in delivered:
            journal.open(ids[name], lambda name=name: _event(tenant_id, ids[name], delivered[name]))
        written = [await journal.checkpoint()]  # nothing delivered yet: nothing written
        delivered["a"] = 3
        written.append(await journal.checkpoint())
        written.append(await journal.checkpoint())  # nothing new since
        journal.close(ids["a"])
        delivered["a"], delivered["b"] = 7, 4
        await journal.start()  # the background task picks up b
        for _ in range(100):
            if any(r.request_id == ids["b"] for r in _rows(make_session)):
                break
            await asyncio.sleep(0.05)
        await journal.stop()
        return written

    assert asyncio.run(scenario()) == [0, 1, 0]
    rows = {r.request_id: r for r in _rows(make_session)}
    assert rows[ids["a"]].completion_tokens == 3  # closed before it delivered more
    assert rows[ids["b"]].completion_tokens == 4
    assert not any(r.final for r in rows.values())
