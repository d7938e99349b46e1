"""Engine.stats(): the rolling latency windows, the snapshot of load, KV and adapter tiers,
and the snapshot's JSON form."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import types
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loramux.engine import AsyncEngine, SamplingParams
from loramux.engine.memory.plan import MemoryPlan
from loramux.engine.residency import ResidencyStats
from loramux.engine.stats import (
    EngineStats,
    LatencySummary,
    LatencyWindow,
    SpeculationStats,
    TierStats,
    percentile,
)
from loramux.engine.structured import GrammarCacheStats
from loramux.engine.tenant_share import TenantShareStats, with_shares
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


# --- the JSON form ---------------------------------------------------------------------------


def _full_stats() -> EngineStats:
    """Every field set, none to its default."""
    return EngineStats(
        running_requests=1,
        waiting_requests=2,
        kv_blocks_used=3,
        kv_blocks_usable=10,
        kv_blocks_total=12,
        kv_block_size=16,
        device=TierStats(adapters=("a",), bytes=100, capacity_bytes=1000),
        host=TierStats(adapters=("a", "b"), bytes=200, capacity_bytes=2000),
        adapter_residency={"a": "device", "b": "host", "c": "store"},
        pinned_adapters={"a": "pinned", "b": "loading"},
        ttft=LatencySummary(samples=3, p50=0.1, p90=0.2, p99=None),
        itl=LatencySummary(samples=0, p50=None, p90=None, p99=None),
        window_s=120.0,
        tenant_priorities={None: 0, "t1": 5},
        tenant_weights={None: 1.0, "t1": 2.5},
        kv_blocks_held=4,
        preemptions=7,
        residency=ResidencyStats(7, 5, 3, 9, 1.5, 2.5, 3.0, 0.25, 30.0, True),
        memory=MemoryPlan(
            budget_bytes=1 << 30,
            source="set",
            detail="set by kv_cache_bytes",
            device="cuda:0",
            block_size=16,
            kv_block_bytes=737_280,
            kv_blocks=1456,
            kv_tokens=23_296,
            adapter_row_bytes=1_244_160,
            rank=16,
            full_batch_requests=64,
            full_batch_context=512,
            full_batch_blocks=2048,
            adapters_beside_full_batch=0,
            adapters_max=40,
            kv_cache_dtype="fp8",
            scratch_blocks=1,
            adapter_max_rows=600,
            adapter_reserve_rows=16,
            adapter_capacity_rows=500,
            kv_floor_blocks=128,
            max_model_len=2048,
            draft_kv_bytes=1 << 20,
        ),
        tenants=with_shares(
            {
                None: TenantShareStats(5, 0, 5, 0, queued_requests=0, running_requests=1, weight=1),
                "t1": TenantShareStats(90, 30, 9, 3, 5, 2, weight=2.5),
            }
        ),
        share_window_s=45.0,
        speculative_method="draft",
        num_speculative_tokens=4,
        speculation={"": SpeculationStats(12, 9, 4, 10, 19), "a": SpeculationStats(8, 2, 3, 6, 8)},
        grammar_cache=GrammarCacheStats(*range(1, 13)),
        lora_launches_per_decode_step=120,
        lora_launches_per_layer=4.0,
    )


def _defaulted(cls) -> dict[str, object]:
    """``cls``'s fields that have a default, with it."""
    return {
        f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(cls)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    }


def _through_json(data):
    return json.loads(json.dumps(data))


def test_a_fully_populated_snapshot_round_trips():
    stats = _full_stats()
    for value, cls in [(stats, EngineStats), (stats.memory, MemoryPlan)]:
        for name, default in _defaulted(cls).items():
            assert getattr(value, name) != default, f"{cls.__name__}.{name} left at its default"
    back = EngineStats.from_json(_through_json(stats.to_json()))
    assert back == stats
    assert back.device.adapters == ("a",)  # a tuple again
    assert back.tenants[None].weight == 1 and back.speculation[""].acceptance_rate == 0.75


def test_tenant_maps_travel_as_pairs_and_speculation_by_adapter():
    data = _through_json(_full_stats().to_json())
    assert data["tenant_priorities"] == [[None, 0], ["t1", 5]]
    assert data["tenant_weights"] == [[None, 1.0], ["t1", 2.5]]
    assert [tenant for tenant, _ in data["tenants"]] == [None, "t1"]
    assert set(data["speculation"]) == {"", "a"}
    assert "rank_adapter_bytes" not in data["memory"]  # properties are computed, not sent


def _old_engine_json() -> dict:
    """An engine from before the memory plan, residency counts, per-tenant service,
    speculation and grammar-cache figures: ``residency`` was adapter -> tier."""
    latency = {"samples": 0, "p50": None, "p90": None, "p99": None}
    tier = {"adapters": ["a"], "bytes": 10, "capacity_bytes": 100}
    return {
        "running_requests": 0,
        "waiting_requests": 0,
        "kv_blocks_used": 0,
        "kv_blocks_usable": 8,
        "kv_blocks_total": 8,
        "kv_block_size": 16,
        "device": tier,
        "host": tier,
        "residency": {"a": "device"},
        "ttft": latency,
        "itl": latency,
        "window_s": 300.0,
        "tenant_priorities": [[None, 0]],
        "tenant_weights": [],
    }


def test_an_older_engines_snapshot_parses_with_defaults():
    stats = EngineStats.from_json(_old_engine_json())
    assert stats.adapter_residency == {"a": "device"}
    assert stats.tenant_priorities == {None: 0} and stats.tenant_weights == {}
    for name, default in _defaulted(EngineStats).items():
        assert getattr(stats, name) == default, name


def test_an_older_memory_plan_parses_with_defaults():
    data = _full_stats().to_json()
    for name in ("kv_cache_dtype", "scratch_blocks", "max_model_len", "draft_kv_bytes"):
        del data["memory"][name]
    memory = EngineStats.from_json(data).memory
    assert (memory.kv_cache_dtype, memory.scratch_blocks, memory.max_model_len) == ("auto", 0, 0)
    assert memory.kv_floor_blocks == 128  # what it did send is kept


def test_figures_a_newer_engine_adds_are_dropped():
    data = _full_stats().to_json()
    data["a_figure_from_the_future"] = 1
    data["memory"]["another"] = "x"
    data["tenants"][1][1]["and_another"] = 2.0
    assert EngineStats.from_json(data) == _full_stats()


def _values(hint) -> st.SearchStrategy:
    """Any value of a field's declared type (finite floats: NaN is not equal to itself)."""
    arms = [arm for arm in typing.get_args(hint) if arm is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return st.none() | _values(arms[0])
    origin = typing.get_origin(hint) or hint
    if dataclasses.is_dataclass(origin):
        hints = typing.get_type_hints(origin)
        return st.builds(
            origin, **{f.name: _values(hints[f.name]) for f in dataclasses.fields(origin)}
        )
    if origin is dict:
        return st.dictionaries(_values(arms[0]), _values(arms[1]), max_size=3)
    if origin is tuple:
        return st.lists(_values(arms[0]), max_size=3).map(tuple)
    simple = {
        int: st.integers(),
        float: st.floats(allow_nan=False, allow_infinity=False),
        str: st.text(max_size=8),
        bool: st.booleans(),
    }
    return simple[origin]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stats=_values(EngineStats))
def test_any_snapshot_round_trips_through_json(stats):
    assert EngineStats.from_json(_through_json(stats.to_json())) == stats
