"""Authentication holds one pooled database connection at a time.

The API-key touch writes in a short transaction of its own. It used to run while the
request's session held its connection, so each request needed two at once: a burst of as
many requests as the pool has connections took them all, waited on each other until the
pool timed out, and every one of them failed with a 503. Here the pool has one connection.
"""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import select, text

from loramux.platform.api.deps import current_tenant
from loramux.platform.db.migrate import upgrade
from loramux.platform.db.models import ApiKey, Tenant
from loramux.platform.db.session import create_engine_for, session_factory
from loramux.platform.services.api_keys import issue_api_key


@pytest.fixture
def one_connection(tmp_path):
    """Sessions on a SQLite file whose pool holds a single connection (1 s timeout), and
    a tenant's API key that was never used."""
    url = f"sqlite:///{tmp_path / 'auth.db'}"
    upgrade(url)
    engine = create_engine_for(url, pool_size=1, max_overflow=0, pool_timeout=1)
    sessions = session_factory(engine)
    with sessions.begin() as session:
        tenant = Tenant(name="acme")
        session.add(tenant)
        session.flush()
        tenant_id = tenant.id
    with sessions() as session:
        secret = issue_api_key(session, tenant_id).secret
    yield sessions, secret, tenant_id
    engine.dispose()


def test_a_request_authenticates_and_queries_on_a_single_connection(one_connection):
    sessions, secret, tenant_id = one_connection
    with sessions.begin() as session:  # as the request's SessionDep
        tenant = current_tenant(session, secret)
        assert tenant.id == tenant_id and tenant in session
        assert session.execute(text("select 1")).scalar() == 1  # the route's own queries
        assert session.get(Tenant, tenant_id) is tenant
    with sessions() as session:
        (used,) = session.execute(select(ApiKey.last_used_at)).one()
    assert used is not None  # the touch was written


def test_concurrent_requests_share_one_connection_without_timing_out(one_connection):
    sessions, secret, tenant_id = one_connection
    results: list[str] = []

    def request() -> None:
        try:
            with sessions.begin() as session:
                tenant = current_tenant(session, secret)
                session.execute(text("select 1"))
                results.append(tenant.id)
        except Exception as exc:  # a pool timeout here is the bug
            results.append(type(exc).__name__)

    threads = [threading.Thread(target=request) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == [tenant_id] * 4
