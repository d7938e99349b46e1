"""Engine.stats(): the rolling latency windows and the snapshot of load, KV and adapter tiers."""

from __future__ import annotations

import asyncio

import pytest

from loramux.engine import AsyncEngine, SamplingParams
from loramux.engine.stats import LatencyWindow, percentile
from tests.engine.factories import PROMPTS, build_engine

MAX_TOKENS = 6


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- the window ------------------------------------------------------------------------------


def test_percentiles_are_nearest_rank():
    ordered = [float(i) for i in range(1, 101)]  # 1..100
    assert percentile(ordered, 50) == 50.0
    assert percentile(ordered, 90) == 90.0
    assert percentile(ordered, 99) == 99.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0


def test_empty_window_has_no_percentiles():
    summary = LatencyWindow().summary()
    assert (summary.samples, summary.p50, summary.p90, summary.p99) == (0, None, None, None)


def test_window_keeps_only_recent_samples():
    clock = FakeClock()
    window = LatencyWindow(window_s=10.0, clock=clock)
    for value in (5.0, 6.0, 7.0):
        window.add(value)
    clock.now += 6
    window.add(1.0)
    assert window.summary().samples == 4
    clock.now += 5  # the first three are now 11 s old
    summary = window.summary()
    assert (summary.samples, summary.p50, summary.p99) == (1, 1.0, 1.0)


def test_window_keeps_at_most_max_samples():
    window = LatencyWindow(max_samples=3, clock=FakeClock())
    for value in (9.0, 1.0, 2.0, 3.0):
        window.add(value)
    summary = window.summary()
    assert (summary.samples, summary.p50, summary.p99) == (3, 2.0, 3.0)


@pytest.mark.parametrize("kwargs", [{"window_s": 0}, {"max_samples": 0}])
def test_window_refuses_empty_bounds(kwargs):
    with pytest.raises(ValueError, match="window"):
        LatencyWindow(**kwargs)


# --- the engine's snapshot -------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, make_adapter):
    return make_adapter(tiny_model_dir, rank=4, targets=("q_proj", "v_proj"), seed=11)


def test_idle_engine_snapshot(tiny_model_dir):
    engine = build_engine(tiny_model_dir)
    stats = engine.stats()
    assert (stats.running_requests, stats.waiting_requests, stats.kv_blocks_used) == (0, 0, 0)
    assert stats.kv_blocks_total == stats.kv_blocks_usable == engine.kv.num_blocks > 0
    assert stats.kv_block_size == engine.config.block_size
    assert stats.device.adapters == () and stats.device.bytes == 0
    assert stats.device.capacity_bytes > 0
    assert stats.host.capacity_bytes == engine.config.adapter_host_bytes
    assert stats.ttft.samples == 0 and stats.itl.samples == 0
    assert stats.adapter_residency == {} and stats.tenant_priorities == {}


def test_snapshot_counts_latency_samples_and_adapter_tiers(tiny_model_dir, adapter_dir):
    engine = build_engine(tiny_model_dir, adapters={"support": adapter_dir})
    assert engine.stats().host.adapters == ("support",)  # parsed at add, not on the device
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    engine.generate(PROMPTS[:3], params, adapters=["support", None, None])
    stats = engine.stats()
    # One TTFT per request; every later token is one inter-token gap.
    assert stats.ttft.samples == 3
    assert stats.itl.samples == 3 * (MAX_TOKENS - 1)
    assert 0 < stats.ttft.p50 <= stats.ttft.p90 <= stats.ttft.p99
    assert 0 < stats.itl.p50 <= stats.itl.p90 <= stats.itl.p99
    assert stats.device.adapters == ("support",)
    assert stats.device.bytes == engine.lora_pool.bytes_used > 0
    assert stats.host.adapters == ("support",) and stats.host.bytes > 0
    assert stats.adapter_residency == {"support": "device"}
    assert stats.running_requests == stats.waiting_requests == stats.kv_blocks_used == 0


def test_snapshot_shows_requests_in_flight(tiny_model_dir):
    engine = build_engine(tiny_model_dir, max_num_seqs=2)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", prompt, params)
    assert engine.stats().waiting_requests == 3
    engine.step()
    stats = engine.stats()
    assert (stats.running_requests, stats.waiting_requests) == (2, 1)
    assert stats.kv_blocks_used > 0


def test_snapshot_holds_tenant_scheduling_as_last_set(tiny_model_dir):
    engine = build_engine(tiny_model_dir)
    engine.set_tenant_priority("acme", 3)
    engine.set_tenant_priority("acme", 7)
    engine.set_tenant_weight("acme", 2.5)
    stats = engine.stats()
    assert stats.tenant_priorities == {"acme": 7}
    assert stats.tenant_weights == {"acme": 2.5}


def test_async_engine_stats_run_on_the_engine_thread(tiny_model_dir):
    async def scenario():
        engine = AsyncEngine(build_engine(tiny_model_dir))
        try:
            params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
            async for _ in engine.generate("Hello", params):
                pass
            return await engine.stats()
        finally:
            await engine.stop()

    stats = asyncio.run(scenario())
    assert stats.ttft.samples == 1 and stats.itl.samples == 2
