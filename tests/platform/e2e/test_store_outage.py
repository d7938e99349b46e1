"""A store outage: the S3 server stops mid-run, then comes back.

Only the requests whose adapters are not resident fail (503 ``adapter_unavailable``, or an
SSE error event when streamed), nothing is billed for them, resident adapters and the base
model keep serving the same greedy tokens, and once the store is back the next request for
a failed adapter loads it again: no platform restart. An adapter evicted from the device
but still in host RAM is resident too: it comes back to the device without the store.

The store is a private moto server (the session-wide one is shared with other tests); moto
keeps its objects in process, so the server started again on the same port has them all.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from botocore.exceptions import EndpointConnectionError
from sqlalchemy import select

from loramux.engine import Engine, EngineConfig, SamplingParams
from loramux.platform.db.models import AdapterStatus, AdapterVersion
from loramux.platform.settings import Settings
from loramux.platform.store.s3 import S3ObjectStore, make_s3_client
from tests.fixtures.moto_server import RestartableMotoServer
from tests.platform.e2e.conftest import Platform, Tenant, start_platform

PROMPT = "The capital of France is"
MAX_TOKENS = 8
KV_CACHE_BYTES = 32 << 20
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
RANK = 8
TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")
REQUEST_TIMEOUT_S = 30  # a request that stalls on the dead store fails the test, not hangs it


@pytest.fixture
def adapters(make_adapter, tiny_model_dir) -> dict[str, Path]:
    return {
        name: make_adapter(tiny_model_dir, rank=RANK, targets=TARGETS, seed=seed, std=0.1)
        for seed, name in enumerate(("resident", "cold", "cold-streamed"), start=11)
    }


@pytest.fixture
def reference(tiny_model_dir, adapters) -> Engine:
    """The engine itself on the same weights and adapter files: what serving must give."""
    engine = Engine(EngineConfig(model=str(tiny_model_dir), kv_cache_bytes=KV_CACHE_BYTES))
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    return engine


def _settings(
    tmp_path, tiny_model_dir, postgres_database_url, redis_url, server, bucket, **extra
) -> Settings:
    return Settings(
        data_dir=tmp_path,
        model=str(tiny_model_dir),
        database_url=postgres_database_url,
        redis_url=redis_url,
        **server.endpoint.store_settings(bucket),
        kv_cache_bytes=KV_CACHE_BYTES,
        **extra,
    )


@pytest.fixture
def platform(
    tmp_path, tiny_model_dir, postgres_database_url, redis_url, store_server, bucket
) -> Iterator[Platform]:
    settings = _settings(
        tmp_path, tiny_model_dir, postgres_database_url, redis_url, store_server, bucket
    )
    with start_platform(settings) as running:
        yield running


@pytest.fixture
def one_adapter_platform(
    tmp_path, tiny_model_dir, postgres_database_url, redis_url, store_server, bucket, reference
) -> Iterator[Platform]:
    """Device room for one rank-8 adapter: loading a second moves the first to host RAM."""
    settings = _settings(
        tmp_path,
        tiny_model_dir,
        postgres_database_url,
        redis_url,
        store_server,
        bucket,
        adapter_device_bytes=RANK * reference.arena.bytes_per_row,
    )
    with start_platform(settings) as running:
        yield running


# --- helpers ----------------------------------------------------------------------------------


def upload(platform: Platform, tenant: Tenant, name: str, adapter_dir: Path) -> str:
    """Upload over HTTP; returns the engine's name for the new version (its id)."""
    files = [("files", (f, (adapter_dir / f).read_bytes())) for f in ADAPTER_FILES]
    response = httpx.post(
        f"{platform.url}/v1/adapters",
        data={"name": name},
        files=files,
        headers=tenant.headers,
        timeout=REQUEST_TIMEOUT_S,
    )
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["status"] == AdapterStatus.READY.value, body
    with platform.context.sessions() as session:
        version = session.scalars(
            select(AdapterVersion).where(AdapterVersion.adapter_id == body["id"])
        ).one()
        return version.id


def complete(platform: Platform, tenant: Tenant, model: str) -> httpx.Response:
    return httpx.post(
        f"{platform.url}/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0},
        headers=tenant.headers,
        timeout=REQUEST_TIMEOUT_S,
    )


def stream(platform: Platform, tenant: Tenant, model: str) -> list[dict | str]:
    """The SSE events of a streamed completion: parsed JSON, or the final "[DONE]"."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    events: list[dict | str] = []
    with httpx.stream(
        "POST",
        f"{platform.url}/v1/completions",
        json=body,
        headers=tenant.headers,
        timeout=REQUEST_TIMEOUT_S,
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def stream_refused(platform: Platform, tenant: Tenant, model: str) -> httpx.Response:
    """A streamed completion that is refused before its stream starts (not a 200)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True}
    return httpx.post(
        f"{platform.url}/v1/completions",
        json=body,
        headers=tenant.headers,
        timeout=REQUEST_TIMEOUT_S,
    )


def streamed_text(events: list[dict | str]) -> str:
    return "".join(
        choice["text"]
        for event in events
        if isinstance(event, dict)
        for choice in event.get("choices", [])
    )


def served(response: httpx.Response, expected) -> None:
    """A 200 carrying exactly the reference engine's greedy output."""
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["text"] == expected.text
    assert body["choices"][0]["finish_reason"] == expected.finish_reason
    assert body["usage"]["completion_tokens"] == len(expected.token_ids)


def residency(platform: Platform) -> dict[str, str]:
    """The engine's tiers, asked through its command queue (only its thread touches it)."""
    return asyncio.run(platform.context.engine.adapter_residency())


def usage_totals(platform: Platform, tenant: Tenant) -> dict:
    response = httpx.get(f"{platform.url}/v1/usage", headers=tenant.headers)
    assert response.status_code == 200, response.text
    return response.json()["totals"]


def expected_outputs(reference: Engine, models, base: str) -> dict:
    """Each model's greedy output on the reference engine (the base model: no adapter)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    return {
        model: reference.generate([PROMPT], params, adapters=[None if model == base else model])[0]
        for model in models
    }


def store_answers(server: RestartableMotoServer) -> bool:
    """Whether the S3 endpoint answers at all (one try, no retries)."""
    endpoint = server.endpoint
    probe = make_s3_client(
        endpoint_url=endpoint.endpoint_url,
        region=endpoint.region,
        access_key_id=endpoint.access_key_id,
        secret_access_key=endpoint.secret_access_key,
        connect_timeout=2,
        read_timeout=5,
        max_attempts=1,
    )
    try:
        probe.list_buckets()
    except EndpointConnectionError:
        return False
    return True


# --- the test ---------------------------------------------------------------------------------


def test_store_outage_fails_only_cold_adapters_and_serving_recovers(
    platform, store_server, bucket, adapters, reference
):
    assert isinstance(platform.context.store, S3ObjectStore)
    assert platform.context.store.endpoint_url == store_server.endpoint.endpoint_url
    tenant = platform.new_tenant(input_price_per_mtok=1.0, output_price_per_mtok=4.0)
    names = {name: upload(platform, tenant, name, path) for name, path in adapters.items()}
    base = platform.base_model
    expected = expected_outputs(reference, (base, *adapters), base)
    # every adapter changes the output: a request served without its adapter cannot pass
    assert len({out.text for out in expected.values()}) == len(expected), expected

    # --- before the outage: only "resident" was ever requested ------------------------------
    served(complete(platform, tenant, "resident"), expected["resident"])
    assert residency(platform) == {names["resident"]: "device"}
    billed = 1

    sentinel = f"sentinel-{uuid.uuid4().hex}"
    store_server.endpoint.client().put_object(Bucket=bucket, Key=sentinel, Body=b"still here")

    # --- the outage ------------------------------------------------------------------------
    store_server.stop()
    assert not store_answers(store_server)

    # The resident adapter and the base model serve the same greedy tokens as before.
    served(complete(platform, tenant, "resident"), expected["resident"])
    served(complete(platform, tenant, base), expected[base])
    billed += 2

    # A never-requested adapter fails fast, naming the store as the cause.
    started = time.monotonic()
    failed = complete(platform, tenant, "cold")
    failed_after_s = time.monotonic() - started
    assert failed.status_code == 503, failed.text
    error = failed.json()["error"]
    assert error["code"] == "adapter_unavailable", error
    # The tenant reads its adapter's name and what to do, never the store's internals.
    assert "'cold'" in error["message"] and "try again" in error["message"], error
    assert store_server.endpoint.endpoint_url not in error["message"], error
    assert "sha256/" not in error["message"] and names["cold"] not in error["message"], error
    assert failed_after_s < 20, failed_after_s  # the S3 client's few retries, not a stall

    # Streamed: the same 503 before the stream starts (it failed before any token), no hang.
    refused = stream_refused(platform, tenant, "cold-streamed")
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "adapter_unavailable", refused.text
    assert refused.json()["error"]["type"] == "server_error", refused.text

    assert residency(platform) == {
        names["resident"]: "device",
        names["cold"]: "failed",
        names["cold-streamed"]: "failed",
    }
    # The failure was the store's, not the adapters': they are still ready.
    listed = httpx.get(f"{platform.url}/v1/adapters", headers=tenant.headers)
    assert listed.status_code == 200, listed.text
    assert {a["name"]: a["status"] for a in listed.json()["data"]} == {
        name: AdapterStatus.READY.value for name in adapters
    }
    # Nothing half-done: the failed requests were not metered.
    assert usage_totals(platform, tenant)["requests"] == billed

    # --- the store comes back on the same port, the platform is not restarted -------------
    store_server.start()
    assert store_server.endpoint.endpoint_url == platform.context.store.endpoint_url
    kept = store_server.endpoint.client().get_object(Bucket=bucket, Key=sentinel)
    assert kept["Body"].read() == b"still here"

    # The next request for each failed adapter loads it again.
    served(complete(platform, tenant, "cold"), expected["cold"])
    events = stream(platform, tenant, "cold-streamed")
    assert events[-1] == "[DONE]"
    assert not [e for e in events if isinstance(e, dict) and "error" in e], events
    assert streamed_text(events) == expected["cold-streamed"].text
    served(complete(platform, tenant, "resident"), expected["resident"])
    billed += 3

    assert residency(platform) == {name: "device" for name in names.values()}
    totals = usage_totals(platform, tenant)
    assert totals["requests"] == billed
    assert totals["completion_tokens"] == sum(
        len(expected[m].token_ids)
        for m in ("resident", "resident", base, "cold", "cold-streamed", "resident")
    )


def test_an_adapter_in_host_ram_serves_through_a_store_outage(
    one_adapter_platform, store_server, adapters, reference
):
    platform = one_adapter_platform
    tenant = platform.new_tenant(input_price_per_mtok=1.0, output_price_per_mtok=4.0)
    names = {name: upload(platform, tenant, name, adapters[name]) for name in ("cold", "resident")}
    expected = expected_outputs(reference, names, platform.base_model)

    # "cold" is loaded, then moved to host RAM to make room for "resident".
    served(complete(platform, tenant, "cold"), expected["cold"])
    served(complete(platform, tenant, "resident"), expected["resident"])
    assert residency(platform) == {names["cold"]: "host", names["resident"]: "device"}

    store_server.stop()
    assert not store_answers(store_server)
    # Both come back to the device from host RAM, in turn: the store is never needed.
    served(complete(platform, tenant, "cold"), expected["cold"])
    assert residency(platform) == {names["cold"]: "device", names["resident"]: "host"}
    events = stream(platform, tenant, "resident")
    assert events[-1] == "[DONE]"
    assert not [e for e in events if isinstance(e, dict) and "error" in e], events
    assert streamed_text(events) == expected["resident"].text
    served(complete(platform, tenant, "cold"), expected["cold"])

    totals = usage_totals(platform, tenant)
    assert totals["requests"] == 5
    assert totals["completion_tokens"] == sum(
        len(expected[m].token_ids) for m in ("cold", "resident", "cold", "resident", "cold")
    )
