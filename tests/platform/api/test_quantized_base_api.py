"""The embedded default as a tenant meets it: with no model setting the platform serves
SmolLM2 from its GGUF's own 4-bit weights, an uploaded PEFT adapter runs over them in full
precision, and the official client gets the tokens transformers + PEFT give on the same
weights de-quantized (the float32 conversion of that file), billed once each."""

from __future__ import annotations

import pytest
import torch

from loramux.engine.model.quantized import QuantizedEmbedding, QuantizedLinear
from loramux.kernels.kv_quant import QuantizedKV
from loramux.platform.base_model import embedded_gguf_path
from loramux.platform.settings import Settings
from tests.engine.hf_reference import greedy_tokens
from tests.fixtures.models import seed_embedded_model
from tests.platform.e2e.conftest import start_platform, upload_adapter

ADAPTER = "tuned"
PROMPTS = ("The three primary colors are", "A recipe for pancakes begins with")
TOKENS = 12


@pytest.fixture(scope="module")
def default_platform(tmp_path_factory, smollm2_metadata_dir, smollm2_dir, make_adapter):
    adapter_dir = make_adapter(
        smollm2_dir, rank=8, targets=("q_proj", "v_proj", "down_proj"), seed=5
    )
    data_dir = tmp_path_factory.mktemp("gguf-default")
    seed_embedded_model(data_dir, smollm2_metadata_dir)  # what a first start writes
    with start_platform(Settings(data_dir=data_dir)) as platform:
        tenant = platform.new_tenant()
        upload_adapter(platform.url, tenant.headers, ADAPTER, adapter_dir)
        yield platform, tenant, adapter_dir


def test_the_default_engine_holds_the_gguf_weights_packed(default_platform):
    platform, _, _ = default_platform
    engine = platform.context.engine.engine
    assert engine.config.gguf_file == str(embedded_gguf_path())
    layer = engine.model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, QuantizedLinear)
    assert layer.mlp.down_proj.qweight.kind == "int4"
    assert isinstance(engine.model.model.embed_tokens, QuantizedEmbedding)


@pytest.mark.parametrize("adapter", [None, ADAPTER])
def test_completions_over_the_gguf_give_peft_s_tokens(default_platform, smollm2_dir, adapter):
    assert_completions_match_peft(*default_platform, smollm2_dir, adapter, kv_cache_dtype="auto")


@pytest.fixture(scope="module")
def int8_kv_platform(tmp_path_factory, smollm2_metadata_dir, smollm2_dir, make_adapter):
    """The default with LORAMUX_ENGINE_KV_CACHE_DTYPE=int8."""
    adapter_dir = make_adapter(
        smollm2_dir, rank=8, targets=("q_proj", "v_proj", "down_proj"), seed=5
    )
    data_dir = tmp_path_factory.mktemp("gguf-int8-kv")
    seed_embedded_model(data_dir, smollm2_metadata_dir)
    with start_platform(Settings(data_dir=data_dir, kv_cache_dtype="int8")) as platform:
        tenant = platform.new_tenant()
        upload_adapter(platform.url, tenant.headers, ADAPTER, adapter_dir)
        yield platform, tenant, adapter_dir


def test_an_int8_kv_cache_gives_peft_s_tokens_with_the_same_cache(int8_kv_platform, smollm2_dir):
    """The 4-bit weights under an 8-bit KV cache: PEFT's tokens when its cache holds what
    the engine's reads back, for the base and the adapter."""
    platform = int8_kv_platform[0]
    keys, _ = platform.context.engine.engine.arena.kv_caches[0]
    assert isinstance(keys, QuantizedKV) and keys.data.dtype == torch.int8
    for adapter in (None, ADAPTER):
        assert_completions_match_peft(
            *int8_kv_platform, smollm2_dir, adapter, kv_cache_dtype="int8"
        )


def assert_completions_match_peft(
    platform, tenant, adapter_dir, smollm2_dir, adapter, *, kv_cache_dtype
):
    client = platform.client(tenant)
    tokenizer = platform.context.engine.tokenizer
    for prompt in PROMPTS:
        response = client.completions.create(
            model=adapter or platform.base_model,
            prompt=prompt,
            max_tokens=TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        expected = greedy_tokens(
            smollm2_dir,
            adapter_dir if adapter else None,
            tokenizer(prompt)["input_ids"],
            TOKENS,
            kv_cache_dtype=kv_cache_dtype,
        )
        assert response.choices[0].text == tokenizer.decode(expected), (prompt, adapter)
        assert response.usage.completion_tokens == TOKENS
        rows = platform.admin_usage(tenant_id=tenant.id, group_by="request").json()["rows"]
        assert [r["request_id"] for r in rows].count(response.id) == 1
