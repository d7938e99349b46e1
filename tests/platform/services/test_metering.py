"""Meter: one priced usage record per request id, on PostgreSQL and SQLite."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select

from loramux.platform.api.openai.render import openai_usage
from loramux.platform.db.models import UsageRecord
from loramux.platform.db.types import utc_now
from loramux.platform.services.metering import Meter, Usage, UsageEvent
from tests.platform.db.factories import add_adapter, add_adapter_version, add_price, add_tenant

# Prices come from the factory's default: $1 per million input tokens, $0.50 cached, $2 output.


def _event(tenant_id: str, **fields) -> UsageEvent:
    values = {
        "request_id": f"req-{uuid.uuid4().hex}",
        "tenant_id": tenant_id,
        "model": "base",
        "prompt_tokens": 1_000,
        "cached_prompt_tokens": 200,
        "completion_tokens": 500,
        "latency_ms": 40,
        "finish_reason": "stop",
        **fields,
    }
    return UsageEvent(**values)


def _count(make_session) -> int:
    with make_session() as session:
        return session.scalar(select(func.count()).select_from(UsageRecord))


@pytest.fixture
def tenant_id(make_session) -> str:
    with make_session.begin() as session:
        tenant = add_tenant(session)
        add_price(session, tenant, utc_now() - timedelta(days=1))
        return tenant.id


def test_records_every_field_with_its_cost(make_session, tenant_id):
    with make_session.begin() as session:
        adapter = add_adapter(session, add_tenant(session), name="support-bot")
        version = add_adapter_version(session, adapter)
        ids = (adapter.id, version.id)
    event = _event(
        tenant_id,
        adapter_id=ids[0],
        adapter_version_id=ids[1],
        model="support-bot",
        end_user="u" * 256,
    )

    record = Meter(make_session).record(event)

    assert record is not None
    assert record.request_id == event.request_id
    assert (record.tenant_id, record.adapter_id, record.adapter_version_id) == (tenant_id, *ids)
    assert (record.prompt_tokens, record.cached_prompt_tokens, record.completion_tokens) == (
        1_000,
        200,
        500,
    )
    assert (record.latency_ms, record.finish_reason, record.model) == (40, "stop", "support-bot")
    assert record.end_user == "u" * 256
    assert Meter(make_session).stored(event.request_id).end_user == "u" * 256
    # 800 uncached × $1/M + 200 cached × $0.5/M + 500 × $2/M = 800 + 100 + 1000 µ$.
    assert record.cost_micro_usd == 1_900
    assert record.created_at.tzinfo is not None
    assert _count(make_session) == 1


def test_same_request_id_twice_writes_one_row(make_session, tenant_id):
    meter = Meter(make_session)
    first = meter.record(_event(tenant_id, request_id="req-once"))
    again = meter.record(_event(tenant_id, request_id="req-once", completion_tokens=9_999))

    assert first is not None
    assert again is None
    assert _count(make_session) == 1
    stored = meter.stored("req-once")
    assert (stored.id, stored.completion_tokens) == (first.id, 500)
    assert meter.stored("req-never") is None


def test_concurrent_double_record_writes_one_row(make_session, tenant_id):
    meter = Meter(make_session)
    event = _event(tenant_id, request_id="req-race")
    barrier = threading.Barrier(2)

    def record_after_barrier(_: int) -> UsageRecord | None:
        barrier.wait(timeout=10)
        return meter.record(event)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(record_after_barrier, range(2)))

    assert sum(result is not None for result in results) == 1
    assert _count(make_session) == 1


def test_each_request_uses_the_price_in_force_when_it_ran(make_session):
    with make_session.begin() as session:
        tenant = add_tenant(session)
        add_price(session, tenant, utc_now() - timedelta(days=1), output_per_mtok=2_000_000)
        tenant_id = tenant.id
    meter = Meter(make_session)
    event = {"prompt_tokens": 0, "cached_prompt_tokens": 0, "completion_tokens": 1_000}

    before = meter.record(_event(tenant_id, **event))
    with make_session.begin() as session:  # the operator raises the price
        add_price(session, session.merge(tenant), utc_now(), output_per_mtok=5_000_000)
    after = meter.record(_event(tenant_id, **event))

    assert (before.cost_micro_usd, after.cost_micro_usd) == (2_000, 5_000)
    with make_session() as session:  # stored costs never change afterwards
        costs = session.scalars(
            select(UsageRecord.cost_micro_usd).order_by(UsageRecord.created_at)
        ).all()
    assert costs == [2_000, 5_000]


def test_backfilled_events_are_priced_at_their_own_moment(make_session):
    day = datetime(2030, 3, 1, tzinfo=UTC)
    with make_session.begin() as session:
        tenant = add_tenant(session)
        add_price(session, tenant, day, input_per_mtok=1_000_000)
        add_price(session, tenant, day + timedelta(days=1), input_per_mtok=3_000_000)
        tenant_id = tenant.id
    meter = Meter(make_session)
    event = {"prompt_tokens": 1_000, "cached_prompt_tokens": 0, "completion_tokens": 1}

    unpriced = meter.record(_event(tenant_id, created_at=day - timedelta(seconds=1), **event))
    first = meter.record(_event(tenant_id, created_at=day + timedelta(hours=23), **event))
    second = meter.record(_event(tenant_id, created_at=day + timedelta(days=1), **event))

    assert unpriced.cost_micro_usd == 0  # no price yet at that moment: free
    assert first.cost_micro_usd == 1_000 + 2
    assert second.cost_micro_usd == 3_000 + 2
    assert second.created_at == day + timedelta(days=1)


def test_a_tenant_without_a_price_is_charged_nothing(make_session):
    with make_session.begin() as session:
        tenant_id = add_tenant(session).id
    record = Meter(make_session).record(_event(tenant_id))
    assert record is not None
    assert record.cost_micro_usd == 0


def test_requests_without_completion_tokens_are_not_recorded(make_session, tenant_id):
    meter = Meter(make_session)
    event = _event(tenant_id, prompt_tokens=300, completion_tokens=0)
    assert not event.billable
    assert meter.record(event) is None
    assert meter.stored(event.request_id) is None
    assert _count(make_session) == 0


def test_a_scored_prompt_is_recorded_without_completion_tokens(make_session, tenant_id):
    # echo with max_tokens 0: the client got the prompt's logprobs, so the prompt is billed.
    event = _event(
        tenant_id,
        prompt_tokens=300,
        cached_prompt_tokens=0,
        completion_tokens=0,
        delivered_prompt=True,
    )
    assert event.billable
    record = Meter(make_session).record(event)
    assert (record.prompt_tokens, record.completion_tokens, record.cost_micro_usd) == (300, 0, 300)
    assert Meter(make_session).record(event) is None  # still once


def test_an_abandoned_request_is_billed_for_the_prompt_it_prefilled(make_session, tenant_id):
    # The client left mid-prefill: nothing delivered, but the engine had 700 prompt tokens.
    event = _event(
        tenant_id,
        prompt_tokens=700,
        cached_prompt_tokens=200,
        completion_tokens=0,
        finish_reason="abort",
        abandoned_prefill=True,
    )
    assert event.billable
    record = Meter(make_session).record(event)
    # 500 uncached × $1/M + 200 cached × $0.5/M.
    assert (record.prompt_tokens, record.cached_prompt_tokens, record.completion_tokens) == (
        700,
        200,
        0,
    )
    assert record.cost_micro_usd == 600
    assert Meter(make_session).record(event) is None  # still once
    assert _count(make_session) == 1


def test_an_abandoned_request_the_engine_never_started_is_not_recorded(make_session, tenant_id):
    event = _event(
        tenant_id,
        prompt_tokens=0,
        cached_prompt_tokens=0,
        completion_tokens=0,
        abandoned_prefill=True,
    )
    assert not event.billable
    assert Meter(make_session).record(event) is None
    assert _count(make_session) == 0


def test_a_dropped_stream_bills_the_delivered_tokens(make_session, tenant_id):
    # The route counts what reached the client (3 tokens), not what the engine generated.
    record = Meter(make_session).record(
        _event(
            tenant_id,
            prompt_tokens=0,
            cached_prompt_tokens=0,
            completion_tokens=3,
            finish_reason="abort",
        )
    )
    assert (record.completion_tokens, record.cost_micro_usd) == (3, 6)  # 3 × $2/M
    assert record.finish_reason == "abort"


def test_usage_for_response_repeats_the_record(make_session, tenant_id):
    record = Meter(make_session).record(_event(tenant_id))
    assert openai_usage(Usage.of(record)) == {
        "prompt_tokens": 1_000,
        "completion_tokens": 500,
        "total_tokens": 1_500,
        "prompt_tokens_details": {"cached_tokens": 200},
        "cost_micro_usd": 1_900,
    }


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt_tokens": -1},
        {"completion_tokens": -1},
        {"cached_prompt_tokens": -1},
        {"latency_ms": -1},
        {"cached_prompt_tokens": 1_001},
        {"request_id": ""},
        {"request_id": "r" * 129},
        {"end_user": "u" * 257},
        {"created_at": datetime(2030, 1, 1)},
        {"abandoned_prefill": True},  # with completion tokens: it delivered something
    ],
)
def test_malformed_events_are_refused(fields):
    with pytest.raises(ValueError):
        _event("tenant", **fields)
