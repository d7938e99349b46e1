"""Memory for cold adapters within bounded time, and a per-tenant share of KV and slots.

A flood of one tenant's long requests keeps every KV block busy, the top ones included,
where a new adapter's device rows must go. Another tenant's request for an adapter that is
not on the device must still get its rows (and its first token) within a bounded number
of steps; another tenant's base-model request must not wait for the flood to drain.
"""

from __future__ import annotations

import pytest

from loramux.engine import Engine, EngineConfig, SamplingParams
from tests.engine.factories import UNTIMED_PREFILL_S

FLOOD = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
WAIT_STEPS = 8


@pytest.fixture(scope="module")
def cold_adapter(tiny_model_dir, make_adapter):
    return make_adapter(tiny_model_dir, rank=8, targets=("q_proj", "v_proj", "o_proj"), seed=1)


def flooded_engine(model_dir, adapter_dir) -> Engine:
    """64 KV blocks, 16 slots; tenant A's 24 requests of up to 210 tokens want them all."""
    engine = Engine(
        EngineConfig(
            model=str(model_dir),
            kv_cache_bytes=512 << 10,  # 64 blocks of this model (one adapter row per block)
            dtype="float32",
            max_num_seqs=16,
            max_num_batched_tokens=512,
            max_model_len=256,
            adapter_wait_steps=WAIT_STEPS,
        )
    )
    assert engine.kv.num_blocks == 64
    engine.add_adapter("cold", adapter_dir)  # in host RAM, not on the device
    for i in range(24):
        prompt = [1000 + i + t for t in range(60)]
        engine.add_request(f"a{i}", prompt, FLOOD, tenant="A")
    for _ in range(60):
        engine.step()
    return engine


def steps_to_first_token(
    engine: Engine, request_ids: set[str], limit: int, watch=lambda: None
) -> dict[str, int]:
    first: dict[str, int] = {}
    for step in range(1, limit + 1):
        for out in engine.step():
            if out.request_id in request_ids and out.token_ids:
                first.setdefault(out.request_id, step)
        engine.kv.check_invariants()
        engine.lora_pool.check_invariants()
        watch()
        if first.keys() == request_ids:
            break
    return first


def test_a_cold_adapter_gets_device_rows_within_a_bounded_number_of_steps(
    tiny_model_dir, cold_adapter
):
    engine = flooded_engine(tiny_model_dir, cold_adapter)
    # The flood holds the very blocks the adapter's rows need: it cannot load as things are.
    needed = engine.lora_pool.kv_limit_needed(8)
    assert needed is not None
    busy = {b for i in range(24) if engine.kv.has(f"a{i}") for b in engine.kv.block_table(f"a{i}")}
    assert any(block >= needed for block in busy)

    engine.add_request("b", list(range(2000, 2020)), SHORT, adapter="cold", tenant="B")
    preempted = engine.stats().preemptions
    held = []  # what the engine shows while the adapter waits: the blocks held for it
    first = steps_to_first_token(
        engine, {"b"}, limit=60, watch=lambda: held.append(engine.stats().kv_blocks_held)
    )
    # The hold keeps the released top blocks; after WAIT_STEPS their holders are preempted;
    # then a step to copy the adapter in and one to prefill.
    assert first.get("b", 61) <= WAIT_STEPS + 3, first
    assert engine.adapter_residency()["cold"] == "device"
    assert engine.kv.hold is None and engine.kv.num_held_blocks == 0  # released once loaded
    assert max(held) > 0 and held[-1] == 0
    assert engine.stats().preemptions > preempted
    # The flood goes on (preempted requests recompute; none failed).
    assert sum(engine.kv.has(f"a{i}") for i in range(24)) > 0
    for i in range(24):
        engine.abort(f"a{i}")


def test_another_tenant_is_admitted_at_once_however_full_kv_is(tiny_model_dir, cold_adapter):
    engine = flooded_engine(tiny_model_dir, cold_adapter)
    assert engine.kv.num_free_blocks < 2  # C's prompt needs 2 blocks
    engine.add_request("c", list(range(3000, 3020)), SHORT, tenant="C")
    # A's own newest request does not jump the queue by the same rule: it is over its share.
    engine.add_request("a-late", list(range(4000, 4020)), SHORT, tenant="A")
    first = steps_to_first_token(engine, {"c", "a-late"}, limit=3)
    assert first.get("c") == 1
    assert "a-late" not in first


# 64 KV blocks of the tiny model: float32 blocks of 8 KiB; int8 ones of 2.5 KiB (2 KiB of
# 8-bit keys and values, 512 bytes of scales), a rank-row then spanning 4 blocks.
KV_BYTES_FOR_64_BLOCKS = {"auto": 512 << 10, "int8": 64 * 2560}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_blocks_in_an_adapters_way_are_moved_not_recomputed_and_keep_their_tokens(
    tiny_model_dir, cold_adapter, kv_cache_dtype
):
    """A long request whose blocks sit where the adapter's rows go is copied below (free
    blocks there), not preempted: the adapter loads at once and the request's tokens are
    those of an undisturbed run (a quantized cache's moves carry each slot's scales)."""
    config = {
        "model": str(tiny_model_dir),
        "kv_cache_bytes": KV_BYTES_FOR_64_BLOCKS[kv_cache_dtype],
        "kv_cache_dtype": kv_cache_dtype,
        "dtype": "float32",
        "max_num_seqs": 8,
        "max_num_batched_tokens": 1024,
        "max_model_len": 256,
        "adapter_wait_steps": 1000,  # no preemption: only moving can make the room
        "prefill_step_target_s": UNTIMED_PREFILL_S,  # placement by tokens, not the load
    }
    long_prompt = [500 + t for t in range(200)]
    long_params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    undisturbed = Engine(EngineConfig(**config)).generate([long_prompt], long_params)[0]

    engine = Engine(EngineConfig(**config))
    assert engine.kv.num_blocks == 64
    engine.add_adapter("cold", cold_adapter)
    # Fillers take the bottom 48 blocks for one step, so the long request's 13 blocks go
    # above them, up to where the adapter's rows must go.
    for i in range(4):
        filler = [3000 + 200 * i + t for t in range(190)]
        engine.add_request(f"filler{i}", filler, SamplingParams(max_tokens=1))
    engine.add_request("long", long_prompt, long_params)
    outputs = []
    while not engine.kv.has("long") or engine.kv.has("filler0"):
        outputs += [o for o in engine.step() if o.request_id == "long"]
    needed = engine.lora_pool.kv_limit_needed(8)
    assert any(block >= needed for block in engine.kv.block_table("long"))

    engine.add_request("b", list(range(2000, 2020)), SHORT, adapter="cold")
    first = None
    for step in range(1, 200):
        for out in engine.step():
            if out.request_id == "long":
                outputs.append(out)
            elif out.request_id == "b" and first is None:
                first = step
        engine.kv.check_invariants()
        if not engine.has_unfinished_requests():
            break
    assert first is not None and first <= 3  # moved at once, loaded, prefilled
    assert engine.metrics.kv_blocks_moved._value.get() > 0
    assert engine.num_preemptions == 0
    assert outputs[-1].finished and outputs[-1].token_ids == undisturbed.token_ids
