"""The static decode path (fixed buffers, CUDA graphs on CUDA) gives PEFT's tokens.

On the CPU the path runs eagerly over its buffers through the Triton kernels in Triton's
interpreter (``LORAMUX_KERNELS=triton``): the same launches a CUDA graph would capture,
padding rows and all. ``tests/engine/test_gpu_engine.py`` checks the captured graphs.
"""

from __future__ import annotations

import pytest

from loramux.engine import SamplingParams
from loramux.engine.static_decode import decode_buckets
from loramux.kernels import dispatch
from tests.engine.factories import build_engine
from tests.engine.hf_reference import greedy_tokens
from tests.engine.test_exactness import (
    ADAPTER_SPECS,
    FORMAT_ADAPTER_SPECS,
    mixed_requests,
    tiny_adapters,  # noqa: F401 (fixture)
)


def test_buckets_cover_every_batch_size_up_to_the_largest():
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert decode_buckets(3) == [1, 2, 3]
    assert decode_buckets(1) == [1]
    with pytest.raises(ValueError, match="positive"):
        decode_buckets(0)


@pytest.fixture
def triton_everywhere(monkeypatch):
    monkeypatch.setenv(dispatch.KERNELS_ENV, "triton")


def run_ragged(engine, requests, max_tokens: list[int]) -> list[list[int]]:
    """All requests at once, each with its own length: the decode batch shrinks by one
    request at a time, through every bucket size."""
    for i, ((prompt, adapter), n) in enumerate(zip(requests, max_tokens, strict=True)):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params, adapter=adapter)
    results: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[int(out.request_id[1:])] = out.token_ids
    return [results[i] for i in range(len(requests))]


def test_padded_decode_batches_match_peft(
    triton_everywhere,
    tiny_model_dir,
    tiny_adapters,  # noqa: F811
):
    """Six requests over three adapters and the base model, buckets up to 4: steps of six
    and five decodes run eagerly, four and three in bucket 4 (one padding row), then
    buckets 2 and 1. A padding row writing a real slot, an adapter table read from stale
    rows or a wrong bucket would change the tokens."""
    engine = build_engine(
        tiny_model_dir, tiny_adapters, block_size=4, cuda_graph_max_batch=4, max_num_seqs=8
    )
    static = engine.executor.static_decode
    assert static is not None and not static.captured  # no CUDA: eager over the buffers
    assert engine.arena.scratch_blocks == 1
    requests = mixed_requests(6)
    # The longest request first: it owns block 0 (blocks go lowest first) while padding
    # rows run, so a padding write to slot 0 would corrupt its context.
    max_tokens = [9, 6, 5, 4, 3, 2]
    outputs = run_ragged(engine, requests, max_tokens)
    buckets = {bucket for bucket, _ in static.steps_run}
    assert buckets == {1, 2, 4}, static.steps_run
    assert static.steps_run[(4, True)] >= 2
    for (prompt, adapter), n, got in zip(requests, max_tokens, outputs, strict=True):
        prompt_ids = engine.tokenizer(prompt)["input_ids"]
        path = None if adapter is None else tiny_adapters[adapter]
        assert got == greedy_tokens(tiny_model_dir, path, prompt_ids, n), (prompt, adapter)


def test_steps_without_adapters_take_the_variant_without_lora(
    triton_everywhere,
    tiny_model_dir,
    tiny_adapters,  # noqa: F811
):
    engine = build_engine(tiny_model_dir, tiny_adapters, cuda_graph_max_batch=2)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompt = "The quick brown fox"
    prompt_ids = engine.tokenizer(prompt)["input_ids"]
    (base,) = engine.generate([prompt], params)
    assert base.token_ids == greedy_tokens(tiny_model_dir, None, prompt_ids, 3)
    assert engine.executor.static_decode.steps_run == {(1, False): 2}
    (tuned,) = engine.generate([prompt], params, adapters=["r8-attn"])
    expected = greedy_tokens(tiny_model_dir, tiny_adapters["r8-attn"], prompt_ids, 3)
    assert tuned.token_ids == expected
    assert engine.executor.static_decode.steps_run == {(1, False): 2, (1, True): 2}


def test_no_static_path_without_triton_or_when_disabled(tiny_model_dir, monkeypatch):
    engine = build_engine(tiny_model_dir)  # CPU: the torch references
    assert engine.executor.static_decode is None
    assert engine.arena.scratch_blocks == 0
    monkeypatch.setenv(dispatch.KERNELS_ENV, "triton")
    assert build_engine(tiny_model_dir, cuda_graph_max_batch=0).executor.static_decode is None
    with pytest.raises(ValueError, match="Triton kernels take"):
        build_engine(tiny_model_dir, dtype="float64")  # forced Triton: a dtype it lacks
    monkeypatch.setenv(dispatch.KERNELS_ENV, "auto")
    assert build_engine(tiny_model_dir, dtype="float64").executor.static_decode is None


def test_steps_with_dora_lora_bias_or_token_tables_decode_eagerly(
    triton_everywhere, tiny_model_dir, make_adapter
):
    """DoRA's and LoRA biases' terms and an adapter's own head rows are applied by ops
    sized on the host: a decode step with such an adapter leaves the static path (its
    tokens are PEFT's); one with plain LoRA adapters takes it."""
    adapters = {
        name: make_adapter(tiny_model_dir, **spec) for name, spec in FORMAT_ADAPTER_SPECS.items()
    }
    adapters["plain"] = make_adapter(tiny_model_dir, **ADAPTER_SPECS["r16-mlp"])
    engine = build_engine(tiny_model_dir, adapters, cuda_graph_max_batch=2)
    prompt = "The capital of France is"
    prompt_ids = engine.tokenizer(prompt)["input_ids"]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    (dora,) = engine.generate([prompt], params, adapters=["r8-attn"])
    assert dora.token_ids == greedy_tokens(tiny_model_dir, adapters["r8-attn"], prompt_ids, 3)
    assert engine.executor.static_decode.steps_run == {}
    for name in ("r4-qv", "r16-mlp"):  # a whole LM head; LoRA biases
        (out,) = engine.generate([prompt], params, adapters=[name])
        assert out.token_ids == greedy_tokens(tiny_model_dir, adapters[name], prompt_ids, 3)
    assert engine.executor.static_decode.steps_run == {}
    (lora,) = engine.generate([prompt], params, adapters=["plain"])
    assert lora.token_ids == greedy_tokens(tiny_model_dir, adapters["plain"], prompt_ids, 3)
    assert engine.executor.static_decode.steps_run == {(1, True): 2}
