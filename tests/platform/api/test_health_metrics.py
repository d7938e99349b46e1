"""Readiness, Prometheus metrics, API-key last use and the startup push of tenant shares."""

from __future__ import annotations

import io
import re
import shutil
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, update
from sqlalchemy.engine import make_url
from sqlalchemy.orm import sessionmaker

from loramux.platform.app import create_app
from loramux.platform.context import build_context
from loramux.platform.db.models import ApiKey
from loramux.platform.db.types import utc_now
from loramux.platform.settings import Settings
from loramux.platform.store import StoreUnavailable
from tests.fixtures.services import private_postgres

# --- /healthz and /readyz ------------------------------------------------------------------


def test_healthz_is_liveness_only(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_health_is_healthz_under_vllms_name_open_to_anyone(client):
    # GuideLLM and other vLLM clients check GET /health before their first request.
    response = client.get("/health")
    assert response.status_code == 200
    assert response.json() == client.get("/healthz").json() == {"status": "ok"}
    assert set(client.get("/openapi.json").json()["paths"]["/health"]["get"]["responses"]) == {
        "200"
    }


def test_readyz_reports_every_check_ok(client):
    response = client.get("/readyz")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "ready"
    assert body["checks"] == {
        "database": {"status": "ok"},
        "store": {"status": "ok"},
        "engine": {"status": "ok"},
    }


def test_readyz_names_a_broken_store(client, context, monkeypatch):
    def unavailable(key: str) -> bool:
        raise StoreUnavailable("object store at s3://nowhere failed: connection refused")

    monkeypatch.setattr(context.store, "exists", unavailable)
    response = client.get("/readyz")
    assert response.status_code == 503, response.text
    body = response.json()
    assert body["status"] == "unavailable"
    assert body["checks"]["store"]["status"] == "failed"
    assert "store" in body["checks"]["store"]["error"]
    assert "s3://nowhere" not in response.text  # details go to the log, not to anyone asking
    assert body["checks"]["database"] == {"status": "ok"}
    assert body["checks"]["engine"] == {"status": "ok"}


def test_readyz_names_an_unreachable_database(client, context, postgres_database_url, monkeypatch):
    # The same database URL on a port nothing listens on: connecting is refused.
    unreachable = create_engine(make_url(postgres_database_url).set(host="127.0.0.1", port=1))
    monkeypatch.setattr(context, "sessions", sessionmaker(bind=unreachable))
    try:
        response = client.get("/readyz")
    finally:
        unreachable.dispose()
    assert response.status_code == 503, response.text
    checks = response.json()["checks"]
    assert checks["database"]["status"] == "failed"
    assert checks["database"]["error"]
    assert checks["store"] == {"status": "ok"}


def test_readyz_fails_when_the_engine_is_stopped(context):
    app = create_app(context)
    with TestClient(app) as client:
        assert client.get("/readyz").status_code == 200
        client.portal.call(context.engine.stop)
        response = client.get("/readyz")
    assert response.status_code == 503, response.text
    assert response.json()["checks"]["engine"]["status"] == "failed"


# --- /metrics -------------------------------------------------------------------------------


def test_metrics_serve_engine_and_http_metrics_without_auth(client):
    assert client.get("/healthz").status_code == 200
    assert client.get("/admin/tenants").status_code == 401

    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    # The engine's registry...
    assert "loramux_kv_blocks_total" in text
    assert "loramux_generated_tokens_total" in text
    # What says memory is the limit: preemptions, device evictions, re-loads, room waits.
    assert "loramux_preemptions_total 0.0" in text
    assert "loramux_adapter_reloads_total 0.0" in text
    assert "loramux_adapter_room_wait_steps_total 0.0" in text
    # ...and the platform's, by route template and status code.
    assert 'loramux_http_requests_total{method="GET",route="/healthz",status="200"} 1.0' in text
    assert (
        'loramux_http_requests_total{method="GET",route="/admin/tenants",status="401"} 1.0' in text
    )
    assert 'loramux_http_request_duration_seconds_count{method="GET",route="/healthz"}' in text


def test_metrics_label_routes_by_template_not_path(client, admin):
    client.get("/admin/tenants/abc", headers=admin)
    client.get("/admin/tenants/def", headers=admin)
    client.get("/no/such/path")
    text = client.get("/metrics").text
    assert (
        'loramux_http_requests_total{method="GET",route="/admin/tenants/{tenant_id}",'
        'status="404"} 2.0' in text
    )
    assert "/admin/tenants/abc" not in text
    assert 'route="<unmatched>",status="404"' in text


def _dependency_errors(client) -> dict[str, float]:
    text = client.get("/metrics").text
    found = re.findall(r'^loramux_dependency_errors_total\{dependency="(\w+)"\} (\S+)$', text, re.M)
    return {name: float(value) for name, value in found}


def test_metrics_count_what_could_not_reach_the_database_and_the_store(tmp_path, tiny_model_dir):
    """Issue 15: the platform's /metrics had no database, Redis or store errors. A
    PostgreSQL of the test's own is stopped; the local store's temp folder is a file."""
    with private_postgres() as database:
        settings = Settings(
            data_dir=tmp_path,
            model=str(tiny_model_dir),
            database_url=database.url,
            admin_token=None,
        )
        context = build_context(settings, log=lambda _: None)
        with TestClient(create_app(context)) as client:
            before = _dependency_errors(client)

            tmp = context.store.root / "tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text("not a directory")
            with pytest.raises(StoreUnavailable):
                context.store.put_stream(io.BytesIO(b"x"))
            tmp.unlink()

            database.stop()
            unready = client.get("/readyz")
            database.start()
            after = _dependency_errors(client)
        context.sessions.kw["bind"].dispose()

    assert before == {"database": 0.0, "redis": 0.0, "store": 0.0}
    assert unready.status_code == 503
    assert after["store"] == 1.0
    assert after["database"] >= 1.0
    assert after["redis"] == 0.0  # no Redis configured: nothing to miss


def test_each_app_has_its_own_platform_registry(context):
    first, second = create_app(context), create_app(context)
    assert first.state.platform_metrics.registry is not second.state.platform_metrics.registry


# --- API keys: last use -----------------------------------------------------------------------


def _key_row(client, admin, tenant_id: str) -> dict:
    keys = client.get(f"/admin/tenants/{tenant_id}/api-keys", headers=admin)
    assert keys.status_code == 200, keys.text
    (row,) = keys.json()
    return row


def test_api_key_last_used_is_written_at_most_once_a_minute(client, context, admin, new_tenant):
    tenant = new_tenant()
    created = client.post(f"/admin/tenants/{tenant['id']}/api-keys", headers=admin, json={})
    assert created.status_code == 201, created.text
    auth = {"Authorization": f"Bearer {created.json()['key']}"}
    assert _key_row(client, admin, tenant["id"])["last_used_at"] is None

    assert client.get("/v1/adapters", headers=auth).status_code == 200
    first = _key_row(client, admin, tenant["id"])["last_used_at"]
    assert first is not None

    assert client.get("/v1/adapters", headers=auth).status_code == 200
    assert _key_row(client, admin, tenant["id"])["last_used_at"] == first  # not rewritten

    # A use more than a minute after the recorded one is recorded.
    with context.sessions.begin() as session:
        session.execute(
            update(ApiKey)
            .where(ApiKey.tenant_id == tenant["id"])
            .values(last_used_at=utc_now() - timedelta(minutes=2))
        )
    assert client.get("/v1/adapters", headers=auth).status_code == 200
    assert _key_row(client, admin, tenant["id"])["last_used_at"] > first


# --- startup: tenant shares reach a fresh engine ---------------------------------------------


def test_a_new_app_pushes_stored_tenant_shares_to_its_engine(
    client, context, new_tenant, tmp_path, tiny_model_dir, postgres_database_url
):
    weighted = new_tenant(weight=3, priority=2)
    deleted = new_tenant(weight=5)
    admin = {"Authorization": f"Bearer {context.admin_token}"}
    assert client.delete(f"/admin/tenants/{deleted['id']}", headers=admin).status_code == 204

    settings = context.settings.model_copy(update={"data_dir": tmp_path / "restart"})
    fresh = build_context(settings, log=lambda _: None)
    try:
        scheduler = fresh.engine.engine.scheduler
        assert weighted["id"] not in scheduler.fair.weights
        with TestClient(create_app(fresh)):
            assert scheduler.fair.weights[weighted["id"]] == 3
            assert deleted["id"] not in scheduler.fair.weights
    finally:
        fresh.sessions.kw["bind"].dispose()
