"""A tensor-parallel engine in the production topology: ``loramux engine`` over two CPU
ranks (gloo) beside a one-process engine, behind a platform in remote mode (PostgreSQL,
Redis, S3).

Streams run on both engines; the tensor-parallel engine's second rank is SIGKILLed. Its
streams end with the error event (``engine_error``) after what they delivered, each token
billed once; the engine leaves the registry and its process exits with status 1 within
seconds; the other engine's streams finish, and new requests are served by it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from loramux.platform.settings import Settings
from tests.fixtures.polling import eventually
from tests.platform.e2e.conftest import start_platform
from tests.platform.e2e.engine_processes import engine_processes
from tests.platform.e2e.outage_calls import Call, assert_billed_as_delivered, usage_rows

SECRET = "tensor-parallel-secret"
HEARTBEAT_S = 1.0
LONG = 480  # tokens: seconds of the tiny model, well past the kill
ENGINE_END_S = 20  # the engine's process must be gone within this after its rank


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in path.read_text().split()]


def _running_on(url: str) -> int:
    stats = httpx.get(
        f"{url}/v1/engine/stats", headers={"Authorization": f"Bearer {SECRET}"}, timeout=10
    )
    assert stats.status_code == 200, stats.text
    return stats.json()["running_requests"]


@pytest.fixture
def topology(tmp_path, tiny_model_dir, postgres_database_url, redis_url, s3_endpoint, s3_bucket):
    store = s3_endpoint.store_settings(s3_bucket)
    registry = redis_url.rsplit("/", 1)[0] + "/7"
    engine_env = {
        "LORAMUX_MODEL": str(tiny_model_dir),
        **{f"LORAMUX_{name.upper()}": value for name, value in store.items()},
        "LORAMUX_REDIS_URL": registry,
        "LORAMUX_ENGINE_DEVICE": "cpu",
        "LORAMUX_ENGINE_KV_CACHE_BYTES": str(32 << 20),
        "LORAMUX_ENGINE_SERVER_SECRET": SECRET,
        "LORAMUX_ENGINE_SERVER_HEARTBEAT_S": str(HEARTBEAT_S),
    }
    settings = Settings(
        data_dir=tmp_path / "platform",
        model=str(tiny_model_dir),
        database_url=postgres_database_url,
        redis_url=registry,
        **store,
        engine_mode="remote",
        engine_secret=SECRET,
        engine_heartbeat_s=HEARTBEAT_S,
        usage_journal_interval_s=0.2,
    )
    parallel_env = {**engine_env, "LORAMUX_ENGINE_TENSOR_PARALLEL_SIZE": "2"}
    with (
        engine_processes(["engine-tp"], parallel_env, tmp_path) as parallel,
        engine_processes(["engine-one"], engine_env, tmp_path) as single,
        start_platform(settings) as platform,
    ):
        eventually(lambda: len(platform.context.engine.engines()) == 2, "both engines routed")
        yield platform, parallel["engine-tp"], single["engine-one"]


def test_a_killed_rank_ends_its_engine_and_the_other_engine_serves(topology):
    platform, parallel, single = topology
    (rank,) = _children(parallel.process.pid)  # the second rank's process
    tenant = platform.new_tenant(input_price_per_mtok=1.0, output_price_per_mtok=2.0)
    calls = [Call(platform, tenant, stream=True, max_tokens=LONG) for _ in range(4)]
    threads = [call.start() for call in calls]

    def both_busy() -> bool:
        return _running_on(parallel.url) > 0 and _running_on(single.url) > 0

    eventually(both_busy, "streams on both engines", 60, 0.02)  # the load bound spreads them
    on_parallel = _running_on(parallel.url)
    os.kill(rank, signal.SIGKILL)
    killed = time.monotonic()
    assert parallel.process.wait(timeout=ENGINE_END_S) == 1, parallel.log_tail()
    ended_after = time.monotonic() - killed
    assert "tensor-parallel rank 1 (exit code -9)" in parallel.log.read_text()
    # Sent at once: the registry no longer lists it (it withdrew), so the other serves.
    after = [Call(platform, tenant, stream=stream).run() for stream in (False, True)]
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive(), "a call hung"
    lost = [call for call in calls if call.error is not None]
    assert len(lost) == on_parallel, (calls, on_parallel)
    for call in lost:  # the error event, after what was delivered
        assert call.status == 200 and call.broken is None, call
        assert (call.error["type"], call.error["code"]) == ("server_error", "engine_error")
    for call in calls:
        if call.error is None:
            assert (call.delivered, call.finish_reason) == (LONG, "length"), call
    for call in after:
        assert call.status == 200 and call.delivered == call.max_tokens, call
    assert [r.engine_id for r in platform.context.engine.engines()] == ["engine-one"]
    eventually(
        lambda: (
            all(row.final for row in usage_rows(platform, tenant))
            and len(usage_rows(platform, tenant)) == len([c for c in calls + after if c.delivered])
        ),
        "every usage record written",
        30,
    )
    assert_billed_as_delivered(platform, tenant, calls + after)
    print(f"engine ended {ended_after:.1f} s after its rank; {len(lost)} streams failed")
