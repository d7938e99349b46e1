"""Readiness tells the truth about Redis (issue 15: ``/readyz`` stayed 200 through a Redis
outage, on the platform and on an engine whose heartbeats failed). A real redis-server of
the test's own is stopped and started again."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import redis.asyncio
from fastapi.testclient import TestClient

from loramux.engine import AsyncEngine, Engine, EngineConfig
from loramux.platform.app import create_app
from loramux.platform.context import build_context
from loramux.platform.engine_fleet.registry import EngineRegistry
from loramux.platform.engine_fleet.server import EngineHost, create_engine_app
from loramux.platform.settings import Settings
from loramux.platform.store.local import LocalObjectStore
from tests.fixtures.browser import ServerThread
from tests.fixtures.polling import eventually
from tests.fixtures.services import private_redis


@pytest.mark.parametrize("fail_open", [True, False])
def test_the_platform_reports_redis_and_is_unready_only_when_it_needs_it(
    tiny_model_dir, tmp_path, fail_open
):
    with private_redis() as server:
        settings = Settings(
            data_dir=tmp_path,
            model=str(tiny_model_dir),
            admin_token=None,
            redis_url=server.url,
            limits_fail_open=fail_open,
        )
        context = build_context(settings, log=lambda _: None)
        with TestClient(create_app(context)) as client:
            before = client.get("/readyz")
            server.stop()
            during = client.get("/readyz")
            server.start()
            after = client.get("/readyz")

    assert before.status_code == 200, before.text
    assert before.json()["checks"]["redis"] == {"status": "ok"}

    redis_check = during.json()["checks"]["redis"]
    assert redis_check["status"] == "failed"
    assert redis_check["required"] is (not fail_open)
    assert str(server.port) not in during.text  # where Redis is goes to the log only
    if fail_open:  # served without rate limits: degraded, still in the load balancer
        assert during.status_code == 200, during.text
        assert during.json()["status"] == "degraded"
    else:  # limited tenants are refused: not ready
        assert during.status_code == 503, during.text
        assert during.json()["status"] == "unavailable"
    assert during.json()["checks"]["database"] == {"status": "ok"}

    assert after.status_code == 200, after.text
    assert after.json() == {
        "status": "ready",
        "checks": {name: {"status": "ok"} for name in ("database", "store", "engine", "redis")},
    }


def test_without_redis_there_is_no_redis_check(client):
    assert "redis" not in client.get("/readyz").json()["checks"]


def test_an_engine_whose_heartbeats_fail_is_not_ready(tiny_model_dir, tmp_path):
    heartbeat_s = 0.2  # records expire after 0.6 s
    with private_redis() as server:
        engine = Engine(
            EngineConfig(model=str(tiny_model_dir), kv_cache_bytes=8 << 20, dtype="float32")
        )
        host = EngineHost(
            AsyncEngine(engine),
            LocalObjectStore(tmp_path / "store"),
            EngineRegistry(redis.asyncio.from_url(server.url), heartbeat_s, namespace="ready"),
            engine_id="engine-r",
            url="",
            model_id="tiny",
            secret="s",
        )
        with ServerThread(create_engine_app(host)) as engine_server:
            url = f"{engine_server.url}/readyz"
            ready = httpx.get(url)
            server.stop()
            stopped_at = time.monotonic()
            eventually(lambda: httpx.get(url).status_code == 503, "the engine to be unready", 10)
            unready_after_s = time.monotonic() - stopped_at
            unready = httpx.get(url)
            server.start()
            eventually(lambda: httpx.get(url).status_code == 200, "the engine to be ready", 10)
            listed = asyncio.run(
                EngineRegistry(
                    redis.asyncio.from_url(server.url), heartbeat_s, namespace="ready"
                ).live()
            )

    assert ready.status_code == 200 and ready.json()["status"] == "ready", ready.text
    assert unready.json()["status"] == "unavailable"
    assert "heartbeat" in unready.json()["reason"], unready.text
    assert unready.json()["heartbeat_age_s"] > 0.6
    assert unready_after_s < 5  # within a few heartbeats of the outage, not never
    assert [record.engine_id for record in listed] == ["engine-r"]  # back in the registry
