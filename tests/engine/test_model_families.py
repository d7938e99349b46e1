"""Families beyond Llama give transformers + PEFT's greedy tokens too.

Each family's tiny model is built with transformers itself (random weights, norms
perturbed so a skipped or misplaced norm shows), with PEFT adapters of mixed ranks and
targets, one of them DoRA. One engine serves a mixed-adapter batch arriving staggered,
with a shared system prompt (prefix hits) in a KV budget small enough to preempt, and
every request's tokens must be what transformers + PEFT give for it alone.
"""

from __future__ import annotations

import json

import pytest
import torch

from loramux.engine.memory.arena import RowLayout, block_bytes, row_bytes
from loramux.engine.model.config import ModelConfig
from tests.engine.factories import PROMPTS, build_engine, put_adapters_on_device
from tests.engine.test_exactness import (
    ADAPTER_SPECS,
    FORMAT_ADAPTER_SPECS,
    MOE_ADAPTER_SPECS,
    assert_first_step_logits_match,
    assert_matches_reference,
    device_rows,
    mixed_requests,
    run_staggered,
)
from tests.fixtures.models import build_tiny_model

NORM_NOISE = 0.2
# Phi-3's PEFT targets: q/k/v and gate/up are single fused modules. The names match
# ADAPTER_SPECS' (mixed_requests cycles through them).
PHI3_ADAPTER_SPECS = {
    "r4-qv": {"rank": 4, "targets": ("qkv_proj",), "seed": 1, "modules_to_save": ("lm_head",)},
    "r8-attn": {
        "rank": 8,
        "targets": ("qkv_proj", "o_proj"),
        "seed": 2,
        "use_dora": True,
        "trainable_text": f"{PROMPTS[2]} {PROMPTS[6]}",
    },
    "r16-mlp": {
        "rank": 16,
        "targets": ("o_proj", "gate_up_proj", "down_proj"),
        "seed": 3,
        "lora_bias": True,
    },
}


def assert_staggered_prefix_hits_and_preemption_match_peft(model_dir, adapters) -> None:
    """One engine: 8 mixed requests arriving staggered, with a shared system prompt (prefix
    hits), in 32 KV blocks of 4 tokens beside the adapters' rank-rows, contexts of at most
    96: each request's tokens are transformers + PEFT's."""
    layout = RowLayout.for_model(ModelConfig.from_pretrained(model_dir), 1, 4)
    layers = ModelConfig.from_pretrained(model_dir).num_layers
    budget = 32 * block_bytes(layout, layers, torch.float32) + device_rows(
        model_dir, adapters
    ) * row_bytes(layout, layers, torch.float32)
    engine = build_engine(
        model_dir, adapters, kv_cache_bytes=budget, max_model_len=96, block_size=4
    )
    put_adapters_on_device(engine, adapters)  # KV left its floor: preemption
    system = "Answer in one short sentence. "
    requests = [(system + p, a) for p, a in mixed_requests(8)]
    outputs = run_staggered(engine, requests, 16)
    assert engine.num_preemptions > 0
    assert engine.kv.prefix_cache_hits > 0
    assert_matches_reference(engine, model_dir, adapters, requests, outputs, 16)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, tokenizer_dir):
    out = tmp_path_factory.mktemp("tiny-qwen3")
    return build_tiny_model(out, tokenizer_dir, family="qwen3", norm_noise=NORM_NOISE)


@pytest.fixture(scope="module")
def qwen3_adapters(qwen3_dir, make_adapter):
    return {name: make_adapter(qwen3_dir, **spec) for name, spec in FORMAT_ADAPTER_SPECS.items()}


def test_qwen3_config_reads_its_head_norms_and_head_dim(qwen3_dir):
    config = ModelConfig.from_pretrained(qwen3_dir)
    assert (config.model_type, config.qk_norm, config.head_dim) == ("qwen3", True, 32)
    assert config.q_size == 2 * config.hidden_size  # head_dim × heads, not the hidden size
    assert not config.attention_bias and not config.o_proj_bias


def test_qwen3_first_step_logits_match_peft(qwen3_dir, qwen3_adapters):
    engine = build_engine(qwen3_dir, qwen3_adapters)
    assert_first_step_logits_match(engine, qwen3_dir, qwen3_adapters)


def test_qwen3_staggered_prefix_hits_and_preemption_match_peft(qwen3_dir, qwen3_adapters):
    assert_staggered_prefix_hits_and_preemption_match_peft(qwen3_dir, qwen3_adapters)


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory, tokenizer_dir):
    out = tmp_path_factory.mktemp("tiny-phi3")
    return build_tiny_model(out, tokenizer_dir, family="phi3", norm_noise=NORM_NOISE)


@pytest.fixture(scope="module")
def phi3_adapters(phi3_dir, make_adapter):
    return {name: make_adapter(phi3_dir, **spec) for name, spec in PHI3_ADAPTER_SPECS.items()}


def test_phi3_fused_adapters_load_as_their_parts(phi3_dir, phi3_adapters):
    """qkv_proj's A is every part's, its B split by rows; the engine's modules are the
    seven it always has."""
    from loramux.engine.lora.adapter import load_adapter

    config = ModelConfig.from_pretrained(phi3_dir)
    assert config.module_shape("qkv_proj") == (64, config.q_size + 2 * config.kv_size)
    weights = load_adapter(phi3_adapters["r8-attn"], config)
    assert set(weights.modules) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    q, k, v = (weights.modules[m] for m in ("q_proj", "k_proj", "v_proj"))
    assert q.a[0] is k.a[0] is v.a[0]
    assert [p.b[1].shape[0] for p in (q, k, v)] == [config.q_size, config.kv_size, config.kv_size]


def test_phi3_first_step_logits_match_peft(phi3_dir, phi3_adapters):
    engine = build_engine(phi3_dir, phi3_adapters)
    assert_first_step_logits_match(engine, phi3_dir, phi3_adapters)


def test_phi3_staggered_prefix_hits_and_preemption_match_peft(phi3_dir, phi3_adapters):
    assert_staggered_prefix_hits_and_preemption_match_peft(phi3_dir, phi3_adapters)


def test_which_layers_slide_and_over_how_many_keys(phi3_dir, qwen3_dir, gemma3_dir):
    """A windowed model's every layer (Phi-3, Mistral); Qwen's only under
    use_sliding_window, and then its layer_types' sliding layers; Gemma 3's local layers.
    The whole context is served either way."""
    windowed = ModelConfig.from_hf_dict(_config(phi3_dir, sliding_window=128))
    assert [windowed.window_of(i) for i in range(2)] == [128, 128]
    assert windowed.max_context == 512
    qwen = _config(
        qwen3_dir, sliding_window=64, layer_types=["full_attention", "sliding_attention"]
    )
    assert ModelConfig.from_hf_dict(qwen).window_of(1) is None
    sliding = ModelConfig.from_hf_dict({**qwen, "use_sliding_window": True})
    assert [sliding.window_of(i) for i in range(2)] == [None, 64]
    gemma = ModelConfig.from_pretrained(gemma3_dir)
    assert [gemma.window_of(i) for i in range(3)] == [128, None, 128]


def test_partial_rotary_embeddings_are_refused(phi3_dir):
    raw = _config(phi3_dir)
    raw["rope_parameters"] = {**raw["rope_parameters"], "partial_rotary_factor": 0.75}
    with pytest.raises(ValueError, match=r"partial_rotary_factor 0\.75 is not served yet"):
        ModelConfig.from_hf_dict(raw)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory, tokenizer_dir):
    out = tmp_path_factory.mktemp("tiny-gemma3")
    return build_tiny_model(out, tokenizer_dir, family="gemma3", norm_noise=NORM_NOISE)


@pytest.fixture(scope="module")
def gemma3_adapters(gemma3_dir, make_adapter):
    return {name: make_adapter(gemma3_dir, **spec) for name, spec in FORMAT_ADAPTER_SPECS.items()}


def test_gemma3_config_reads_what_sets_it_apart(gemma3_dir):
    config = ModelConfig.from_pretrained(gemma3_dir)
    assert config.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (config.rope_theta, config.sliding_rope_theta) == (1_000_000.0, 10_000.0)
    assert config.attention_scale == pytest.approx(24**-0.5)
    assert config.embed_scale == pytest.approx(64**0.5)
    assert config.gemma_norms and config.qk_norm and config.tie_word_embeddings
    assert (config.hidden_act, config.max_context) == ("gelu_pytorch_tanh", 512)


def test_gemma3_first_step_logits_match_peft(gemma3_dir, gemma3_adapters):
    engine = build_engine(gemma3_dir, gemma3_adapters)
    assert_first_step_logits_match(engine, gemma3_dir, gemma3_adapters)


def test_gemma3_staggered_prefix_hits_and_preemption_match_peft(gemma3_dir, gemma3_adapters):
    assert_staggered_prefix_hits_and_preemption_match_peft(gemma3_dir, gemma3_adapters)


def _config(model_dir, **changes) -> dict:
    return {**json.loads((model_dir / "config.json").read_text()), **changes}


def test_an_unsupported_family_names_the_supported_ones(qwen3_dir):
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'.*llama.*qwen3"):
        ModelConfig.from_hf_dict(_config(qwen3_dir, model_type="gpt2"))


def test_dynamic_rope_scaling_is_refused_with_why(qwen3_dir):
    raw = _config(qwen3_dir)
    raw["rope_parameters"] = {**raw["rope_parameters"], "rope_type": "dynamic", "factor": 2.0}
    with pytest.raises(ValueError, match=r"'dynamic' is not served.*use 'yarn' or 'linear'"):
        ModelConfig.from_hf_dict(raw)


def test_phi3_adapters_of_every_format_are_accepted_at_upload(phi3_dir, phi3_adapters):
    """The platform's checks know a family's fused targets, DoRA and the embedding's and
    head's tables as the engine does."""
    from loramux.platform.ingest import validate_adapter_dir

    info = validate_adapter_dir(
        phi3_adapters["r8-attn"],
        ModelConfig.from_pretrained(phi3_dir),
        base_model_id=None,
        max_rank=64,
        max_bytes=10 << 20,
    )
    assert (info.rank, info.target_modules) == (8, ["o_proj", "qkv_proj"])
    info = validate_adapter_dir(  # a whole LM head of 49,152 x 64 in float32
        phi3_adapters["r4-qv"],
        ModelConfig.from_pretrained(phi3_dir),
        base_model_id=None,
        max_rank=64,
        max_bytes=16 << 20,
    )
    assert (info.rank, info.target_modules) == (4, ["qkv_proj"])


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def moe_dir(request, tmp_path_factory, tokenizer_dir):
    out = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return build_tiny_model(out, tokenizer_dir, family=request.param, norm_noise=NORM_NOISE)


@pytest.fixture(scope="module")
def moe_adapters(moe_dir, make_adapter):
    return {name: make_adapter(moe_dir, **spec) for name, spec in MOE_ADAPTER_SPECS.items()}


def test_moe_configs_read_their_experts(moe_dir):
    config = ModelConfig.from_pretrained(moe_dir)
    assert (config.num_experts, config.experts_per_token, config.expert_intermediate_size) == (
        4,
        2,
        48,
    )
    if config.model_type == "mixtral":
        assert config.moe_layers == (True, True) and config.normalize_expert_weights
    else:  # Qwen3-MoE: layer 1 dense (mlp_only_layers), weights not renormalized
        assert config.moe_layers == (True, False) and not config.normalize_expert_weights
        assert config.qk_norm and config.intermediate_size == 128


def test_moe_routing_is_transformers_own(moe_dir):
    """The same experts and weights as transformers' router, and the same layer output."""
    from transformers import AutoModelForCausalLM

    from loramux.engine.model.loader import load_model

    reference = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    engine_model = load_model(moe_dir, dtype=torch.float32, device=torch.device("cpu"))
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    theirs, ours = reference.model.layers[0].mlp, engine_model.model.layers[0].mlp
    with torch.no_grad():
        _, weights, experts = theirs.gate(x)
        got_weights, got_experts = ours.route(x)
        assert torch.equal(got_experts, experts) and torch.equal(got_weights, weights)
        assert len(torch.unique(experts)) == 4  # every expert is chosen by some token
        torch.testing.assert_close(ours(x), theirs(x[None])[0], rtol=1e-5, atol=1e-6)


def test_moe_first_step_logits_match_peft(moe_dir, moe_adapters):
    engine = build_engine(moe_dir, moe_adapters)
    assert_first_step_logits_match(engine, moe_dir, moe_adapters)


def test_moe_staggered_prefix_hits_and_preemption_match_peft(moe_dir, moe_adapters):
    assert_staggered_prefix_hits_and_preemption_match_peft(moe_dir, moe_adapters)


def test_expert_lora_takes_rank_times_experts_rows_of_the_mlp_slots(moe_dir, moe_adapters):
    """Expert e's rank-rows at e·rank of the MLP modules (gate_up's B split into gate's
    and up's), attention's at the adapter's first rows."""
    from loramux.engine.lora.adapter import load_adapter

    config = ModelConfig.from_pretrained(moe_dir)
    weights = load_adapter(moe_adapters["r16-mlp"], config)
    assert weights.expert_rank == 8 and weights.rank == 8 * 4
    gate, up, down = (weights.modules[m] for m in ("gate_proj", "up_proj", "down_proj"))
    assert gate.a[0] is up.a[0] and gate.a[0].shape == (32, 64)
    assert (gate.b[0].shape, down.a[0].shape, down.b[0].shape) == ((48, 32), (32, 48), (64, 32))
    assert weights.modules["o_proj"].rank == 8
    assert set(gate.a) == {i for i in range(config.num_layers) if config.is_moe_layer(i)}


def test_target_parameters_other_than_the_experts_are_refused(moe_dir, moe_adapters, adapter_copy):
    from loramux.engine.lora.adapter import AdapterError, load_adapter

    adapter = adapter_copy(moe_adapters["r16-mlp"])
    path = adapter / "adapter_config.json"
    path.write_text(
        json.dumps(
            {**json.loads(path.read_text()), "target_parameters": ["self_attn.q_proj.weight"]}
        )
    )
    with pytest.raises(AdapterError, match=r"target_parameters .* may name only a mixture"):
        load_adapter(adapter, ModelConfig.from_pretrained(moe_dir))


def test_moe_decodes_eagerly_on_the_triton_path(moe_dir, moe_adapters, monkeypatch):
    """Experts are chosen on the host from the routing: no CUDA-graph decode for them."""
    from loramux.kernels import dispatch

    monkeypatch.setenv(dispatch.KERNELS_ENV, "triton")
    engine = build_engine(moe_dir, moe_adapters, cuda_graph_max_batch=4)
    assert engine.backend.name == "triton" and engine.executor.static_decode is None
    requests = mixed_requests(4)
    outputs = run_staggered(engine, requests, 4)
    assert_matches_reference(engine, moe_dir, moe_adapters, requests, outputs, 4)


# Phi-3's fused targets in plain LoRA (decodes may run over the static buffers)
PHI3_LORA_SPECS = {
    name: {k: v for k, v in spec.items() if k in ("rank", "targets", "seed")}
    for name, spec in PHI3_ADAPTER_SPECS.items()
}
# Windows shorter than the tests' contexts (a system prompt and the question, 8 tokens more):
# Gemma 3's local layers, every layer of a Phi-3 (Mistral-style), Qwen3's layers past
# max_window_layers.
WINDOWED = {
    "gemma3": {"sliding_window": 6},
    "phi3": {"sliding_window": 7},
    "qwen3": {"sliding_window": 5, "use_sliding_window": True, "max_window_layers": 1},
}


@pytest.fixture(scope="module", params=list(WINDOWED))
def windowed_dir(request, tmp_path_factory, tokenizer_dir):
    out = tmp_path_factory.mktemp(f"tiny-windowed-{request.param}")
    family, overrides = request.param, WINDOWED[request.param]
    return build_tiny_model(out, tokenizer_dir, family=family, norm_noise=NORM_NOISE, **overrides)


def test_contexts_past_a_sliding_window_match_peft(windowed_dir, make_adapter):
    """Past its window a layer drops the oldest keys as transformers' does: staggered
    requests with prefix hits, prefill chunks and decodes, all past the window."""
    specs = PHI3_LORA_SPECS if "phi3" in windowed_dir.name else ADAPTER_SPECS
    adapters = {name: make_adapter(windowed_dir, **spec) for name, spec in specs.items()}
    engine = build_engine(
        windowed_dir, adapters, block_size=4, max_num_batched_tokens=16, max_prefill_chunk=6
    )
    system = "Answer in one short sentence. "
    requests = [(system + p, a) for p, a in mixed_requests(6)]
    outputs = run_staggered(engine, requests, 8)
    assert engine.kv.prefix_cache_hits > 0
    assert_matches_reference(engine, windowed_dir, adapters, requests, outputs, 8)
    # Every layer windowed (Phi-3 here): the blocks out of the window were given back.
    every_layer = ModelConfig.from_pretrained(windowed_dir).kv_window is not None
    assert every_layer == ("phi3" in windowed_dir.name)
    assert (engine.kv.blocks_released > 0) == every_layer


def test_contexts_past_a_sliding_window_match_peft_over_the_triton_kernels(
    windowed_dir, make_adapter, monkeypatch
):
    """The same through the Triton kernels (a window per layer kind), decodes over the
    static buffers."""
    from loramux.kernels import dispatch

    monkeypatch.setenv(dispatch.KERNELS_ENV, "triton")
    specs = PHI3_LORA_SPECS if "phi3" in windowed_dir.name else ADAPTER_SPECS
    adapters = {name: make_adapter(windowed_dir, **spec) for name, spec in specs.items()}
    engine = build_engine(windowed_dir, adapters, block_size=4, cuda_graph_max_batch=4)
    requests = [("Answer in one short sentence. " + p, a) for p, a in mixed_requests(4)]
    outputs = run_staggered(engine, requests, 6)
    assert sum(engine.executor.static_decode.steps_run.values()) > 0
    assert_matches_reference(engine, windowed_dir, adapters, requests, outputs, 6)


def test_expert_lora_is_accepted_at_upload(moe_dir, moe_adapters):
    from loramux.platform.ingest import validate_adapter_dir

    info = validate_adapter_dir(
        moe_adapters["r16-mlp"],
        ModelConfig.from_pretrained(moe_dir),
        base_model_id=None,
        max_rank=64,
        max_bytes=10 << 20,
    )
    assert info.target_modules == ["o_proj"]
