"""record_usage: one usage row per request id, however often it is called."""

from __future__ import annotations

from sqlalchemy import func, select

from loramux.platform.db.models import Tenant, UsageRecord
from loramux.platform.db.usage import record_usage
from tests.platform.db.factories import add_adapter, add_adapter_version, add_tenant, usage_record


def test_first_write_wins_and_repeats_are_ignored(make_session):
    with make_session.begin() as session:
        tenant_id = add_tenant(session).id

    with make_session.begin() as session:
        tenant = session.get(Tenant, tenant_id)
        assert record_usage(session, usage_record(tenant, request_id="req-1", cost_micro_usd=7))
    with make_session.begin() as session:
        tenant = session.get(Tenant, tenant_id)
        repeat = usage_record(tenant, request_id="req-1", cost_micro_usd=999)
        assert not record_usage(session, repeat)

    with make_session() as session:
        rows = session.scalars(select(UsageRecord)).all()
        assert [(r.request_id, r.cost_micro_usd) for r in rows] == [("req-1", 7)]
        assert len(rows[0].id) == 32


def test_records_adapter_and_defaults(make_session):
    with make_session.begin() as session:
        tenant = add_tenant(session)
        adapter = add_adapter(session, tenant)
        version = add_adapter_version(session, adapter)
        record = usage_record(
            tenant,
            request_id="req-2",
            adapter_id=adapter.id,
            adapter_version_id=version.id,
            finish_reason="stop",
            created_at=None,
        )
        assert record_usage(session, record)
        ids = (adapter.id, version.id)

    with make_session() as session:
        stored = session.scalars(select(UsageRecord)).one()
        assert (stored.adapter_id, stored.adapter_version_id) == ids
        assert stored.finish_reason == "stop"
        assert stored.created_at.tzinfo is not None
        assert session.scalar(select(func.count()).select_from(UsageRecord)) == 1
