"""The platform's routed engine client over two engine apps registered in a real Redis.

The registry (heartbeats, expiry, withdrawal) and ``RoutedEngines`` (affinity, spread,
skipping an unreachable engine, re-registering with an engine that forgot an adapter,
lazy tenant scheduling, merged stats). Killing an engine process mid-request is
``tests/platform/e2e/test_engine_topology.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace

import httpx
import pytest
import redis.asyncio

from loramux.engine import AsyncEngine, Engine, EngineConfig, SamplingParams
from loramux.engine.model.config import ModelConfig
from loramux.platform.app import create_app
from loramux.platform.context import build_context
from loramux.platform.engine_fleet.client import EngineRequest
from loramux.platform.engine_fleet.registry import EngineRecord, EngineRegistry
from loramux.platform.engine_fleet.remote import RemoteEngine
from loramux.platform.engine_fleet.routed import NoEngineAvailable, RoutedEngines
from loramux.platform.engine_fleet.server import EngineHost, create_engine_app
from loramux.platform.settings import Settings
from loramux.platform.store.local import LocalObjectStore
from tests.fixtures.browser import ServerThread, free_port
from tests.fixtures.deadline import run_within
from tests.fixtures.polling import eventually
from tests.platform.engine_fleet.test_engine_server import SECRET, store_adapter
from tests.platform.raw_http import request_then_leave

HEARTBEAT_S = 1.0  # TTL 3 s: a busy test machine must not expire a live engine
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@dataclass
class Cluster:
    namespace: str
    hosts: dict[str, EngineHost]
    adapters: dict  # name -> StoredAdapter
    redis_url: str
    model_dir: object

    def registry(self) -> EngineRegistry:
        client = redis.asyncio.from_url(self.redis_url)
        return EngineRegistry(client, HEARTBEAT_S, namespace=self.namespace)

    def client(self) -> RoutedEngines:
        from transformers import AutoTokenizer

        return RoutedEngines(
            self.registry(),
            model_id="tiny",
            tokenizer=AutoTokenizer.from_pretrained(self.model_dir),
            default_max_model_len=ModelConfig.from_pretrained(
                self.model_dir
            ).max_position_embeddings,
            secret=SECRET,
            load_factor=1.25,
        )


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, make_adapter, redis_url, tmp_path_factory) -> Iterator[Cluster]:
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    store = LocalObjectStore(tmp_path_factory.mktemp("routed-store"))
    adapters = {
        f"v{i}": store_adapter(
            store, make_adapter(tiny_model_dir, rank=4, targets=("q_proj",), seed=100 + i), f"v{i}"
        )
        for i in range(12)
    }
    hosts, servers = {}, []
    for engine_id in ("engine-a", "engine-b"):
        engine = Engine(
            EngineConfig(model=str(tiny_model_dir), kv_cache_bytes=16 << 20, dtype="float32")
        )
        registry = EngineRegistry(
            redis.asyncio.from_url(redis_url), HEARTBEAT_S, namespace=namespace
        )
        host = EngineHost(
            AsyncEngine(engine),
            store,
            registry,
            engine_id=engine_id,
            url="",
            model_id="tiny",
            secret=SECRET,
        )
        server = ServerThread(create_engine_app(host))
        host.url = server.url
        hosts[engine_id] = host
        servers.append(server)
    with contextlib.ExitStack() as stack:
        for server in servers:
            stack.enter_context(server)
        yield Cluster(namespace, hosts, adapters, redis_url, tiny_model_dir)


async def _serve(client: RoutedEngines, adapter: str | None, request_id: str):
    return [
        out
        async for out in client.stream(
            EngineRequest(
                prompt="Hello", params=GREEDY, adapter=adapter, request_id=request_id, tenant="acme"
            )
        )
    ][-1]


def test_the_registry_lists_live_engines_and_forgets_silent_ones(cluster):
    async def go():
        registry = cluster.registry()
        live = {r.engine_id: r for r in await registry.live()}
        assert set(live) == {"engine-a", "engine-b"}
        assert live["engine-a"].url == cluster.hosts["engine-a"].url
        assert live["engine-a"].capacity == 64 and live["engine-a"].max_model_len > 0
        ghost = replace(live["engine-a"], engine_id="ghost", url="http://127.0.0.1:9")
        await registry.publish(ghost)  # one heartbeat, then silence
        assert "ghost" in {r.engine_id for r in await registry.live()}
        await asyncio.sleep(registry.ttl_s + 0.3)
        assert {r.engine_id for r in await registry.live()} == {"engine-a", "engine-b"}
        await registry.withdraw("engine-b")  # as a clean shutdown does...
        assert {r.engine_id for r in await registry.live()} == {"engine-a"}
        await asyncio.sleep(HEARTBEAT_S * 1.5)  # ...the running one is back at its next beat
        assert {r.engine_id for r in await registry.live()} == {"engine-a", "engine-b"}

    run_within(go())


def test_requests_stick_to_their_adapters_engine_and_adapters_spread(cluster):
    async def go():
        client = cluster.client()
        await client.start()
        try:
            for name, stored in cluster.adapters.items():
                await client.register_stored_adapter(name, stored)
            for round_ in range(3):
                for name in cluster.adapters:
                    final = await _serve(client, name, f"{name}-{round_}")
                    assert final.finish_reason == "length"
                    await asyncio.sleep(0)
            return Counter(client.routed), await client.stats()
        finally:
            await client.stop()

    routed, stats = run_within(go())
    engines_of = {name: {e for (e, a) in routed if a == name} for name in cluster.adapters}
    assert all(len(engines) == 1 for engines in engines_of.values()), engines_of
    assert sum(routed.values()) == 36
    per_engine = Counter(next(iter(e)) for e in engines_of.values())
    assert set(per_engine) == {"engine-a", "engine-b"}, per_engine
    assert min(per_engine.values()) >= 3, per_engine
    # Each engine holds exactly the adapters routed to it.
    for engine_id, host in cluster.hosts.items():
        held = set(asyncio.run(host_residency(host)))
        assert held == {n for n, e in engines_of.items() if e == {engine_id}}
    parts = [asyncio.run(host_stats(h)) for h in cluster.hosts.values()]
    assert stats.kv_blocks_total == sum(part.kv_blocks_total for part in parts)
    # The tenant's service is the fleet's: both engines served it, the merge adds them up.
    acme = stats.tenants["acme"]
    served = [part.tenants["acme"].served_output_tokens for part in parts]
    assert min(served) >= 3 * GREEDY.max_tokens and acme.served_output_tokens == sum(served)
    assert acme.served_prompt_tokens == sum(p.tenants["acme"].served_prompt_tokens for p in parts)


async def host_residency(host: EngineHost) -> dict:
    return await host.engine.adapter_residency()


async def host_stats(host: EngineHost):
    return await host.engine.stats()


async def _register_fake(
    registry: EngineRegistry, client: RoutedEngines, engine_id: str, url: str
) -> None:
    """Register ``engine_id`` at ``url`` as an idle engine like the live ones, and make
    ``client`` route to it."""
    live = await registry.live()
    fake = {**live[0].__dict__, "engine_id": engine_id, "url": url, "running": 0, "waiting": 0}
    await registry.publish(EngineRecord(**fake))
    await client.refresh()
    assert engine_id in {r.engine_id for r in client.engines()}


def test_an_unreachable_engine_is_skipped_at_once(cluster):
    """A registered engine that refuses connections (a crashed process whose record has
    not expired yet) costs one connect attempt; the request runs elsewhere."""

    async def go():
        registry = cluster.registry()
        client = cluster.client()
        await client.start()
        try:
            await _register_fake(registry, client, "dead", f"http://127.0.0.1:{free_port()}")
            await client.register_stored_adapter("v0", cluster.adapters["v0"])
            first = await _serve(client, None, "unreach-1")
            second = await _serve(client, None, "unreach-2")
            engines = {e for (e, _) in client.routed}
            return first, second, engines, {r.engine_id for r in client.engines()}
        finally:
            await registry.withdraw("dead")
            await client.stop()

    first, second, engines, listed = run_within(go())
    assert first.finish_reason == second.finish_reason == "length"
    assert "dead" not in engines
    assert "dead" not in listed  # skipped until it beats again


class _DyingEngine:
    """A listening socket that takes each connection and resets it at once, unanswered:
    what a ``loramux engine`` SIGKILLed a moment ago looks like to a request that reaches
    its port before the kernel stops accepting. With ``answer``, it sends those bytes and
    closes (an engine that died after it took the request, before any output)."""

    def __init__(self, answer: bytes = b""):
        self._answer = answer
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.accepted = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.accepted += 1
            with contextlib.suppress(OSError):
                conn.recv(65536)  # the request arrived...
                if self._answer:  # ...was answered, and the connection ends mid-body
                    conn.sendall(self._answer)
                else:  # ...and the process is gone: RST, no response
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    def close(self) -> None:
        self._listener.close()


@dataclass
class _ThroughADyingEngine:
    finals: list  # each request's last output
    accepted: int  # connections the dying engine took
    engines: set[str]  # engines that finished requests
    reports: dict  # engine id -> EngineReport, after the requests
    metrics: object  # routing's registry


def _through_a_dying_engine(cluster: Cluster, dying: _DyingEngine) -> _ThroughADyingEngine:
    """Requests routed over the cluster with ``dying`` registered as engine "dying", sent
    one by one until routing sent one there (routing spreads them by their ids)."""

    async def go() -> _ThroughADyingEngine:
        registry = cluster.registry()
        client = cluster.client()
        await client.start()
        try:
            await _register_fake(registry, client, "dying", f"http://127.0.0.1:{dying.port}")
            finals = []
            for i in range(12):
                finals.append(await _serve(client, None, f"dying-{i}"))
                if dying.accepted:
                    break
            reports = {r.engine_id: r for r in await client.engine_reports()}
            engines = {e for (e, _) in client.routed}
            return _ThroughADyingEngine(
                finals, dying.accepted, engines, reports, client.metrics_registry()
            )
        finally:
            dying.close()
            await registry.withdraw("dying")
            await client.stop()

    seen = run_within(go())
    assert seen.accepted == 1, "no request reached the dying engine: the test proves nothing"
    assert all(f.finish_reason == "length" for f in seen.finals)
    assert "dying" not in seen.engines
    return seen


def test_an_engine_dying_as_a_request_arrives_sends_it_elsewhere(cluster):
    """Issue 15: a request sent just after an engine died (its connection accepted, then
    reset, with no answer) failed with 503 engine_error; nothing had started, so it must
    run on another engine."""
    seen = _through_a_dying_engine(cluster, _DyingEngine())
    # What the operator sees: the failure, the retry, and the engine skipped since.
    sample = seen.metrics.get_sample_value
    assert sample("loramux_engine_failures_total", {"engine": "dying", "kind": "unreachable"}) == 1
    assert sample("loramux_routing_retries_total", {"reason": "unreachable"}) == 1
    assert sample("loramux_routing_decisions_total", {"kind": "base"}) == len(seen.finals) + 1
    assert seen.reports["dying"].stats is None and "skipped" in seen.reports["dying"].error
    assert seen.reports["engine-a"].stats is not None
    assert seen.reports["engine-b"].stats is not None


def test_an_engine_lost_before_the_first_output_sends_the_request_elsewhere(cluster):
    """An engine that answered 200 and died before streaming any output (in prefill):
    nothing reached the caller, so the request starts again on another engine instead of
    failing with engine_error."""
    headers = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n"
    headers += b"transfer-encoding: chunked\r\n\r\n"
    seen = _through_a_dying_engine(cluster, _DyingEngine(answer=headers))
    sample = seen.metrics.get_sample_value
    assert sample("loramux_engine_failures_total", {"engine": "dying", "kind": "lost"}) == 1
    assert sample("loramux_routing_retries_total", {"reason": "lost_before_output"}) == 1


def test_an_engine_that_forgot_an_adapter_gets_it_again(cluster):
    async def go():
        client = cluster.client()
        await client.start()
        try:
            await client.register_stored_adapter("v5", cluster.adapters["v5"])
            await _serve(client, "v5", "forget-1")
            (engine_id,) = {e for (e, a) in client.routed if a == "v5"}
            host = cluster.hosts[engine_id]
            async with httpx.AsyncClient() as http:
                remote = RemoteEngine(http, engine_id, host.url, SECRET)
                await remote.remove_adapter("v5")
                final = await _serve(client, "v5", "forget-2")  # re-registered, then served
                await remote.remove_adapter("v5")  # forgotten again
            await client.remove_adapter("v5")  # the engine's "unknown adapter" is no error
            return final, engine_id, Counter(client.routed)
        finally:
            await client.stop()

    final, engine_id, routed = run_within(go())
    assert final.finish_reason == "length"
    assert routed[(engine_id, "v5")] == 2


def test_an_abort_goes_to_the_engine_running_the_request(cluster):
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def go():
        client = cluster.client()
        await client.start()
        try:
            stream = client.stream(
                EngineRequest(prompt="Hello", params=long, request_id="routed-abort", tenant="acme")
            )
            first = await anext(stream)
            aborted = await client.abort("routed-abort")
            rest = [out async for out in stream]
            return first, aborted, rest, await client.abort("routed-abort")
        finally:
            await client.stop()

    first, aborted, rest, again = run_within(go())
    assert not first.finished
    assert aborted.finished and aborted.finish_reason == "abort"
    assert aborted.metrics.computed_prompt_tokens == aborted.metrics.prompt_tokens > 0
    assert rest[-1].finish_reason == "abort"
    assert again is None  # the request has ended: no engine runs it
    assert not _engines_busy(cluster)


def test_tenant_scheduling_reaches_engines_before_their_first_request(cluster):
    async def go():
        client = cluster.client()
        await client.start()
        try:
            await client.set_tenant_priority("gold", 8)
            await client.set_tenant_weight("gold", 4.0)
            await _serve(client, None, "tenant-1")
            return await client.stats()
        finally:
            await client.stop()

    stats = run_within(go())
    assert stats.tenant_priorities.get("gold") == 8
    assert stats.tenant_weights.get("gold") == 4.0


def test_no_engine_means_a_clear_error(redis_url, tiny_model_dir):
    async def go():
        empty = Cluster(f"empty-{uuid.uuid4().hex[:6]}", {}, {}, redis_url, tiny_model_dir)
        client = empty.client()
        await client.start()
        try:
            assert "no live engine serves tiny" in client.not_ready_reason()
            with pytest.raises(NoEngineAvailable, match="no engine is available for tiny"):
                await _serve(client, None, "none-1")
        finally:
            await client.stop()

    run_within(go())


def test_with_no_engine_streamed_and_plain_requests_get_the_same_503(
    redis_url, tiny_model_dir, tmp_path
):
    """Issue 15: with no engine a stream answered 200 and then an SSE error (type
    "error") while a plain request answered 503 (type "server_error"). Both are now the
    same 503 with the same envelope, before any stream starts."""
    empty = Cluster(f"empty-{uuid.uuid4().hex[:6]}", {}, {}, redis_url, tiny_model_dir)
    settings = Settings(data_dir=tmp_path, model=str(tiny_model_dir), admin_token=None)
    context = build_context(settings, log=lambda _: None, with_engine=False)
    context.engine = empty.client()
    with ServerThread(create_app(context)) as server:
        admin = {"Authorization": f"Bearer {context.admin_token}"}
        tenant = httpx.post(f"{server.url}/admin/tenants", json={"name": "a"}, headers=admin)
        key = httpx.post(
            f"{server.url}/admin/tenants/{tenant.json()['id']}/api-keys", headers=admin
        )
        auth = {"Authorization": f"Bearer {key.json()['key']}"}
        answers = []
        for path, body in (
            ("/v1/completions", {"prompt": "Hi", "max_tokens": 4}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ):
            for stream in (False, True):
                sent = {"model": context.base_model.model_id, "stream": stream, **body}
                answers.append(httpx.post(f"{server.url}{path}", json=sent, headers=auth))
    for answer in answers:
        assert answer.status_code == 503, answer.text
        assert answer.headers["content-type"] == "application/json"
        error = answer.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "engine_unavailable")
        assert "nothing was generated" in error["message"]
        assert "127.0.0.1" not in error["message"]  # no engine addresses for tenants


def test_the_operator_sees_each_engine_and_routing_in_remote_mode(cluster, tmp_path):
    """Issue 15: /admin/engine merged every engine with no per-engine row, and the
    platform's /metrics had no routing metrics."""
    settings = Settings(data_dir=tmp_path, model=str(cluster.model_dir), admin_token=None)
    context = build_context(settings, log=lambda _: None, with_engine=False)
    context.engine = cluster.client()
    with ServerThread(create_app(context)) as server:
        admin = {"Authorization": f"Bearer {context.admin_token}"}
        snapshot = httpx.get(f"{server.url}/admin/engine", headers=admin)
        metrics = httpx.get(f"{server.url}/metrics").text
    assert snapshot.status_code == 200, snapshot.text
    body = snapshot.json()
    rows = {row["engine_id"]: row for row in body["engines"]}
    assert set(rows) == {"engine-a", "engine-b"}
    for engine_id, row in rows.items():
        assert row["status"] == "up" and row["error"] is None
        assert row["url"] == cluster.hosts[engine_id].url
        assert row["capacity"] == cluster.hosts[engine_id].capacity
        assert 0 <= row["heartbeat_age_s"] < 10
        assert row["kv_usage"] is not None
    # The merged figures are the rows' sums.
    assert body["running_requests"] == sum(r["running_requests"] for r in rows.values())
    assert body["device"]["count"] <= sum(r["device_adapters"] for r in rows.values())
    # Each engine's budget travels over HTTP; the merged one adds them up.
    for row in rows.values():
        assert row["budget_bytes"] == 16 << 20 and row["budget_source"] == "set"
        assert row["adapter_reloads_per_min"] == 0.0 and row["thrashing"] is False
    memory = body["memory"]
    assert memory["budget_bytes"] == 2 * (16 << 20) and memory["source"] == "set"
    assert memory["kv_tokens"] == sum(r["kv_tokens"] for r in rows.values())
    assert memory["adapters_beside_full_batch"] == sum(
        r["adapters_beside_full_batch"] for r in rows.values()
    )
    assert body["residency"]["adapter_reloads"] == 0
    # Routing's own metrics are on the platform's /metrics (at 0 before the first request).
    for kind in ("affine", "cold", "spill", "base"):
        assert f'loramux_routing_decisions_total{{kind="{kind}"}} 0.0' in metrics
    assert 'loramux_routing_retries_total{reason="unreachable"} 0.0' in metrics
    assert "# TYPE loramux_engine_failures_total counter" in metrics
    assert 'loramux_dependency_errors_total{dependency="redis"}' in metrics


def _engines_busy(cluster: Cluster) -> bool:
    return any(h.engine.engine.has_unfinished_requests() for h in cluster.hosts.values())


def _generated(cluster: Cluster) -> float:
    return sum(
        h.engine.engine.metrics.registry.get_sample_value("loramux_generated_tokens_total")
        for h in cluster.hosts.values()
    )


def test_a_client_leaving_a_non_streamed_request_aborts_it_on_the_engine(cluster, tmp_path):
    """The platform in remote mode: the client's disconnect closes the run, which aborts
    the request on the engine process running it; the abort's answer says what the engine
    had prefilled, and that is billed (no response reached the client, no completion)."""
    settings = Settings(data_dir=tmp_path, model=str(cluster.model_dir), admin_token=None)
    context = build_context(settings, log=lambda _: None, with_engine=False)
    context.engine = cluster.client()
    before = _generated(cluster)
    try:
        with ServerThread(create_app(context)) as server:
            admin = {"Authorization": f"Bearer {context.admin_token}"}
            tenant = httpx.post(f"{server.url}/admin/tenants", json={"name": "a"}, headers=admin)
            tenant_id = tenant.json()["id"]
            key = httpx.post(f"{server.url}/admin/tenants/{tenant_id}/api-keys", headers=admin)
            body = {
                "model": context.base_model.model_id,
                "prompt": "Tell me a long story",
                "max_tokens": 400,
                "ignore_eos": True,
            }
            with request_then_leave(server.url, "/v1/completions", key.json()["key"], body):
                eventually(
                    lambda: _generated(cluster) > before, "the request to decode", interval_s=0.005
                )
            eventually(lambda: not _engines_busy(cluster), "the engine to abort it", 20)
            assert _generated(cluster) - before < 400  # stopped long before its 400 tokens

            def billed() -> dict:
                params = {"tenant_id": tenant_id}
                usage = httpx.get(f"{server.url}/admin/usage", params=params, headers=admin)
                return usage.json()["totals"]

            totals = eventually(lambda: billed()["requests"] and billed(), "its usage", 10)
            prompt = len(context.engine.tokenizer(body["prompt"])["input_ids"])
            assert (totals["prompt_tokens"], totals["completion_tokens"]) == (prompt, 0)
            assert totals["requests"] == 1
    finally:
        context.sessions.kw["bind"].dispose()


def test_a_pin_reaches_every_engine_without_a_request(cluster):
    """Pinned with no request for it: every engine registers the adapter and holds it on
    the device; unpinned, none holds it pinned."""

    async def pins(client) -> dict:
        reports = await client.engine_reports()
        return {report.engine_id: report.stats.pinned_adapters for report in reports}

    async def until(client, wanted: dict) -> dict:
        for _ in range(300):
            seen = await pins(client)
            if seen == wanted:
                return seen
            await asyncio.sleep(0.1)
        raise AssertionError(f"pins never became {wanted}: {seen}")

    async def go():
        client = cluster.client()
        await client.start()
        try:
            await client.register_stored_adapter("v7", cluster.adapters["v7"])
            await client.keep_adapter("v7")
            held = await until(client, {e: {"v7": "pinned"} for e in cluster.hosts})
            merged = await client.pinned_adapters()
            residency = await client.adapter_residency()
            await client.keep_adapter("v7", keep=False)
            released = await until(client, {e: {} for e in cluster.hosts})
            await client.remove_adapter("v7")
            return held, merged, residency, released
        finally:
            await client.stop()

    held, merged, residency, released = run_within(go())
    assert held == {"engine-a": {"v7": "pinned"}, "engine-b": {"v7": "pinned"}}
    assert merged == {"v7": "pinned"} and residency["v7"] == "device"
    assert released == {"engine-a": {}, "engine-b": {}}
