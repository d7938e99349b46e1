"""On a CUDA device: n-gram speculation gives PEFT's tokens with the Triton kernels compiled
for real (several query tokens a sequence over its cached prefix) and CUDA graphs captured
for the 1-token decodes that share the engine with verifying steps.

Skipped without a GPU (the ``gpu`` marker); ``make gpu-check`` runs it.
"""

from __future__ import annotations

import pytest

from tests.engine.factories import PROMPTS, build_engine
from tests.engine.speculative.test_speculative_engine import (
    NGRAM,
    assert_speculated,
    tiny_adapters,  # noqa: F401 (fixture)
)
from tests.engine.test_exactness import assert_matches_reference, mixed_requests, run_staggered

pytestmark = pytest.mark.gpu

CUDA = {"device": "cuda", "dtype": "float32"}


def test_mixed_batch_with_speculation_on_cuda_matches_peft(tiny_model_dir, tiny_adapters):  # noqa: F811
    engine = build_engine(
        tiny_model_dir,
        tiny_adapters,
        block_size=4,
        cuda_graph_max_batch=4,
        max_num_seqs=8,
        **CUDA,
        **NGRAM,
    )
    requests = mixed_requests(8)
    outputs = run_staggered(engine, requests, 24)
    assert_speculated(engine)
    assert_matches_reference(engine, tiny_model_dir, tiny_adapters, requests, outputs, 24)
    assert engine.kv.num_used_blocks == 0


def test_preemption_with_speculation_on_cuda_matches_peft(tiny_model_dir, tiny_adapters):  # noqa: F811
    """24 KV blocks of 4 tokens beside the three adapters, as in the CPU test; the adapters'
    share is measured on the device (the backends lay adapter rows out differently)."""
    block_bytes = 4 * 512  # 4 tokens of the tiny model's float32 K and V
    probe = build_engine(tiny_model_dir, tiny_adapters, block_size=4, **CUDA)
    run_staggered(probe, [(PROMPTS[0], name) for name in tiny_adapters], 2)
    adapter_blocks = probe.kv.num_blocks - probe.kv.limit
    assert adapter_blocks > 0
    engine = build_engine(
        tiny_model_dir,
        tiny_adapters,
        kv_cache_bytes=(24 + adapter_blocks) * block_bytes,
        max_model_len=96,
        block_size=4,
        **CUDA,
        **NGRAM,
    )
    requests = mixed_requests(8)
    outputs = run_staggered(engine, requests, 24)
    assert engine.num_preemptions > 0, (engine.kv.num_blocks, engine.kv.limit, adapter_blocks)
    assert_speculated(engine)
    assert_matches_reference(engine, tiny_model_dir, tiny_adapters, requests, outputs, 24)
