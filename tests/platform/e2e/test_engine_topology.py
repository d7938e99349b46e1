"""Production topology on one machine, without Docker: two ``loramux engine`` processes
(tiny model), a platform on real PostgreSQL and Redis with ``LORAMUX_ENGINE_MODE=remote``,
a real Celery worker validating uploads, and an S3-compatible server (moto).

``engine-a`` is one engine over two CPU processes (tensor parallelism, gloo between its
ranks); ``engine-b`` is one process.

200 requests over 40 adapters: each adapter's requests stick to one engine, the adapters
(and so the load) spread over both. Then ``engine-a``'s second rank is killed (SIGKILL)
while streams run on both engines: the engine is down, its process exits with status 1
within seconds (a whole engine process killed outright is ``test_topology_outages``'s);
only its in-flight requests fail, each with an error naming the engine, each delivered
token billed once; the others finish, and new requests (for its adapters too) go to the
survivor at once.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from loramux.platform.db.models import Adapter, AdapterVersion
from loramux.platform.settings import Settings
from tests.fixtures.polling import eventually
from tests.fixtures.processes import child_pids
from tests.platform.e2e.conftest import Platform, Tenant, start_platform
from tests.platform.e2e.engine_processes import EngineProcess, engine_processes
from tests.platform.tasks.worker_process import running_worker

SECRET = "topology-test-secret"
HEARTBEAT_S = 2.0  # the default: records live 6 s, through the stalls 2 busy cores give
NUM_ADAPTERS = 40
NUM_REQUESTS = 200
CONCURRENCY = 8
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
TIMEOUT_S = 120
ENGINE_END_S = 20  # engine-a's process is gone within this after its rank


def _redis_db(redis_url: str, db: int) -> str:
    return redis_url.rsplit("/", 1)[0] + f"/{db}"


@dataclass
class Topology:
    platform: Platform
    engines: dict[str, EngineProcess]
    tenant: Tenant | None = None
    adapters: list[str] = field(default_factory=list)


@pytest.fixture
def topology(tmp_path, tiny_model_dir, postgres_database_url, redis_url, s3_endpoint, s3_bucket):
    store = s3_endpoint.store_settings(s3_bucket)
    shared = {  # what the platform, the engines and the worker all need
        "LORAMUX_MODEL": str(tiny_model_dir),
        **{f"LORAMUX_{name.upper()}": value for name, value in store.items()},
        "LORAMUX_REDIS_URL": _redis_db(redis_url, 5),  # limits and the engine registry
    }
    engine_env = {
        **shared,
        "LORAMUX_ENGINE_DEVICE": "cpu",
        "LORAMUX_ENGINE_KV_CACHE_BYTES": str(32 << 20),
        "LORAMUX_ENGINE_SERVER_SECRET": SECRET,
        "LORAMUX_ENGINE_SERVER_HEARTBEAT_S": str(HEARTBEAT_S),
    }
    broker = _redis_db(redis_url, 6)
    worker_env = {
        **shared,
        "LORAMUX_CELERY_BROKER_URL": broker,
        "LORAMUX_DATABASE_URL": postgres_database_url,
        "LORAMUX_DATA_DIR": str(tmp_path / "worker"),
    }
    settings = Settings(
        data_dir=tmp_path / "platform",
        model=str(tiny_model_dir),
        database_url=postgres_database_url,
        redis_url=shared["LORAMUX_REDIS_URL"],
        celery_broker_url=broker,
        **store,
        engine_mode="remote",
        engine_secret=SECRET,
        engine_heartbeat_s=HEARTBEAT_S,
    )
    parallel_env = {**engine_env, "LORAMUX_ENGINE_TENSOR_PARALLEL_SIZE": "2"}
    with (
        engine_processes(["engine-a"], parallel_env, tmp_path) as parallel,
        engine_processes(["engine-b"], engine_env, tmp_path) as single,
        running_worker({**os.environ, **worker_env}, tmp_path / "worker.log"),
        start_platform(settings) as platform,
    ):
        eventually(lambda: len(platform.context.engine.engines()) == 2, "both engines routed")
        yield Topology(platform, {**parallel, **single})


def _upload_all(topology: Topology, adapter_dirs: list[Path]) -> None:
    platform, tenant = topology.platform, topology.tenant
    for i, folder in enumerate(adapter_dirs):
        name = f"a{i:02d}"
        files = [("files", (f, (folder / f).read_bytes())) for f in ADAPTER_FILES]
        sent = httpx.post(
            f"{platform.url}/v1/adapters",
            data={"name": name},
            files=files,
            headers=tenant.headers,
            timeout=TIMEOUT_S,
        )
        assert sent.status_code == 202, sent.text  # queued: the worker validates
        topology.adapters.append(name)

    def all_ready() -> bool:
        listed = httpx.get(f"{platform.url}/v1/adapters", headers=tenant.headers).json()["data"]
        statuses = {a["name"]: a["status"] for a in listed}
        assert "failed" not in statuses.values(), statuses
        return len(statuses) == NUM_ADAPTERS and set(statuses.values()) == {"ready"}

    eventually(all_ready, "the worker to validate every upload", timeout_s=180)


def _complete(platform: Platform, tenant: Tenant, model: str) -> dict:
    response = httpx.post(
        f"{platform.url}/v1/completions",
        json={"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0},
        headers=tenant.headers,
        timeout=TIMEOUT_S,
    )
    assert response.status_code == 200, response.text
    return response.json()


@dataclass
class StreamResult:
    request_id: str | None = None
    tokens: int = 0  # tokens the client received (logprobs.tokens of every chunk)
    finish_reason: str | None = None
    error: str | None = None


def _stream(
    platform: Platform, tenant: Tenant, model: str, max_tokens: int, started
) -> StreamResult:
    result = StreamResult()
    announced = False
    body = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "logprobs": 0,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST",
        f"{platform.url}/v1/completions",
        json=body,
        headers=tenant.headers,
        timeout=TIMEOUT_S,
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            data = line.removeprefix("data: ") if line.startswith("data: ") else None
            if data is None or data == "[DONE]":
                continue
            event = json.loads(data)
            if "error" in event:
                result.error = event["error"]["message"]
                continue
            result.request_id = event["id"]
            choice = event["choices"][0]
            result.tokens += len((choice.get("logprobs") or {}).get("tokens") or [])
            result.finish_reason = choice.get("finish_reason") or result.finish_reason
            if result.tokens >= 2 and not announced:
                started.release()  # once per stream
                announced = True
    return result


def test_two_engines_behind_one_platform(topology, make_adapter, tiny_model_dir):
    platform = topology.platform
    topology.tenant = platform.new_tenant()
    folders = [
        make_adapter(tiny_model_dir, rank=2, targets=("q_proj", "v_proj"), seed=500 + i)
        for i in range(NUM_ADAPTERS)
    ]
    _upload_all(topology, folders)
    client = platform.context.engine

    # --- 200 requests over 40 adapters --------------------------------------------------
    models = [topology.adapters[i % NUM_ADAPTERS] for i in range(NUM_REQUESTS)]
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        bodies = list(pool.map(lambda m: _complete(platform, topology.tenant, m), models))
    assert all(b["usage"]["completion_tokens"] == 4 for b in bodies)
    engine_of = _engine_names(platform)  # adapter name -> version id the engines know
    routed = Counter(client.routed)
    per_adapter = {
        name: Counter({e: n for (e, a), n in routed.items() if a == engine_of[name]})
        for name in topology.adapters
    }
    assert sum(sum(c.values()) for c in per_adapter.values()) == NUM_REQUESTS
    # An adapter's requests stick to an engine holding it: only its first request found
    # none, and the rest went to one unless the load bound (LORAMUX_ROUTING_LOAD_FACTOR)
    # sent them elsewhere.
    decisions = client.decisions
    assert decisions["cold"] == NUM_ADAPTERS, decisions
    assert decisions["affine"] + decisions["spill"] == NUM_REQUESTS - NUM_ADAPTERS
    assert decisions["spill"] <= 0.1 * NUM_REQUESTS, decisions
    at_home = sum(c.most_common(1)[0][1] for c in per_adapter.values())
    assert at_home >= 0.85 * NUM_REQUESTS, per_adapter
    per_engine = Counter()
    for counts in per_adapter.values():
        per_engine.update(counts)
    assert set(per_engine) == {"engine-a", "engine-b"}, per_engine
    assert min(per_engine.values()) >= 0.3 * NUM_REQUESTS, per_engine  # the load spreads
    # Each engine process holds the adapters routed to it, and served tokens.
    for engine_id, engine in topology.engines.items():
        held = set(_residency(engine))
        home = {engine_of[n] for n, c in per_adapter.items() if c.most_common(1)[0][0] == engine_id}
        assert home <= held, (engine_id, home - held)
        assert _generated_tokens(engine) > 0

    # --- kill a rank of one engine while streams run on both ---------------------------------
    victim, survivor = topology.engines["engine-a"], topology.engines["engine-b"]
    (rank,) = child_pids(victim.process.pid)  # engine-a's second rank
    streams = 12
    started = threading.Semaphore(0)
    with ThreadPoolExecutor(streams) as pool:
        futures = [
            pool.submit(_stream, platform, topology.tenant, topology.adapters[i], 400, started)
            for i in range(streams)
        ]
        for _ in range(streams):  # every stream has tokens: all are in flight somewhere
            assert started.acquire(timeout=TIMEOUT_S), "a stream never started"
        os.kill(rank, signal.SIGKILL)
        killed = time.monotonic()
        # The engine is down for good: its process leaves the registry and exits, status 1.
        assert victim.process.wait(timeout=ENGINE_END_S) == 1, victim.log_tail()
        ended_after = time.monotonic() - killed
        results = [f.result(timeout=TIMEOUT_S) for f in futures]
    assert "tensor-parallel rank 1 (exit code -9)" in victim.log.read_text()
    failed = [r for r in results if r.error is not None]
    finished = [r for r in results if r.error is None]
    assert failed and finished, results  # both engines had streams in flight
    for r in failed:
        assert "engine-a" in r.error and "stopped" in r.error, r.error
        assert r.tokens >= 2
    # The others ran on the survivor (the victim is dead) to their last token.
    assert all(r.finish_reason == "length" and r.tokens == 400 for r in finished)

    # --- new requests go to the survivor at once, for the dead engine's adapters too -------
    for name in topology.adapters[:10]:
        assert _complete(platform, topology.tenant, name)["usage"]["completion_tokens"] == 4
    eventually(lambda: len(client.engines()) == 1, "the dead engine to leave the registry")
    assert [r.engine_id for r in client.engines()] == [survivor.engine_id]

    # --- billing: every delivered token once, failed streams included ----------------------
    rows = platform.admin_usage(tenant_id=topology.tenant.id, group_by="request").json()["rows"]
    by_request = {row["request_id"]: row for row in rows}
    for r in results:
        assert by_request[r.request_id]["completion_tokens"] == r.tokens, r
    assert len(rows) == NUM_REQUESTS + streams + 10
    total = platform.admin_usage(tenant_id=topology.tenant.id).json()["totals"]
    expected = 4 * NUM_REQUESTS + sum(r.tokens for r in results) + 4 * 10
    assert total["completion_tokens"] == expected
    print(f"engine-a exited {ended_after:.1f} s after its rank; {len(failed)} streams failed")


def _engine_names(platform: Platform) -> dict[str, str]:
    """Tenant adapter name -> the version id the engines know it by."""
    with platform.context.sessions() as session:
        rows = session.execute(
            select(Adapter.name, AdapterVersion.id).join(AdapterVersion.adapter)
        ).all()
    return dict(rows)


def _residency(engine: EngineProcess) -> dict[str, str]:
    response = httpx.get(
        f"{engine.url}/v1/engine/residency", headers={"Authorization": f"Bearer {SECRET}"}
    )
    assert response.status_code == 200, response.text
    return response.json()


def _generated_tokens(engine: EngineProcess) -> float:
    for line in httpx.get(f"{engine.url}/metrics").text.splitlines():
        if line.startswith("loramux_generated_tokens_total "):
            return float(line.split()[1])
    raise AssertionError("no loramux_generated_tokens_total in the engine's metrics")
