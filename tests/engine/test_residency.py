"""When memory is the limit: preemptions, device evictions, re-loads and adapter-room waits,
counted since the start and over the last minute, and the warning when adapters thrash."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import generate_latest

from loramux.engine import SamplingParams
from loramux.engine.memory.arena import RowLayout
from loramux.engine.model.config import ModelConfig
from loramux.engine.residency import ResidencyCounts, ResidencyStats, ResidencyWatch
from tests.engine.factories import build_engine

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
LOG = logging.getLogger("tests.residency")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def counts(preemptions=0, evictions=0, reloads=0, waits=0) -> ResidencyCounts:
    return ResidencyCounts(preemptions, evictions, reloads, waits)


# --- the watch -------------------------------------------------------------------------------


def test_rates_count_the_last_minute():
    clock = FakeClock()
    watch = ResidencyWatch(advice="do something", log=LOG, clock=clock)
    assert watch.stats(counts()) == ResidencyStats()
    clock.now += 10
    watch.observe(counts(1, 4, 2, 6))
    clock.now += 20
    watch.observe(counts(3, 10, 5, 6))
    stats = watch.stats(counts(3, 10, 5, 6))
    # Younger than the window: everything since the start.
    assert (stats.preemptions, stats.adapter_evictions) == (3, 10)
    assert (stats.adapter_reloads, stats.adapter_room_wait_steps) == (5, 6)
    assert stats.preemptions_per_min == 3.0 and stats.adapter_reloads_per_min == 5.0
    clock.now += 45  # the first observation (at +10 s) is now 65 s old, the second 45 s
    stats = watch.stats(counts(3, 10, 5, 6))
    assert stats.preemptions_per_min == 2.0
    assert stats.adapter_evictions_per_min == 6.0
    assert stats.adapter_reloads_per_min == 3.0
    assert stats.adapter_room_wait_steps_per_min == 0.0
    assert stats.adapter_reloads == 5  # the totals stay
    clock.now += 60
    assert watch.stats(counts(3, 10, 5, 6)).adapter_reloads_per_min == 0.0


def test_history_keeps_one_entry_a_second():
    clock = FakeClock()
    watch = ResidencyWatch(advice="", log=LOG, clock=clock)
    for step in range(1, 1001):  # 1,000 steps over 100 s
        clock.now += 0.1
        watch.observe(counts(evictions=step))
    assert len(watch._history) <= 62
    assert 590 <= watch.stats(counts(evictions=1000)).adapter_evictions_per_min <= 610


def test_thrashing_warns_at_most_once_a_minute(caplog):
    clock = FakeClock()
    watch = ResidencyWatch(advice="raise the budget", log=LOG, clock=clock)
    with caplog.at_level(logging.WARNING, logger="tests.residency"):
        for second in range(1, 121):
            clock.now += 1
            # One re-load a second: 30 in the first 30 s, then on.
            watch.observe(counts(preemptions=second // 10, reloads=second, waits=2 * second))
    assert watch.warnings == 2  # at 30 s and at 90 s
    first = caplog.records[0].getMessage()
    assert first.startswith("adapters are thrashing: per minute over the last 60 s, 30 adapter")
    assert "30 adapter re-loads" in first and "60 steps in which a request waited" in first
    assert "3 preemptions" in first
    assert first.endswith("device memory, not compute, limits this engine: raise the budget")
    assert watch.stats(counts(12, 0, 120, 240)).thrashing


def test_a_few_reloads_are_not_thrashing(caplog):
    clock = FakeClock()
    watch = ResidencyWatch(advice="", log=LOG, clock=clock)
    with caplog.at_level(logging.WARNING, logger="tests.residency"):
        for second in range(1, 200):
            clock.now += 3  # one every three seconds: 20 a minute
            watch.observe(counts(reloads=second))
    assert watch.warnings == 0 and not caplog.records
    assert not watch.stats(counts(reloads=199)).thrashing


# --- through an engine -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def three_adapters(tiny_model_dir, make_adapter):
    return {
        name: make_adapter(tiny_model_dir, rank=4, targets=("q_proj", "v_proj"), seed=seed)
        for seed, name in enumerate(("a", "b", "c"), start=40)
    }


def two_adapter_engine(model_dir, adapters, **overrides):
    """Device room for two of the three rank-4 adapters (8 rows)."""
    config = ModelConfig.from_pretrained(model_dir)
    row_bytes = 2 * config.num_layers * RowLayout.for_model(config, 1, 16).row_width * 4  # fp32
    engine = build_engine(model_dir, adapter_device_bytes=8 * row_bytes, **overrides)
    assert engine.lora_pool.capacity == 8
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    return engine


def sample(engine, name: str, **labels) -> float:
    return engine.metrics.registry.get_sample_value(name, labels or None)


def test_an_adapter_back_on_the_device_after_eviction_is_a_reload(tiny_model_dir, three_adapters):
    engine = two_adapter_engine(tiny_model_dir, three_adapters)
    for name in ("a", "b", "c", "a"):  # c evicts a (least recent); a's return evicts b
        engine.generate(["Hello"], GREEDY, adapters=[name])
    residency = engine.stats().residency
    assert residency.adapter_evictions == 2
    assert residency.adapter_reloads == 1  # a; b and c were loaded for the first time
    assert residency.adapter_reloads_per_min == 1.0
    assert residency.adapter_room_wait_steps == 0  # evicting idle ones made room at once
    assert residency.preemptions == 0 and not residency.thrashing
    assert sample(engine, "loramux_adapter_reloads_total") == 1
    assert sample(engine, "loramux_adapter_evictions_total", tier="device") == 2
    assert sample(engine, "loramux_adapter_room_wait_steps_total") == 0


def test_steps_in_which_a_request_waits_for_adapter_room_are_counted(
    tiny_model_dir, three_adapters
):
    engine = two_adapter_engine(tiny_model_dir, three_adapters)
    long = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outs = engine.generate(["Hello", "Hi", "Hey"], long, adapters=["a", "b", "c"])
    assert all(out.finish_reason == "length" for out in outs)
    residency = engine.stats().residency
    # a and b run (pinned) for 5 steps; c waits for room meanwhile, then evicts one.
    assert residency.adapter_room_wait_steps >= 4
    assert residency.adapter_room_wait_steps_per_min == residency.adapter_room_wait_steps
    assert residency.adapter_evictions == 1 and residency.adapter_reloads == 0
    assert sample(engine, "loramux_adapter_room_wait_steps_total") == (
        residency.adapter_room_wait_steps
    )
    text = generate_latest(engine.metrics.registry).decode()
    assert "loramux_adapter_reloads_total 0.0" in text
    assert f"loramux_adapter_room_wait_steps_total {residency.adapter_room_wait_steps}.0" in text


def test_an_engine_without_pressure_counts_nothing(tiny_model_dir, three_adapters):
    engine = build_engine(tiny_model_dir, adapters=three_adapters)
    engine.generate(["Hello", "Hi", "Hey", "Yo"], GREEDY, adapters=["a", "b", "c", "a"])
    assert engine.stats().residency == ResidencyStats()


def test_an_engine_whose_adapters_thrash_says_so(tiny_model_dir, three_adapters, caplog):
    """One request at a time, cycling over three adapters with room for two: every load
    evicts the adapter needed next."""
    engine = two_adapter_engine(tiny_model_dir, three_adapters, max_num_seqs=1)
    one_token = SamplingParams(max_tokens=1, temperature=0.0)
    with caplog.at_level(logging.WARNING, logger="loramux.engine.engine"):
        engine.generate(["Hi"] * 45, one_token, adapters=list("abc" * 15))
    residency = engine.stats().residency
    assert residency.adapter_reloads == 42  # all but the first three loads
    assert residency.adapter_evictions == 43 and residency.thrashing
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("adapters are thrashing: per minute over the last 60 s, 30 adapter")
    assert warning.endswith(
        "raise kv_cache_bytes (LORAMUX_ENGINE_KV_CACHE_BYTES; now 16 MiB, set by kv_cache_bytes), "
        "or lower max_num_seqs (1)"
    )
