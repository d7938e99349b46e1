"""Families beyond Llama give transformers + PEFT's greedy tokens too.

Each family's tiny model is built with transformers itself (random weights, norms
perturbed so a skipped or misplaced norm shows), with PEFT adapters of mixed ranks and
targets. One engine serves a mixed-adapter batch arriving staggered, with a shared system
prompt (prefix hits) in a KV budget small enough to preempt, and every request's tokens
must be what transformers + PEFT give for it alone.
"""

from __future__ import annotations

import json

import pytest

from loramux.engine.model.config import ModelConfig
from tests.engine.factories import build_engine, put_adapters_on_device
from tests.engine.test_exactness import (
    ADAPTER_SPECS,
    assert_first_step_logits_match,
    assert_matches_reference,
    mixed_requests,
    run_staggered,
)
from tests.fixtures.models import build_tiny_model

NORM_NOISE = 0.2


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, tokenizer_dir):
    out = tmp_path_factory.mktemp("tiny-qwen3")
    return build_tiny_model(out, tokenizer_dir, family="qwen3", norm_noise=NORM_NOISE)


@pytest.fixture(scope="module")
def qwen3_adapters(qwen3_dir, make_adapter):
    return {name: make_adapter(qwen3_dir, **spec) for name, spec in ADAPTER_SPECS.items()}


def test_qwen3_config_reads_its_head_norms_and_head_dim(qwen3_dir):
    config = ModelConfig.from_pretrained(qwen3_dir)
    assert (config.model_type, config.qk_norm, config.head_dim) == ("qwen3", True, 32)
    assert config.q_size == 2 * config.hidden_size  # head_dim × heads, not the hidden size
    assert not config.attention_bias and not config.o_proj_bias


def test_qwen3_first_step_logits_match_peft(qwen3_dir, qwen3_adapters):
    engine = build_engine(qwen3_dir, qwen3_adapters)
    assert_first_step_logits_match(engine, qwen3_dir, qwen3_adapters)


def test_qwen3_staggered_prefix_hits_and_preemption_match_peft(qwen3_dir, qwen3_adapters):
    # 2 layers x 2 KV heads x 32 dims x K and V x 4 bytes = 1 KiB a token: 32 blocks of 4
    # tokens beside the adapters' 28 rank-rows (9.5 KiB each), contexts of at most 96.
    engine = build_engine(
        qwen3_dir,
        qwen3_adapters,
        kv_cache_bytes=32 * 4 * 1024 + 28 * 9728,
        max_model_len=96,
        block_size=4,
    )
    put_adapters_on_device(engine, qwen3_adapters)  # KV left its floor: preemption
    system = "Answer in one short sentence. "
    requests = [(system + p, a) for p, a in mixed_requests(8)]
    outputs = run_staggered(engine, requests, 16)
    assert engine.num_preemptions > 0
    assert engine.kv.prefix_cache_hits > 0
    assert_matches_reference(engine, qwen3_dir, qwen3_adapters, requests, outputs, 16)


def _config(model_dir, **changes) -> dict:
    return {**json.loads((model_dir / "config.json").read_text()), **changes}


def test_an_unsupported_family_names_the_supported_ones(qwen3_dir):
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'.*llama.*qwen3"):
        ModelConfig.from_hf_dict(_config(qwen3_dir, model_type="gpt2"))


def test_sliding_window_attention_is_refused_with_what_to_do(qwen3_dir):
    with pytest.raises(ValueError, match="use_sliding_window is not served yet"):
        ModelConfig.from_hf_dict(_config(qwen3_dir, use_sliding_window=True))
