"""The production topology as plain processes through its outages, one after another,
under load: two ``loramux engine`` processes and a platform in remote mode, sharing a
PostgreSQL and a Redis of the test's own (stopped and started again) and an S3 server.

1. Redis stops while requests run (limits fail open, the default): tenants with and
   without limits are served, the platform reports ``degraded``, the engines, whose
   heartbeats fail, report unready; all of it recovers when Redis is back.
2. PostgreSQL restarts while requests run: new requests get a JSON 503
   ``database_unavailable`` and the platform is unready; running ones finish.
3. A third engine is SIGKILLed while idle and requests are sent at once: the survivors
   serve them. Then one engine is SIGKILLed while streams run on both others: its streams
   end with an error event (``engine_error``, the same envelope as a response), the others
   finish, and requests sent at once after the kill are served by the survivor.

Throughout: no status but 200 and the documented 503s, every error in the JSON envelope,
and every usage row equal to what its client received.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from loramux.platform.api.error_codes import ERROR_CODES
from loramux.platform.settings import Settings
from tests.fixtures.polling import eventually
from tests.fixtures.services import (
    RestartablePostgres,
    RestartableRedis,
    private_postgres,
    private_redis,
)
from tests.platform.e2e.conftest import Platform, Tenant, start_platform
from tests.platform.e2e.engine_processes import EngineProcess, engine_processes
from tests.platform.e2e.outage_calls import Call, assert_billed_as_delivered, usage_rows

SECRET = "outage-topology-secret"
HEARTBEAT_S = 1.0  # an engine's record lives 3 s without a heartbeat
LONG = 240  # tokens: about 7 s through platform and engine here, longer than any outage step
TIMEOUT_S = 120


@dataclass
class Topology:
    platform: Platform
    engines: dict[str, EngineProcess]
    redis: RestartableRedis
    database: RestartablePostgres


@pytest.fixture
def topology(tmp_path, tiny_model_dir, s3_endpoint, s3_bucket) -> Iterator[Topology]:
    store = s3_endpoint.store_settings(s3_bucket)
    with private_redis() as redis_server, private_postgres() as database:
        engine_env = {
            "LORAMUX_MODEL": str(tiny_model_dir),
            **{f"LORAMUX_{name.upper()}": value for name, value in store.items()},
            "LORAMUX_REDIS_URL": redis_server.url,
            "LORAMUX_ENGINE_DEVICE": "cpu",
            "LORAMUX_ENGINE_KV_CACHE_BYTES": str(32 << 20),
            "LORAMUX_ENGINE_SERVER_SECRET": SECRET,
            "LORAMUX_ENGINE_SERVER_HEARTBEAT_S": str(HEARTBEAT_S),
        }
        settings = Settings(
            data_dir=tmp_path / "platform",
            model=str(tiny_model_dir),
            database_url=database.url,
            redis_url=redis_server.url,
            **store,
            engine_mode="remote",
            engine_secret=SECRET,
            engine_heartbeat_s=HEARTBEAT_S,
            usage_journal_interval_s=0.2,
        )
        with (
            engine_processes(["engine-a", "engine-b", "engine-c"], engine_env, tmp_path) as engines,
            start_platform(settings) as platform,
        ):
            eventually(lambda: len(platform.context.engine.engines()) == 3, "every engine")
            yield Topology(platform, engines, redis_server, database)


def _ready(url: str) -> httpx.Response:
    return httpx.get(f"{url}/readyz", timeout=10)


def _running_on(engine: EngineProcess) -> int:
    stats = httpx.get(
        f"{engine.url}/v1/engine/stats",
        headers={"Authorization": f"Bearer {SECRET}"},
        timeout=10,
    )
    assert stats.status_code == 200, stats.text
    return stats.json()["running_requests"]


def _start(topology: Topology, calls: list[Call]) -> list:
    """Start ``calls`` and return once all of them run in the engines."""
    threads = [call.start() for call in calls]

    def running() -> bool:
        return sum(_running_on(e) for e in topology.engines.values()) == len(calls)

    eventually(running, f"{len(calls)} calls to run in the engines", TIMEOUT_S, 0.02)
    return threads


def _counter(platform: Platform, name: str, **labels: str) -> float:
    """One series of a counter on the platform's /metrics (0 if it has none yet)."""
    inner = ",".join(f'{key}="{value}"' for key, value in labels.items())
    series = f"{name}{{{inner}}} "
    for line in httpx.get(f"{platform.url}/metrics").text.splitlines():
        if line.startswith(series):
            return float(line.removeprefix(series))
    return 0.0


def _engine_failures(platform: Platform, engine_id: str, kind: str) -> float:
    return _counter(platform, "loramux_engine_failures_total", engine=engine_id, kind=kind)


def _retries(platform: Platform, reason: str) -> float:
    return _counter(platform, "loramux_routing_retries_total", reason=reason)


def _join(threads: list) -> None:
    for thread in threads:
        thread.join(timeout=TIMEOUT_S)
        assert not thread.is_alive(), "a call hung"


class Ledger:
    """Every call the test sent, by phase, for the checks and the printed summary."""

    def __init__(self, platform: Platform):
        self.platform = platform
        self.calls: dict[str, list[Call]] = {}

    def send(self, phase: str, tenant: Tenant, *, stream: bool, max_tokens: int = 8) -> Call:
        call = Call(self.platform, tenant, stream=stream, max_tokens=max_tokens).run()
        self.calls.setdefault(phase, []).append(call)
        return call

    def add(self, phase: str, calls: list[Call]) -> None:
        self.calls.setdefault(phase, []).extend(calls)

    def served(self, phase: str, *tenants: Tenant) -> None:
        for tenant in tenants:
            for stream in (False, True):
                call = self.send(phase, tenant, stream=stream)
                assert call.status == 200 and call.done and call.error is None, call
                assert call.delivered == call.max_tokens, call

    def refused(self, phase: str, tenant: Tenant, status: int, code: str) -> None:
        for stream in (False, True):
            call = self.send(phase, tenant, stream=stream)
            assert (call.status, call.content_type) == (status, "application/json"), call
            assert call.error["code"] == code and call.error["message"], call

    def everything(self) -> list[Call]:
        return [call for calls in self.calls.values() for call in calls]


def test_the_topology_rides_out_redis_postgres_and_an_engine_kill(topology):
    platform, engines = topology.platform, topology.engines
    prices = {"input_price_per_mtok": 1.0, "output_price_per_mtok": 2.0}
    limited = platform.new_tenant(
        requests_per_minute=1000, tokens_per_minute=1_000_000, monthly_budget_usd=10.0, **prices
    )
    plain = platform.new_tenant(**prices)
    ledger = Ledger(platform)
    ledger.served("before", limited, plain)
    assert _ready(platform.url).json()["status"] == "ready"

    # --- 1. Redis stops while a stream and a non-streamed request run ------------------------
    running = [Call(platform, limited, stream=s, max_tokens=LONG) for s in (True, False)]
    threads = _start(topology, running)
    topology.redis.stop()
    ledger.served("redis", limited, plain)  # fail-open: limits skipped, not the requests
    degraded = _ready(platform.url)
    assert degraded.status_code == 200 and degraded.json()["status"] == "degraded", degraded.text
    assert degraded.json()["checks"]["redis"]["status"] == "failed"
    # The engines' heartbeats fail: within their record's life they say they are unready.
    for engine in engines.values():
        eventually(lambda e=engine: _ready(e.url).status_code == 503, "an engine unready", 15)
    _join(threads)
    for call in running:
        assert call.status == 200 and (call.delivered, call.finish_reason) == (LONG, "length")
    ledger.add("redis", running)
    topology.redis.start()
    eventually(lambda: _ready(platform.url).json()["status"] == "ready", "the platform ready", 30)
    for engine in engines.values():
        eventually(lambda e=engine: _ready(e.url).status_code == 200, "an engine ready", 15)
    eventually(lambda: len(platform.context.engine.engines()) == 3, "every engine routed", 15)
    ledger.served("redis", limited, plain)

    # --- 2. PostgreSQL restarts while a stream and a non-streamed request run -----------------
    running = [Call(platform, plain, stream=s, max_tokens=LONG) for s in (True, False)]
    threads = _start(topology, running)
    topology.database.stop()
    ledger.refused("postgres", plain, 503, "database_unavailable")
    unready = _ready(platform.url)
    assert unready.status_code == 503, unready.text
    assert unready.json()["checks"]["database"]["status"] == "failed"
    topology.database.start()
    _join(threads)
    for call in running:
        assert call.status == 200 and (call.delivered, call.finish_reason) == (LONG, "length")
    ledger.add("postgres", running)
    eventually(lambda: _ready(platform.url).status_code == 200, "the platform ready", 30)
    ledger.served("postgres", limited, plain)

    # --- 3. an idle engine is SIGKILLed, and requests are sent at once ------------------------
    # Two streams keep engines busy; an engine running nothing, whose record says it is
    # idle (so routing prefers it, and still lists it), is killed. Requests follow at once
    # until routing has sent one there: each is served by another engine.
    busy = [Call(platform, plain, stream=True, max_tokens=LONG) for _ in range(2)]
    threads = _start(topology, busy)
    idle = next(engine for engine in engines.values() if _running_on(engine) == 0)
    eventually(
        lambda: (
            {r.engine_id: r.load for r in platform.context.engine.engines()}[idle.engine_id] == 0
        ),
        "the idle engine's record to say it is idle",
        10,
        0.05,
    )
    idle.kill()
    for i in range(12):
        call = ledger.send("engine kill", plain, stream=i % 2 == 1)
        assert call.status == 200 and call.error is None, call
        assert call.delivered == call.max_tokens, call
        if _engine_failures(platform, idle.engine_id, "unreachable"):
            break
    assert _engine_failures(platform, idle.engine_id, "unreachable") == 1  # then skipped
    _join(threads)
    ledger.add("engine kill", busy)
    del engines[idle.engine_id]
    victim_id, survivor_id = sorted(engines)

    # --- ... then another while streams run on it and on the last one -------------------------
    streams = [Call(platform, plain, stream=True, max_tokens=LONG) for _ in range(8)]
    threads = _start(topology, streams)
    on_victim = _running_on(engines[victim_id])
    assert 0 < on_victim < len(streams), on_victim  # the load bound spreads them
    engines[victim_id].kill()
    # Sent at once, while the registry still lists the dead engine: served by the other.
    for _ in range(3):
        call = ledger.send("engine kill", plain, stream=False)
        assert call.status == 200 and call.delivered == call.max_tokens, call
    _join(threads)
    ledger.add("engine kill", streams)
    lost = [call for call in streams if call.error is not None]
    # Its streams that had output end with an error; one still in prefill starts again on
    # the survivor (nothing had reached its client) and finishes like the others.
    restarted = _retries(platform, "lost_before_output")
    assert lost and len(lost) + restarted == on_victim, (streams, restarted)
    for call in lost:  # an error event in the one envelope, after what was delivered
        assert call.status == 200 and call.delivered > 0, call
        assert (call.error["type"], call.error["code"]) == ("server_error", "engine_error")
        assert victim_id in call.error["message"], call
    for call in streams:
        if call.error is None:
            assert (call.delivered, call.finish_reason) == (LONG, "length"), call
    assert _ready(platform.url).status_code == 200  # one engine is enough to serve
    snapshot = httpx.get(f"{platform.url}/admin/engine", headers=platform.admin).json()
    rows = {row["engine_id"]: row for row in snapshot["engines"]}
    assert rows[survivor_id]["status"] == "up"
    assert rows.get(victim_id, {"status": "gone"})["status"] != "up"
    assert _engine_failures(platform, victim_id, "lost") == on_victim
    ledger.served("engine kill", limited, plain)

    # --- throughout: documented statuses only, billing equal to what clients got -------------
    everything = ledger.everything()
    documented = {code for code, entry in ERROR_CODES.items() if entry.status == 503}
    for call in everything:
        assert call.broken is None, call
        if call.status != 200:
            assert call.status == 503 and call.content_type == "application/json", call
            assert call.error["code"] in documented, call
    eventually(
        lambda: all(row.final for t in (limited, plain) for row in usage_rows(platform, t)),
        "every usage record written",
        30,
    )
    for tenant in (limited, plain):
        assert_billed_as_delivered(platform, tenant, everything)
    billed = sum(row.completion_tokens for t in (limited, plain) for row in usage_rows(platform, t))
    assert billed == sum(call.delivered for call in everything)
    for phase, calls in ledger.calls.items():
        statuses = Counter(call.status for call in calls)
        errors = Counter(call.error["code"] for call in calls if call.error)
        delivered = sum(call.delivered for call in calls)
        print(
            f"{phase}: {len(calls)} requests, statuses {dict(statuses)}, errors {dict(errors)}, "
            f"{delivered} tokens delivered"
        )
    print(f"all phases: {len(everything)} requests, {billed} tokens billed")
