"""``loramux engine``'s internal API, driven through ``RemoteEngine`` over real HTTP.

One engine process's app (tiny model, adapters fetched from a local object store) runs
under uvicorn in a thread; the client is the platform's.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from loramux.engine import (
    AdapterInUse,
    AsyncEngine,
    Engine,
    EngineConfig,
    EngineError,
    SamplingParams,
    UnknownAdapter,
)
from loramux.engine.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from loramux.platform.engine_fleet.client import EngineRequest
from loramux.platform.engine_fleet.remote import (
    AdapterNotRegistered,
    EngineUnavailable,
    EngineUnreachable,
    RemoteEngine,
)
from loramux.platform.engine_fleet.server import EngineHost, create_engine_app
from loramux.platform.engine_fleet.stored_adapter import StoredAdapter
from loramux.platform.serving import BACKSTOP_S, DrainingServer
from loramux.platform.store.local import LocalObjectStore
from tests.engine.hf_reference import greedy_tokens
from tests.fixtures.browser import ServerThread, free_port
from tests.fixtures.polling import eventually

SECRET = "engine-secret-for-tests"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def store_adapter(store: LocalObjectStore, folder, name: str) -> StoredAdapter:
    config = store.put_file(folder / CONFIG_FILE)
    weights = store.put_file(folder / WEIGHTS_FILE)
    return StoredAdapter(config.key, weights.key, weights.sha256, f"version {name}")


@dataclass
class RunningEngine:
    host: EngineHost
    url: str
    adapters: dict[str, tuple[StoredAdapter, object]]  # name -> (stored, its folder)


@pytest.fixture(scope="module")
def running_engine(tiny_model_dir, make_adapter, tmp_path_factory) -> Iterator[RunningEngine]:
    store = LocalObjectStore(tmp_path_factory.mktemp("engine-store"))
    folders = {
        "r4": make_adapter(tiny_model_dir, rank=4, targets=("q_proj", "v_proj"), seed=11),
        "r8": make_adapter(tiny_model_dir, rank=8, targets=("o_proj", "down_proj"), seed=12),
    }
    adapters = {name: (store_adapter(store, f, name), f) for name, f in folders.items()}
    engine = Engine(
        EngineConfig(model=str(tiny_model_dir), kv_cache_bytes=16 << 20, dtype="float32")
    )
    host = EngineHost(
        AsyncEngine(engine),
        store,
        None,
        engine_id="engine-a",
        url="",
        model_id="tiny",
        secret=SECRET,
    )
    server = ServerThread(create_engine_app(host))
    host.url = server.url
    with server:
        yield RunningEngine(host, server.url, adapters)


def _run(coro_fn):
    """Run ``coro_fn(remote)`` with a fresh client (each test its own event loop)."""

    async def main(url: str):
        async with httpx.AsyncClient() as client:
            return await coro_fn(RemoteEngine(client, "engine-a", url, SECRET))

    return main


async def _collect(stream) -> list:
    return [out async for out in stream]


def test_generate_streams_the_engines_tokens(running_engine, tiny_model_dir):
    async def go(remote: RemoteEngine):
        return await _collect(
            remote.stream(EngineRequest(prompt="Hello there", params=GREEDY, request_id="g1"))
        )

    outs = asyncio.run(_run(go)(running_engine.url))
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert [t for o in outs for t in o.delta_token_ids] == outs[-1].token_ids
    prompt_ids = running_engine.host.engine.engine.tokenizer("Hello there")["input_ids"]
    assert outs[-1].token_ids == greedy_tokens(tiny_model_dir, None, prompt_ids, 6)
    assert outs[-1].metrics is not None and outs[-1].metrics.completion_tokens == 6


def test_adapters_are_registered_by_store_objects_and_served(running_engine, tiny_model_dir):
    stored, folder = running_engine.adapters["r4"]

    async def go(remote: RemoteEngine):
        await remote.register_adapter("v-r4", stored)
        await remote.register_adapter("v-r4", stored)  # idempotent
        other, _ = running_engine.adapters["r8"]
        with pytest.raises(EngineError, match="other files"):
            await remote.register_adapter("v-r4", other)
        outs = await _collect(
            remote.stream(
                EngineRequest(prompt="Hi", params=GREEDY, request_id="g2", adapter="v-r4")
            )
        )
        residency = await remote.residency()
        return outs[-1], residency

    final, residency = asyncio.run(_run(go)(running_engine.url))
    prompt_ids = running_engine.host.engine.engine.tokenizer("Hi")["input_ids"]
    assert final.token_ids == greedy_tokens(tiny_model_dir, folder, prompt_ids, 6)
    assert residency["v-r4"] == "device"


def test_refusals_name_the_problem(running_engine):
    async def go(remote: RemoteEngine):
        with pytest.raises(AdapterNotRegistered, match="unknown adapter"):
            await _collect(
                remote.stream(
                    EngineRequest(prompt="Hi", params=GREEDY, request_id="g3", adapter="nope")
                )
            )
        with pytest.raises(EngineError, match="prompt token ids"):
            await _collect(
                remote.stream(EngineRequest(prompt=[10**9], params=GREEDY, request_id="g4"))
            )

    asyncio.run(_run(go)(running_engine.url))
    bad = httpx.post(
        f"{running_engine.url}/v1/engine/generate",
        json={"request_id": "g5", "prompt": "x", "params": {"temperature": -1}},
        headers={"Authorization": f"Bearer {SECRET}"},
    )
    assert bad.status_code == 400 and "temperature" in bad.json()["error"]["message"]


def test_the_internal_api_needs_the_secret(running_engine):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        refused = httpx.get(f"{running_engine.url}/v1/engine/info", headers=headers)
        assert refused.status_code == 401
        assert "LORAMUX_ENGINE_SERVER_SECRET" in refused.json()["error"]["message"]
    assert httpx.get(f"{running_engine.url}/healthz").status_code == 200
    assert httpx.get(f"{running_engine.url}/readyz").json() == {"status": "ready"}
    metrics = httpx.get(f"{running_engine.url}/metrics")
    assert "loramux_generated_tokens_total" in metrics.text


def test_a_dropped_connection_aborts_the_request_on_the_engine(running_engine):
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    engine = running_engine.host.engine.engine

    async def go(remote: RemoteEngine):
        stream = remote.stream(
            EngineRequest(prompt="Tell me a long story", params=long, request_id="drop1")
        )
        first = await anext(stream)
        await stream.aclose()  # the platform's caller went away
        return first

    first = asyncio.run(_run(go)(running_engine.url))
    assert not first.finished
    deadline = time.monotonic() + 20
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.has_unfinished_requests(), "the engine kept running a dropped request"
    aborted = engine.metrics.registry.get_sample_value("loramux_generated_tokens_total")
    assert aborted < 400  # it stopped long before its 400 tokens


def test_an_abort_answers_with_the_requests_final_output(running_engine):
    """The platform aborts a request its client left by id, and learns from the answer how
    much of the prompt the engine had prefilled (what the request is billed for)."""
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    engine = running_engine.host.engine.engine

    async def go(remote: RemoteEngine):
        stream = remote.stream(
            EngineRequest(prompt="Tell me a long story", params=long, request_id="abort1")
        )
        first = await anext(stream)
        aborted = await remote.abort("abort1")
        rest = await _collect(stream)  # the stream ends with the same abort output
        return first, aborted, rest, await remote.abort("abort1")

    first, aborted, rest, again = asyncio.run(_run(go)(running_engine.url))
    assert not first.finished
    assert aborted.finished and aborted.finish_reason == "abort"
    prompt_tokens = len(engine.tokenizer("Tell me a long story")["input_ids"])
    assert aborted.metrics.prompt_tokens == aborted.metrics.computed_prompt_tokens == prompt_tokens
    assert rest[-1].finish_reason == "abort" and rest[-1].token_ids == aborted.token_ids
    assert again is None  # nothing runs under that id any more: 204
    assert not engine.has_unfinished_requests()


def _delete_adapter(running_engine, name: str) -> httpx.Response:
    return httpx.delete(
        f"{running_engine.url}/v1/engine/adapters/{name}",
        headers={"Authorization": f"Bearer {SECRET}"},
    )


def test_an_adapter_in_use_is_not_removed(running_engine):
    """The engine's refusals cross the HTTP seam as codes, and come back as the engine's
    own error types (an AdapterInUse, an UnknownAdapter), with its words."""
    stored, _ = running_engine.adapters["r8"]
    long = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)

    async def go(remote: RemoteEngine):
        await remote.register_adapter("v-r8", stored)
        stream = remote.stream(
            EngineRequest(prompt="Busy", params=long, request_id="busy1", adapter="v-r8")
        )
        await anext(stream)
        with pytest.raises(AdapterInUse, match="'v-r8' is in use by 1 request"):
            await remote.remove_adapter("v-r8")
        in_use = await asyncio.to_thread(_delete_adapter, running_engine, "v-r8")
        await stream.aclose()
        for _ in range(100):  # the abort lands on the engine thread shortly
            try:
                await remote.remove_adapter("v-r8")
                return in_use, await remote.residency()
            except AdapterInUse:
                await asyncio.sleep(0.05)
        raise AssertionError("the adapter stayed in use after its request was aborted")

    in_use, residency = asyncio.run(_run(go)(running_engine.url))
    assert in_use.status_code == 409
    assert in_use.json()["error"]["code"] == "adapter_in_use"
    assert "v-r8" not in residency

    async def again(remote: RemoteEngine):
        with pytest.raises(UnknownAdapter, match="'v-r8' is not loaded") as refused:
            await remote.remove_adapter("v-r8")
        assert isinstance(refused.value, AdapterNotRegistered)  # an UnknownAdapter too

    asyncio.run(_run(again)(running_engine.url))
    unknown = _delete_adapter(running_engine, "v-r8")
    assert unknown.status_code == 404
    assert unknown.json()["error"] == {
        "message": "adapter 'v-r8' is not loaded",
        "type": "engine_error",
        "code": "unknown_adapter",
    }


def test_tenant_scheduling_and_stats(running_engine):
    async def go(remote: RemoteEngine):
        await remote.set_tenant("acme", weight=3.0, priority=7)
        return await remote.stats()

    stats = asyncio.run(_run(go)(running_engine.url))
    assert stats.tenant_weights["acme"] == 3.0
    assert stats.tenant_priorities["acme"] == 7
    assert stats.kv_blocks_total > 0


def test_an_engine_that_is_not_there_is_unreachable():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens

    async def go(remote: RemoteEngine):
        with pytest.raises(EngineUnreachable):
            await _collect(
                remote.stream(EngineRequest(prompt="Hi", params=GREEDY, request_id="u1"))
            )
        with pytest.raises(EngineUnavailable):
            await remote.stats()

    asyncio.run(_run(go)(url))


def test_a_shutdown_aborts_what_still_runs_after_its_grace(tiny_model_dir, tmp_path):
    """What SIGTERM does to ``loramux engine``: requests run on for the grace period, then
    each is aborted so its stream ends with an ``abort`` output, and the server exits."""
    engine = Engine(
        EngineConfig(model=str(tiny_model_dir), kv_cache_bytes=16 << 20, dtype="float32")
    )
    host = EngineHost(
        AsyncEngine(engine),
        LocalObjectStore(tmp_path),
        None,
        engine_id="engine-d",
        url="",
        model_id="tiny",
        secret=SECRET,
    )
    port, grace_s = free_port(), 0.3
    config = uvicorn.Config(
        create_engine_app(host),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=grace_s + BACKSTOP_S,
    )
    server = DrainingServer(
        config, grace_s=grace_s, stop_requests=host.stop_requests, on_shutdown=host.withdraw
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    eventually(lambda: server.started, "the engine server to start", 30, 0.05)
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def go(remote: RemoteEngine):
        stream = remote.stream(
            EngineRequest(prompt="Tell me a long story", params=long, request_id="drain1")
        )
        outs = [await anext(stream)]
        server.should_exit = True  # what the SIGTERM handler sets
        outs += [out async for out in stream]
        return outs

    outs = asyncio.run(_run(go)(f"http://127.0.0.1:{port}"))
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert len(outs[-1].token_ids) < 400
    assert not host.registered  # it left the registry when the shutdown began
    thread.join(timeout=grace_s + BACKSTOP_S + 10)
    assert not thread.is_alive(), "the engine server did not exit"
