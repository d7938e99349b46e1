"""The simulated GPU runs the engine's real scheduler, KV manager, adapter pool, tiers and
loader threads on simulated time: a trace is served whole and the same way every time, a
cold adapter waits its fetch's simulated time, and every scheduling decision equals that of
a real CPU engine given the same trace and the same clock."""

from __future__ import annotations

import random
import time

import pytest
import torch

from loramux.engine.config import EngineConfig
from loramux.engine.engine import Engine
from loramux.engine.executor.local import OneDevice
from loramux.engine.simulation.adapters import SimulatedAdapterSource
from loramux.engine.simulation.arena import GeometryArena
from loramux.engine.simulation.clock import SimulatedClock
from loramux.engine.simulation.devices import simulated_engine, simulated_executor
from loramux.engine.simulation.driver import TraceRequest, run_trace
from loramux.engine.simulation.profile import DeviceProfile

RANKS = (64, 32)
# Slow fetches (the store at 2% of the profile's rate), so adapters arrive while others' requests run.
SLOW_STORE = {"store_bytes_per_s": 0.02}


@pytest.fixture(scope="module")
def profile() -> DeviceProfile:
    return DeviceProfile.load("nvidia-h100-80gb-hbm3").scaled(**SLOW_STORE)


def config(model_dir, **overrides) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        device="cpu",
        dtype="float32",
        # Room for about two adapters beside the requests: they are evicted and loaded again.
        kv_cache_bytes=1 << 20,
        max_num_seqs=6,
        max_num_batched_tokens=96,
        adapter_load_workers=2,
        prefill_step_target_s=float("inf"),
        cuda_graph_max_batch=4,
        **overrides,
    )


def trace(num_requests=24, num_adapters=6, seed=3) -> list[TraceRequest]:
    rng = random.Random(seed)
    arrival, requests = 0.0, []
    for i in range(num_requests):
        arrival += rng.expovariate(40.0)
        adapter = rng.randrange(num_adapters + 1)
        requests.append(
            TraceRequest(
                arrival=arrival,
                request_id=f"r{i}",
                prompt=[rng.randrange(200, 2000) for _ in range(rng.randint(4, 60))],
                max_tokens=rng.randint(2, 24),
                adapter=None if adapter == num_adapters else f"a{adapter}",
            )
        )
    return requests


def register(engine, profile, num_adapters=6, *, materialize=False) -> None:
    for i in range(num_adapters):
        name = f"a{i}"
        source = SimulatedAdapterSource(
            name, RANKS[i % 2], engine.clock, profile, materialize_weights=materialize
        )
        engine.register_adapter(name, source)


def record_decisions(engine) -> list:
    """Each executed step's (request, tokens) pairs and the preemptions so far."""
    decisions = []
    execute = engine.executor.execute

    def recorded(batch):
        decisions.append(
            (
                [(item.seq.request_id, item.num_tokens) for item in batch.scheduled],
                engine.scheduler.num_preemptions,
            )
        )
        return execute(batch)

    engine.executor.execute = recorded
    return decisions


def simulate(model_dir, profile):
    engine = simulated_engine(config(model_dir), profile)
    try:
        register(engine, profile)
        decisions = record_decisions(engine)
        served = run_trace(engine, trace())
        return engine, decisions, served
    finally:
        engine.close()


def test_a_simulated_run_serves_the_trace_whole_and_the_same_way_every_time(
    tiny_model_dir, profile
):
    engine, decisions, served = simulate(tiny_model_dir, profile)
    requests = trace()
    assert set(served) == {r.request_id for r in requests}
    for request in requests:
        output = served[request.request_id]
        assert output.finish_reason == "length"
        assert len(output.token_ids) == request.max_tokens
    # Adapters came and went: the trace exercises residency, not just the steps.
    assert engine.tiers.device_evictions > 0
    # What the engine times by window (the thrash watch, tenant shares) is on its clock too.
    simulated_now = engine.clock.now()
    assert 0 < simulated_now < time.monotonic()
    assert all(t <= simulated_now for t, _ in engine.residency.watch._history)
    assert engine.observer.tenant_share._clock() == simulated_now
    timings = {
        rid: (o.metrics.first_token_time, o.metrics.finished_time) for rid, o in served.items()
    }
    _, again, served_again = simulate(tiny_model_dir, profile)
    assert again == decisions
    assert {
        rid: (o.metrics.first_token_time, o.metrics.finished_time)
        for rid, o in served_again.items()
    } == timings


def test_a_cold_adapter_waits_its_fetch_in_simulated_time(tiny_model_dir, profile):
    engine = simulated_engine(config(tiny_model_dir), profile)
    try:
        register(engine, profile)
        arrivals = [
            TraceRequest(0.0, "cold", [300, 301, 302], 4, adapter="a0"),
            TraceRequest(0.0, "base", [300, 301], 4),
        ]
        served = run_trace(engine, arrivals)
        fetch = SimulatedAdapterSource("a0", RANKS[0], engine.clock, profile).fetch_seconds(
            engine.model_config, engine.config.torch_dtype
        )
        cold, base = served["cold"].metrics, served["base"].metrics
        assert cold.first_token_time - cold.arrival_time >= fetch > 0.01
        # The base model's request, beside it, is not held by the fetch.
        assert base.finished_time - base.arrival_time < fetch
    finally:
        engine.close()


class ClockedDevice(OneDevice):
    """The real CPU engine on a simulated clock: its own model computes the tokens, the
    simulated executor (over a geometry twin of its arena) moves the clock."""

    def __init__(self, profile: DeviceProfile):
        super().__init__(torch.device("cpu"), None)
        self.clock = SimulatedClock()
        self.profile = profile

    def arena(self, *args, **kwargs):
        self.twin = GeometryArena(*args, **kwargs)
        return super().arena(*args, **kwargs)

    def adapter_rows(self, arena):
        return TwinRows(arena, self.twin)

    def load_model(self, config, *, quant_op):
        self.config = config
        return super().load_model(config, quant_op=quant_op)

    def executor(self, local, pool):
        real = local()
        simulated = simulated_executor(
            self.profile, self.config, real.model.config, self.clock, self.twin, pool
        )
        return ClockedExecutor(real, simulated)


class TwinRows:
    """The real arena's rows, every change also counted by its geometry twin."""

    def __init__(self, real, twin):
        self.real, self.twin = real, twin
        self.layout, self.num_layers, self.device = real.layout, real.num_layers, real.device

    def __getattr__(self, name):
        return getattr(self.real, name)

    def write_adapter(self, start, weights):
        self.twin.write_adapter(start, weights)
        self.real.write_adapter(start, weights)

    def zero_rows(self, start, end):
        self.twin.zero_rows(start, end)
        self.real.zero_rows(start, end)

    def move_rows(self, src, dst, count):
        self.twin.move_rows(src, dst, count)
        self.real.move_rows(src, dst, count)


class ClockedExecutor:
    """The real executor's tokens; the simulated executor's time."""

    interruptible = False

    def __init__(self, real, simulated):
        self.real, self.simulated, self.interrupt = real, simulated, None

    def execute(self, batch):
        result = self.real.execute(batch)
        self.simulated.execute(batch)
        return result

    def copy_kv_blocks(self, moves):
        self.real.copy_kv_blocks(moves)
        self.simulated.copy_kv_blocks(moves)


def test_scheduling_decisions_equal_a_real_cpu_engines_on_the_same_trace_and_clock(
    tiny_model_dir, profile
):
    _, simulated, served = simulate(tiny_model_dir, profile)
    device = ClockedDevice(profile)
    real = Engine(config(tiny_model_dir), devices=device)
    device.clock.activity = real.residency.tiers.loader.activity
    try:
        register(real, profile, materialize=True)
        decisions = record_decisions(real)
        real_served = run_trace(real, trace())
    finally:
        real.close()
    assert len(decisions) > 20
    assert decisions == simulated
    for rid, output in served.items():
        real_metrics = real_served[rid].metrics
        assert output.metrics.first_token_time == real_metrics.first_token_time
        assert len(real_served[rid].token_ids) == len(output.token_ids)
