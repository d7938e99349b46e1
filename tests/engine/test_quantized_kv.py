"""A quantized KV cache (``kv_cache_dtype`` int8 or fp8) gives transformers + PEFT's greedy
tokens when PEFT's own cache stores what the engine's reads back (``fake_quantize_kv``,
per token and KV head after RoPE: ``tests/engine/hf_reference.fake_quantized_cache``).

The batch mixes adapters with staggered arrivals; another test adds prefix hits, small
prefill chunks and preemption (a recomputed prompt writes the bytes its decode steps
wrote: a slot's bytes are its own token's), and int4 weights under it. The budget test
checks that the same bytes hold the smaller blocks.
"""

from __future__ import annotations

import pytest

from loramux.engine import EngineConfig
from loramux.kernels.dispatch import KERNELS_ENV
from loramux.kernels.kv_quant import QuantizedKV
from loramux.kernels.paged_attention import gather_kv
from tests.engine.factories import build_engine, put_adapters_on_device
from tests.engine.test_exactness import (
    assert_matches_reference,
    mixed_requests,
    run_staggered,
    tiny_adapters,  # noqa: F401 (fixture)
)
from tests.fixtures.models import build_dequantized_model

MODES = ["int8", "fp8"]


@pytest.mark.parametrize("kv_cache_dtype", MODES)
def test_mixed_staggered_batch_matches_peft_with_the_same_cache(
    tiny_model_dir,
    tiny_adapters,  # noqa: F811
    kv_cache_dtype,
):
    engine = build_engine(tiny_model_dir, tiny_adapters, kv_cache_dtype=kv_cache_dtype)
    keys, values = engine.arena.kv_caches[0]
    assert isinstance(keys, QuantizedKV) and isinstance(values, QuantizedKV)
    requests = mixed_requests(8)
    outputs = run_staggered(engine, requests, 16)
    assert_matches_reference(engine, tiny_model_dir, tiny_adapters, requests, outputs, 16)


def test_fp8_changes_tokens_and_the_reference_follows(tiny_model_dir):
    """The reference is not blind to the cache: fp8 (3 mantissa bits) changes the tiny
    model's greedy tokens, and the fake-quantized reference changes with them."""
    requests = mixed_requests(8)
    plain = run_staggered(build_engine(tiny_model_dir), [(p, None) for p, _ in requests], 16)
    engine = build_engine(tiny_model_dir, kv_cache_dtype="fp8")
    quantized = run_staggered(engine, [(p, None) for p, _ in requests], 16)
    assert plain != quantized
    assert_matches_reference(
        engine, tiny_model_dir, {}, [(p, None) for p, _ in requests], quantized, 16
    )


@pytest.mark.parametrize("kv_cache_dtype", MODES)
def test_prefix_hits_small_chunks_and_preemption_under_int4_weights_match_peft(
    tiny_model_dir,
    tiny_adapters,  # noqa: F811
    tmp_path_factory,
    kv_cache_dtype,
):
    engine = build_engine(
        tiny_model_dir,
        tiny_adapters,
        quantization="int4",
        kv_cache_dtype=kv_cache_dtype,
        # 384 blocks of 4 tokens (each 4 x 2 heads x (16 + 4) bytes per layer and tensor:
        # 640 bytes in all), i.e. 30 float32 rank-rows of 512 elements: the adapters' 28,
        # and 2 for KV, 25 whole blocks (100 tokens). The 8 requests want about 80 blocks
        # and are preempted, as test_exactness's are.
        kv_cache_bytes=384 * 640,
        max_model_len=96,
        block_size=4,
        max_prefill_chunk=5,
    )
    system = "You are a helpful assistant who answers briefly. "
    requests = [(system + p, a) for p, a in mixed_requests(8)]
    put_adapters_on_device(engine, tiny_adapters)  # KV left its floor: preemption
    outputs = run_staggered(engine, requests, 20)
    assert engine.num_preemptions > 0
    assert engine.kv.prefix_cache_hits > 0
    reference = build_dequantized_model(
        tiny_model_dir, tmp_path_factory.mktemp("deq-int4"), quantization="int4", group_size=32
    )
    assert_matches_reference(engine, reference, tiny_adapters, requests, outputs, 20)


def test_speculative_verification_over_an_int8_cache_matches_peft(
    tiny_model_dir,
    tiny_adapters,  # noqa: F811
):
    """n-gram proposals verified as short query rows over the 8-bit cache; rejected
    proposals' slots are written over (each slot's bytes its own token's)."""
    from tests.engine.speculative.test_speculative_engine import NGRAM, assert_speculated

    engine = build_engine(tiny_model_dir, tiny_adapters, kv_cache_dtype="int8", **NGRAM)
    requests = mixed_requests(6)
    outputs = run_staggered(engine, requests, 24)
    assert_speculated(engine)
    assert_matches_reference(engine, tiny_model_dir, tiny_adapters, requests, outputs, 24)


@pytest.mark.parametrize("kv_cache_dtype", MODES)
def test_the_torch_read_gives_the_native_read_s_tokens(
    tiny_model_dir,
    tiny_adapters,  # noqa: F811
    monkeypatch,
    kv_cache_dtype,
):
    """``LORAMUX_KERNELS=torch`` reads the cache with torch ops, the default natively
    (``kernels/kv_native.py``): the same tokens (the same bits, in fact)."""
    requests = mixed_requests(6)
    results = {}
    for kernels in ("auto", "torch"):
        monkeypatch.setenv(KERNELS_ENV, kernels)
        engine = build_engine(tiny_model_dir, tiny_adapters, kv_cache_dtype=kv_cache_dtype)
        native = engine.backend.attend.keywords["gather"] is not gather_kv
        assert native == (kernels == "auto")
        results[kernels] = run_staggered(engine, requests, 12)
    assert results["auto"] == results["torch"]


def test_the_same_budget_holds_the_smaller_blocks(tiny_model_dir):
    """int8 keys and values with their scales: 20 bytes a head-slot where float32 takes 64
    (head_dim 16), so 3.2x the blocks; a block is 160 of the rows' float32 elements, not
    512, and the rows adapters can hold above KV's floor grow with the bytes KV's floor
    no longer takes."""
    plain = build_engine(tiny_model_dir)
    int8 = build_engine(tiny_model_dir, kv_cache_dtype="int8")
    assert plain.arena.bytes_per_block == 8192 and int8.arena.bytes_per_block == 2560
    assert int8.kv.num_blocks == (16 << 20) // 2560 == 6553
    assert plain.kv.num_blocks == (16 << 20) // 8192
    assert (int8.arena.layout.block_elems, plain.arena.layout.block_elems) == (160, 512)
    for engine in (plain, int8):
        floor = engine.kv.min_limit
        assert floor == -(-engine.max_model_len // 16)
    rows_above_floor = {
        name: e.arena.layout.total_rows - e.arena.layout.first_row_for(e.kv.min_limit)
        for name, e in (("plain", plain), ("int8", int8))
    }
    assert rows_above_floor["int8"] > rows_above_floor["plain"]
    assert (
        "6,553 KV blocks of 16 tokens = 104,848 tokens (2.5 KiB a block, int8 keys and "
        in (int8.memory_plan.describe()[1])
    )


def test_config_names_the_modes():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8"):
        EngineConfig(model="m", kv_cache_dtype="int4")
