"""On a CUDA device: the engine's Triton path and its copy stream give PEFT's tokens.

Skipped without a GPU (the ``gpu`` marker); on one, these are the first things to run:
the same checks as the CPU exactness tests, with the Triton kernels compiled for real,
adapters copied to the device on the pool's own stream while steps run, and the
adapter tiers evicting and reloading.
"""

from __future__ import annotations

import pytest

from loramux.engine import SamplingParams
from loramux.engine.lora.source import LocalDirectorySource
from tests.engine.factories import build_engine
from tests.engine.hf_reference import greedy_tokens
from tests.engine.test_exactness import (
    assert_matches_reference,
    mixed_requests,
    run_staggered,
    tiny_adapters,  # noqa: F401 (fixture)
)
from tests.engine.test_static_decode import run_ragged

pytestmark = pytest.mark.gpu


def test_mixed_batch_on_cuda_matches_peft(tiny_model_dir, tiny_adapters):  # noqa: F811
    engine = build_engine(tiny_model_dir, tiny_adapters, device="cuda", dtype="float32")
    requests = mixed_requests(8)
    outputs = run_staggered(engine, requests, 16)
    assert_matches_reference(engine, tiny_model_dir, tiny_adapters, requests, outputs, 16)


def test_adapters_evicted_and_reloaded_on_cuda_match_peft(
    tiny_model_dir,
    tiny_adapters,  # noqa: F811
):
    """A device share that holds one adapter at a time: every switch is a copy-stream load."""
    row_bytes = build_engine(tiny_model_dir, device="cuda", dtype="float32").arena.bytes_per_row
    engine = build_engine(
        tiny_model_dir, device="cuda", dtype="float32", adapter_device_bytes=16 * row_bytes
    )
    for name, path in tiny_adapters.items():
        engine.register_adapter(name, LocalDirectorySource(path))
    requests = mixed_requests(8)
    outputs = run_staggered(engine, requests, 8)
    assert engine.metrics.registry.get_sample_value(
        "loramux_adapter_evictions_total", {"tier": "device"}
    )
    assert_matches_reference(engine, tiny_model_dir, tiny_adapters, requests, outputs, 8)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert engine.generate(["again"], params, adapters=["r4-qv"])[0].finish_reason == "length"


def test_cuda_graphs_replay_peft_tokens(tiny_model_dir, tiny_adapters):  # noqa: F811
    """Decode steps replayed from captured graphs (buckets 1, 2, 4, padded rows, with
    and without LoRA) give PEFT's tokens, and the same tokens as the eager path."""
    engine = build_engine(
        tiny_model_dir,
        tiny_adapters,
        device="cuda",
        dtype="float32",
        block_size=4,
        cuda_graph_max_batch=4,
        max_num_seqs=8,
    )
    static = engine.executor.static_decode
    assert static is not None and static.captured
    requests = mixed_requests(6)
    max_tokens = [9, 6, 5, 4, 3, 2]
    outputs = run_ragged(engine, requests, max_tokens)
    assert {bucket for bucket, _ in static.steps_run} == {1, 2, 4}, static.steps_run
    for (prompt, adapter), n, got in zip(requests, max_tokens, outputs, strict=True):
        prompt_ids = engine.tokenizer(prompt)["input_ids"]
        path = None if adapter is None else tiny_adapters[adapter]
        assert got == greedy_tokens(tiny_model_dir, path, prompt_ids, n), (prompt, adapter)
    eager = build_engine(
        tiny_model_dir,
        tiny_adapters,
        device="cuda",
        dtype="float32",
        block_size=4,
        cuda_graph_max_batch=0,
        max_num_seqs=8,
    )
    assert eager.executor.static_decode is None
    assert run_ragged(eager, requests, max_tokens) == outputs


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_model_on_cuda_with_graphs_matches_peft(
    tiny_model_dir,
    tiny_adapters,  # noqa: F811
    tmp_path,
    quantization,
):
    """Packed projections through the Triton quantized matmul, eager and in CUDA graphs,
    against PEFT on the same weights de-quantized in float32."""
    from tests.fixtures.models import build_dequantized_model

    engine = build_engine(
        tiny_model_dir,
        tiny_adapters,
        device="cuda",
        dtype="float32",
        quantization=quantization,
        block_size=4,
        cuda_graph_max_batch=4,
    )
    assert engine.executor.static_decode is not None and engine.executor.static_decode.captured
    reference = build_dequantized_model(tiny_model_dir, tmp_path / "deq", quantization=quantization)
    requests = mixed_requests(8)
    outputs = run_staggered(engine, requests, 12)
    assert_matches_reference(engine, reference, tiny_adapters, requests, outputs, 12)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_quantized_kv_cache_on_cuda_with_graphs_matches_peft(
    tiny_model_dir,
    tiny_adapters,  # noqa: F811
    kv_cache_dtype,
):
    """8-bit keys and values written by the torch ops inside captured graphs and read by
    the compiled attention kernels, against PEFT with the same cache, and the eager path."""
    fields = {"device": "cuda", "dtype": "float32", "block_size": 4, "max_num_seqs": 8}
    engine = build_engine(
        tiny_model_dir,
        tiny_adapters,
        kv_cache_dtype=kv_cache_dtype,
        cuda_graph_max_batch=4,
        **fields,
    )
    static = engine.executor.static_decode
    assert static is not None and static.captured
    requests = mixed_requests(6)
    max_tokens = [9, 6, 5, 4, 3, 2]
    outputs = run_ragged(engine, requests, max_tokens)
    assert static.steps_run
    for (prompt, adapter), n, got in zip(requests, max_tokens, outputs, strict=True):
        prompt_ids = engine.tokenizer(prompt)["input_ids"]
        path = None if adapter is None else tiny_adapters[adapter]
        expected = greedy_tokens(tiny_model_dir, path, prompt_ids, n, kv_cache_dtype=kv_cache_dtype)
        assert got == expected, (prompt, adapter)
    eager = build_engine(
        tiny_model_dir,
        tiny_adapters,
        kv_cache_dtype=kv_cache_dtype,
        cuda_graph_max_batch=0,
        **fields,
    )
    assert run_ragged(eager, requests, max_tokens) == outputs
