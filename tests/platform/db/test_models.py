"""Constraints the schema enforces, on PostgreSQL and SQLite, and the models' defaults."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError, StatementError

from loramux.platform.db.models import (
    DEFAULT_PRIORITY,
    DEFAULT_WEIGHT,
    AdapterStatus,
    AdapterVersion,
    ApiKey,
    Tenant,
    UsageRecord,
)
from loramux.platform.db.types import utc_now
from tests.platform.db.factories import (
    add_adapter,
    add_adapter_version,
    add_api_key,
    add_tenant,
    usage_record,
)


def _assert_rejected(make_session, build) -> None:
    """``build(session)`` must fail with an integrity error when flushed."""
    with make_session() as session, pytest.raises(IntegrityError):
        build(session)
        session.flush()


def test_tenant_defaults_and_aware_timestamps(make_session):
    with make_session.begin() as session:
        tenant_id = add_tenant(session, name="acme").id
    with make_session() as session:
        tenant = session.get(Tenant, tenant_id)
        assert len(tenant.id) == 32
        assert tenant.priority == DEFAULT_PRIORITY
        assert tenant.weight == DEFAULT_WEIGHT
        assert tenant.requests_per_minute is None
        assert tenant.monthly_budget_micro_usd is None
        assert tenant.deleted_at is None
        assert tenant.created_at.tzinfo is not None
        assert tenant.created_at.utcoffset() == timedelta(0)
        assert abs(utc_now() - tenant.created_at) < timedelta(minutes=1)


def test_timestamps_round_trip_as_utc(make_session):
    moment = datetime(2030, 1, 2, 3, 4, 5, 678000, tzinfo=timezone(timedelta(hours=-5)))
    with make_session.begin() as session:
        tenant_id = add_tenant(session, deleted_at=moment).id
    with make_session() as session:
        stored = session.get(Tenant, tenant_id).deleted_at
    assert stored == moment
    assert stored.tzinfo == UTC


def test_naive_datetimes_are_refused(make_session):
    with make_session() as session, pytest.raises(StatementError, match="naive datetime"):
        add_tenant(session, deleted_at=datetime(2030, 1, 1))


@pytest.mark.parametrize("priority", [-1, 10])
def test_priority_outside_0_to_9_is_rejected(make_session, priority):
    _assert_rejected(make_session, lambda s: add_tenant(s, priority=priority))


@pytest.mark.parametrize("priority", [0, 9])
def test_priority_bounds_are_accepted(make_session, priority):
    with make_session.begin() as session:
        add_tenant(session, priority=priority)


@pytest.mark.parametrize("weight", [0.0, -1.0])
def test_weight_must_be_positive(make_session, weight):
    _assert_rejected(make_session, lambda s: add_tenant(s, weight=weight))


@pytest.mark.parametrize(
    "field", ["requests_per_minute", "tokens_per_minute", "monthly_budget_micro_usd"]
)
def test_limits_cannot_be_negative(make_session, field):
    _assert_rejected(make_session, lambda s: add_tenant(s, **{field: -1}))


def test_tenant_names_are_unique(make_session):
    with make_session.begin() as session:
        add_tenant(session, name="acme")
    _assert_rejected(make_session, lambda s: add_tenant(s, name="acme"))


def test_duplicate_api_key_hash_is_rejected(make_session):
    with make_session.begin() as session:
        tenant = add_tenant(session)
        add_api_key(session, tenant, secret="lmx-same-secret")
        other_id = add_tenant(session).id

    def duplicate(session):
        add_api_key(session, session.get(Tenant, other_id), secret="lmx-same-secret")

    _assert_rejected(make_session, duplicate)


def test_api_key_keeps_prefix_and_hash_and_can_be_revoked(make_session):
    with make_session.begin() as session:
        key = add_api_key(session, add_tenant(session), secret="lmx-abcdefgh-rest")
        key.revoked_at = utc_now()
        key_id = key.id
    with make_session() as session:
        stored = session.get(ApiKey, key_id)
        assert stored.prefix == "lmx-abcd"
        assert len(stored.key_hash) == 64
        assert stored.revoked_at is not None
        assert stored.tenant.id == stored.tenant_id


def test_live_adapter_names_are_unique_per_tenant(make_session):
    with make_session.begin() as session:
        tenant_id = add_adapter(session, add_tenant(session), name="support-bot").tenant_id

    _assert_rejected(
        make_session, lambda s: add_adapter(s, s.get(Tenant, tenant_id), name="support-bot")
    )


def test_adapter_name_is_free_again_after_soft_delete(make_session):
    with make_session.begin() as session:
        tenant = add_tenant(session)
        first = add_adapter(session, tenant, name="support-bot")
        first.deleted_at = utc_now()
        session.flush()
        second = add_adapter(session, tenant, name="support-bot")
        second.deleted_at = utc_now()
        session.flush()
        add_adapter(session, tenant, name="support-bot")


def test_same_adapter_name_is_allowed_across_tenants(make_session):
    with make_session.begin() as session:
        add_adapter(session, add_tenant(session), name="support-bot")
        add_adapter(session, add_tenant(session), name="support-bot")


def test_adapter_version_numbers_are_unique_per_adapter(make_session):
    with make_session.begin() as session:
        tenant = add_tenant(session)
        adapter = add_adapter(session, tenant)
        add_adapter_version(session, adapter, version=1)
        add_adapter_version(session, adapter, version=2)
        add_adapter_version(session, add_adapter(session, tenant), version=1)
        adapter_id = adapter.id

    def duplicate(session):
        session.add(AdapterVersion(adapter_id=adapter_id, version=2, base_model="base"))

    _assert_rejected(make_session, duplicate)


def test_adapter_versions_come_back_in_order(make_session):
    with make_session.begin() as session:
        adapter = add_adapter(session, add_tenant(session))
        for number in (3, 1, 2):
            add_adapter_version(session, adapter, version=number)
        adapter_id = adapter.id
    with make_session() as session:
        versions = session.get(type(adapter), adapter_id).versions
        assert [v.version for v in versions] == [1, 2, 3]
        assert {v.status for v in versions} == {AdapterStatus.UPLOADING}


def test_adapter_version_status_moves_to_ready_with_metadata(make_session):
    with make_session.begin() as session:
        row = add_adapter_version(session, add_adapter(session, add_tenant(session)))
        row.status = AdapterStatus.VALIDATING
        session.flush()
        row.status = AdapterStatus.READY
        row.rank = 16
        row.target_modules = ["q_proj", "v_proj"]
        row.size_bytes = 5 * 2**40
        row.sha256 = "a" * 64
        row_id = row.id
    with make_session() as session:
        stored = session.get(AdapterVersion, row_id)
        assert stored.status == "ready"
        assert stored.target_modules == ["q_proj", "v_proj"]
        assert stored.size_bytes == 5 * 2**40
        assert stored.updated_at >= stored.created_at


def test_unknown_status_is_rejected(make_session):
    def build(session):
        add_adapter_version(session, add_adapter(session, add_tenant(session)), status="done")

    _assert_rejected(make_session, build)


def test_failed_version_needs_a_reason(make_session):
    def without_reason(session):
        adapter = add_adapter(session, add_tenant(session))
        add_adapter_version(session, adapter, status=AdapterStatus.FAILED)

    _assert_rejected(make_session, without_reason)
    with make_session.begin() as session:
        adapter = add_adapter(session, add_tenant(session))
        add_adapter_version(
            session, adapter, status=AdapterStatus.FAILED, failure_reason="rank 0 in config"
        )


@pytest.mark.parametrize("field", ["version", "rank"])
def test_version_and_rank_must_be_positive(make_session, field):
    def build(session):
        add_adapter_version(session, add_adapter(session, add_tenant(session)), **{field: 0})

    _assert_rejected(make_session, build)


def test_duplicate_usage_request_id_is_rejected(make_session):
    with make_session.begin() as session:
        tenant = add_tenant(session)
        session.add(usage_record(tenant, request_id="req-1"))
        tenant_id = tenant.id

    _assert_rejected(
        make_session,
        lambda s: s.add(usage_record(s.get(Tenant, tenant_id), request_id="req-1")),
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt_tokens": -1},
        {"prompt_tokens": 3, "cached_prompt_tokens": 4},
        {"completion_tokens": -1},
        {"latency_ms": -1},
        {"cost_micro_usd": -1},
    ],
)
def test_usage_counts_are_checked(make_session, fields):
    with make_session.begin() as session:
        tenant_id = add_tenant(session).id
    _assert_rejected(
        make_session, lambda s: s.add(usage_record(s.get(Tenant, tenant_id), **fields))
    )


def test_usage_needs_an_existing_tenant(make_session):
    def orphan(session):
        record = usage_record(add_tenant(session))
        record.tenant_id = "0" * 32
        session.add(record)

    _assert_rejected(make_session, orphan)


def test_usage_keeps_large_costs_exactly(make_session):
    big = 2**62 + 12345
    with make_session.begin() as session:
        session.add(usage_record(add_tenant(session), request_id="big", cost_micro_usd=big))
    with make_session() as session:
        stored = session.scalars(select(UsageRecord).where(UsageRecord.request_id == "big")).one()
        assert stored.cost_micro_usd == big
