"""Adapters are staged only into memory no request was promised: many adapters, no thrash.

S-LoRA's S2 workload with 1,000 adapters collapsed on the H100 (3.3 req/s, 48 s median
time to first token) and, in simulation, to 1.9 req/s at a saturating rate: every step put
on the device the adapters of every waiting request its rows allowed, squeezing KV from
6,133 blocks to 261, so that 6-11 requests ran and the rest were preempted over and over.
The small trace here thrashed the same way before the fix (48 preemptions, KV squeezed from
256 blocks to 16, 4.2 requests running on average of 8 slots); now no request is preempted,
KV keeps the blocks its running requests may still need, and the slots stay full.
"""

from __future__ import annotations

import pytest

from loramux.engine.config import EngineConfig
from loramux.engine.lora.staging import PROMISE_HORIZON_TOKENS, KVPromise
from loramux.engine.memory.kv_cache import KVCacheManager
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.simulation.adapters import SimulatedAdapterSource
from loramux.engine.simulation.devices import simulated_engine
from loramux.engine.simulation.driver import TraceRequest, run_trace
from loramux.engine.simulation.profile import DeviceProfile
from tests.engine.test_scheduler import make_seq

NUM_ADAPTERS = 40
RANK = 8  # 8 of the tiny model's rows: 8 KV blocks (its float32 rows and blocks are equal)


@pytest.fixture(scope="module")
def profile() -> DeviceProfile:
    return DeviceProfile.load("nvidia-h100-80gb-hbm3")


def many_adapter_engine(model_dir, profile, **overrides):
    settings = {"kv_cache_bytes": 2 << 20, **overrides}  # 256 blocks, a rank-row each
    engine = simulated_engine(
        EngineConfig(
            model=str(model_dir),
            device="cpu",
            dtype="float32",
            max_num_seqs=8,
            max_num_batched_tokens=256,
            max_model_len=256,
            prefill_step_target_s=float("inf"),
            cuda_graph_max_batch=8,
            **settings,
        ),
        profile,
    )
    for i in range(NUM_ADAPTERS):  # every adapter in host RAM: only device rows are short
        name = f"a{i}"
        source = SimulatedAdapterSource(name, RANK, engine.clock, profile)
        request = engine.register_adapter(name, source)
        engine.tiers.keep_in_host(
            request.adapter_id,
            source.weights(engine.model_config, name=name, dtype=engine.config.torch_dtype),
        )
    return engine


def burst(num_requests: int, tenant: str = "t") -> list[TraceRequest]:
    """A request per adapter in turn, all at once: far more than the device holds."""
    return [
        TraceRequest(
            arrival=0.0,
            request_id=f"{tenant}{i}",
            prompt=[300 + (7 * i + t) % 1500 for t in range(40)],
            max_tokens=40,  # 80 tokens at the longest: 5 blocks
            adapter=f"a{i % NUM_ADAPTERS}",
            tenant=tenant,
        )
        for i in range(num_requests)
    ]


def test_a_burst_over_many_adapters_runs_without_preemption_or_squeezed_kv(tiny_model_dir, profile):
    engine = many_adapter_engine(tiny_model_dir, profile)
    assert engine.kv.num_blocks == 256
    lowest_limit, running_counts, promised_short = engine.kv.limit, [], 0
    step = engine.step

    def watched_step():
        nonlocal lowest_limit, promised_short
        outputs = step()
        running = engine.scheduler.running
        lowest_limit = min(lowest_limit, engine.kv.limit)
        running_counts.append(len(running))
        # Every running request can still grow to its longest within KV's limit.
        promised = sum(max(len(engine.kv.block_table(s.request_id)), 5) for s in running)
        promised_short = max(promised_short, promised - engine.kv.limit)
        return outputs

    engine.step = watched_step
    try:
        served = run_trace(engine, burst(3 * NUM_ADAPTERS))
    finally:
        engine.close()
    assert len(served) == 3 * NUM_ADAPTERS
    assert all(len(o.token_ids) == 40 for o in served.values())
    assert engine.stats().preemptions == 0
    assert promised_short <= 0
    # Adapters took what the running requests left: KV never fell below the 8 slots'
    # requests at their longest (5 blocks each), and the slots stayed full.
    assert lowest_limit >= 8 * 5
    assert sum(running_counts) / len(running_counts) >= 7
    # Adapters came and went through their rows: the trace exercises residency.
    assert engine.tiers.device_evictions > NUM_ADAPTERS


def test_an_adapter_waiting_for_promised_memory_is_served_within_a_bound_without_preemption(
    tiny_model_dir, profile
):
    """A stream of requests for an adapter on the device would keep KV promised forever;
    the large adapter that waits for that memory gets it once it has waited
    ``adapter_wait_steps``: nothing else is admitted until it is, the running requests
    finish and give it their blocks, and none of them is preempted."""
    wait_steps = 8
    engine = many_adapter_engine(
        tiny_model_dir, profile, kv_cache_bytes=512 << 10, adapter_wait_steps=wait_steps
    )
    big = SimulatedAdapterSource("big", 32, engine.clock, profile)
    request = engine.register_adapter("big", big)
    engine.tiers.keep_in_host(
        request.adapter_id,
        big.weights(engine.model_config, name="big", dtype=engine.config.torch_dtype),
    )
    params = engine_params(40)
    try:
        first_token_step, step = None, 0
        while first_token_step is None:
            step += 1
            assert step <= wait_steps + 2 * 40 + 8, "the large adapter's request starved"
            engine.add_request(f"s{step}", [400 + step, 401, 402] * 10, params, adapter="a0")
            if step == 4:
                engine.add_request("cold", [500 + t for t in range(30)], params, adapter="big")
            for output in engine.step():
                if output.request_id == "cold" and output.token_ids:
                    first_token_step = step
        assert engine.residency.waits_for_kv(request.adapter_id) is False
        assert engine.stats().preemptions == 0
        assert first_token_step > 4 + wait_steps  # it did wait for the memory
    finally:
        engine.close()


def engine_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)


def test_a_tenants_huge_max_tokens_cannot_promise_away_anothers_adapter_room(
    tiny_model_dir, profile
):
    """Four requests that may each grow to 220 tokens hold 8 blocks now but are promised 56
    of the 64, above their tenant's half. Another tenant's 8-row adapter is staged at once
    (were the whole promise protected, it would wait for them to finish): a tenant's promise
    is protected only up to its share."""
    engine = many_adapter_engine(tiny_model_dir, profile, kv_cache_bytes=512 << 10)
    assert engine.kv.num_blocks == 64
    try:
        long = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)
        for i in range(4):
            engine.add_request(f"h{i}", [600 + i] * 20, long, tenant="hog")
        engine.step()
        engine.add_request(
            "v", [700 + t for t in range(20)], engine_params(4), adapter="a1", tenant="v"
        )
        first = None
        for step in range(1, 20):
            for output in engine.step():
                if output.request_id == "v" and output.token_ids and first is None:
                    first = step
            if first is not None:
                break
        assert first is not None and first <= 2, first
        assert engine.stats().preemptions == 0
        assert all(engine.kv.has(f"h{i}") for i in range(4))  # the hog runs on
    finally:
        engine.close()


def test_a_request_that_may_run_to_a_long_context_is_promised_a_horizon_not_all_of_it():
    """Chat without ``max_tokens`` may run to the end of the context and rarely does: its
    whole context promised would keep every adapter off the device while it runs."""
    kv = KVCacheManager(4096, 16)
    short, chat = make_seq("short", 20, 100), make_seq("chat", 20, 100_000)
    promise = KVPromise(kv, [], [short, chat], {})
    assert promise.blocks_for(short) == -(-120 // 16)  # its whole length: within the horizon
    assert promise.blocks_for(chat) == -(-(20 + PROMISE_HORIZON_TOKENS) // 16)
