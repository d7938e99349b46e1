"""A quantized base model under full-precision adapters gives transformers + PEFT's greedy
tokens on the same quantized weights de-quantized in float32.

The reference for ``quantization=int8|int4`` is a copy of the checkpoint whose packed
tensors are replaced by their de-quantized values (``build_dequantized_model``); for a GGUF,
the float32 checkpoint converted from the same file (its values are the de-quantized ones).
The batch mixes adapters of ranks 4, 8 and 16 over different targets, with staggered
arrivals, prefix hits, small prefill chunks and preemption.
"""

from __future__ import annotations

import logging

import pytest

from loramux.engine import EngineConfig, SamplingParams
from loramux.engine.model.quantized import QuantizedEmbedding, QuantizedLinear, weight_bytes
from loramux.kernels.dispatch import KERNELS_ENV
from tests.engine.factories import build_engine, put_adapters_on_device
from tests.engine.test_exactness import (
    ADAPTER_SPECS,
    assert_matches_reference,
    mixed_requests,
    run_staggered,
    tiny_adapters,  # noqa: F401 (fixture)
)
from tests.fixtures.models import build_dequantized_model

MODES = [("int8", 32), ("int4", 32), ("int4", 64)]


@pytest.fixture(scope="module")
def dequantized(tiny_model_dir, tmp_path_factory):
    """(quantization, group size) -> the reference checkpoint of that mode."""
    return {
        (q, g): build_dequantized_model(
            tiny_model_dir, tmp_path_factory.mktemp(f"deq-{q}-{g}"), quantization=q, group_size=g
        )
        for q, g in MODES
    }


def _assert_packed(engine, quantization: str, group: int) -> None:
    layer = engine.model.model.layers[0]
    for module in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert isinstance(module, QuantizedLinear)
        assert module.qweight.kind == quantization
    assert isinstance(engine.model.model.embed_tokens, QuantizedEmbedding)
    assert isinstance(engine.model.lm_head, QuantizedLinear)
    if quantization == "int4":
        assert layer.mlp.up_proj.qweight.group_size == group


@pytest.mark.parametrize(("quantization", "group"), MODES)
def test_mixed_staggered_batch_matches_peft_on_the_dequantized_weights(
    tiny_model_dir,
    tiny_adapters,  # noqa: F811
    dequantized,
    quantization,
    group,
):
    engine = build_engine(
        tiny_model_dir, tiny_adapters, quantization=quantization, quantization_group_size=group
    )
    _assert_packed(engine, quantization, group)
    requests = mixed_requests(8)
    outputs = run_staggered(engine, requests, 16)
    reference = dequantized[(quantization, group)]
    assert_matches_reference(engine, reference, tiny_adapters, requests, outputs, 16)


def test_prefix_hits_small_chunks_and_preemption_match_peft(
    tiny_model_dir,
    tiny_adapters,  # noqa: F811
    dequantized,
):
    engine = build_engine(
        tiny_model_dir,
        tiny_adapters,
        quantization="int4",
        kv_cache_bytes=24 * 4 * 512 + 28 * 8192,  # as test_exactness's preemption test
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
    assert_matches_reference(
        engine, dequantized[("int4", 32)], tiny_adapters, requests, outputs, 20
    )


def test_the_torch_ops_give_the_native_op_s_tokens(tiny_model_dir, tiny_adapters, monkeypatch):  # noqa: F811
    requests = mixed_requests(6)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = {}
    for kernels in ("auto", "torch"):
        monkeypatch.setenv(KERNELS_ENV, kernels)
        engine = build_engine(tiny_model_dir, tiny_adapters, quantization="int4")
        results[kernels] = [
            o.token_ids
            for o in engine.generate(
                [p for p, _ in requests], params, adapters=[a for _, a in requests]
            )
        ]
        op = engine.model.model.layers[0].mlp.gate_proj.op
        assert getattr(op, "__name__", "") == (
            "quant_linear_torch" if kernels == "torch" else "linear"
        )
    assert results["auto"] == results["torch"]


def test_quantized_weights_take_a_fraction_of_the_float_bytes(tiny_model_dir):
    float_bytes = weight_bytes(build_engine(tiny_model_dir).model)
    for quantization, most in (("int8", 0.27), ("int4", 0.27)):
        engine = build_engine(tiny_model_dir, quantization=quantization)
        assert weight_bytes(engine.model) < most * float_bytes, quantization
    # The layers alone: int4 groups of 32 take 0.75 bytes a weight (0.5 + two float32 / 32).
    layer = engine.model.model.layers[0].mlp.gate_proj.qweight
    assert layer.nbytes == layer.out_features * layer.in_features * 0.75


def test_random_weights_quantize_in_place_with_a_tied_head(tmp_path, tokenizer_dir):
    """``load_format="random"`` (benchmarks at real shapes) packs the drawn weights; a tied
    LM head shares the embedding's packed weight, counted once."""
    import torch

    from loramux.engine.model.loader import load_model
    from loramux.kernels.quant_linear import quant_linear_torch
    from tests.fixtures.models import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "tied", tokenizer_dir, tie_word_embeddings=True)
    model = load_model(
        model_dir,
        dtype=torch.float32,
        device=torch.device("cpu"),
        load_format="random",
        quantization="int4",
        quant_op=quant_linear_torch,
    )
    assert isinstance(model.model.layers[1].self_attn.k_proj, QuantizedLinear)
    assert model.lm_head.qweight is model.model.embed_tokens.qweight
    embedding = model.model.embed_tokens.qweight
    projections = [m.qweight for m in model.modules() if isinstance(m, QuantizedLinear)]
    floats = sum(p.numel() * 4 for p in model.parameters())
    packed = {id(w): w.nbytes for w in projections} | {id(embedding): embedding.nbytes}
    assert weight_bytes(model) == floats + sum(packed.values())


def test_the_start_log_says_what_the_weights_take(tiny_model_dir, caplog):
    def weights_line(**fields) -> str:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="loramux.engine.engine"):
            engine = build_engine(tiny_model_dir, **fields)
        lines = [r.getMessage() for r in caplog.records if r.name == "loramux.engine.engine"]
        assert lines[0].startswith("base weights:"), lines
        return lines[0], weight_bytes(engine.model)

    line, size = weights_line()
    assert line == f"base weights: {size / 2**20:,.0f} MiB in floats"
    line, size = weights_line(quantization="int4")
    # 2 layers x 7 projections int4, the embedding and the untied head int8 per row (g64)
    assert line == (
        f"base weights: {size / 2**20:,.0f} MiB, packed modules 14 int4/g32, 2 int8/g64 "
        "(the rest in floats)"
    )


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"quantization": "int5"}, "quantization must be one of"),
        ({"quantization": "int4", "quantization_group_size": 48}, "group_size must be one of"),
        ({"gguf_file": "model.gguf", "quantization": "int8"}, "applies to float checkpoints"),
        ({"gguf_file": "model.gguf", "load_format": "random"}, "load_format 'safetensors'"),
    ],
)
def test_config_refuses_what_cannot_be_served(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **fields)


def test_adapter_specs_cover_every_projection():
    # The exactness above reaches every packed projection only if the adapters do.
    targets = {t for spec in ADAPTER_SPECS.values() for t in spec["targets"]}
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


# --- a GGUF served from its own packed tensors ------------------------------------------

# Every supported type on some projection (Q4_K needs inputs in multiples of 256).
GGUF_TYPES = {
    "embed_tokens": "Q8_0",
    "q_proj": "Q4_K",
    "k_proj": "Q4_0",
    "v_proj": "Q4_1",
    "o_proj": "Q8_0",
    "gate_proj": "Q4_K",
    "up_proj": "Q4_1",
    "down_proj": "Q4_0",
    "lm_head": "Q8_0",
}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tokenizer_dir, make_adapter):
    """A tiny Llama (hidden 256) as a mixed-type GGUF, the float checkpoint of the values it
    holds (what PEFT runs), and adapters over every projection."""
    from gguf import GGMLQuantizationType
    from safetensors.torch import load_file, save_file

    from loramux.engine.model.config import ModelConfig
    from loramux.engine.model.gguf_weights import read_gguf_weights
    from loramux.kernels.quant_linear import QuantizedWeight, dequantize
    from tests.fixtures.gguf_files import write_gguf
    from tests.fixtures.models import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-gguf")
    model_dir = build_tiny_model(root / "hf", tokenizer_dir, hidden_size=256, intermediate_size=512)
    config = ModelConfig.from_pretrained(model_dir)
    state = load_file(model_dir / "model.safetensors")

    def gguf_type(name: str):
        module = name.removesuffix(".weight").rsplit(".", 1)[-1]
        kind = GGUF_TYPES.get(module) if name.endswith(".weight") else None
        return GGMLQuantizationType[kind] if kind else GGMLQuantizationType.F32

    gguf_file = write_gguf(root / "tiny.gguf", state, config, gguf_type)
    values = read_gguf_weights(gguf_file, config)
    reference = root / "reference"
    build_tiny_model(reference, tokenizer_dir, hidden_size=256, intermediate_size=512)
    save_file(
        {
            name: dequantize(w) if isinstance(w, QuantizedWeight) else w
            for name, w in values.items()
        },
        reference / "model.safetensors",
        metadata={"format": "pt"},
    )
    kinds = {type(w).__name__ for w in values.values()}
    assert kinds == {"QuantizedWeight", "Tensor"}
    adapters = {name: make_adapter(model_dir, **spec) for name, spec in ADAPTER_SPECS.items()}
    return model_dir, gguf_file, reference, adapters


def test_a_mixed_type_gguf_serves_peft_s_tokens(tiny_gguf):
    model_dir, gguf_file, reference, adapters = tiny_gguf
    engine = build_engine(model_dir, adapters, gguf_file=str(gguf_file), block_size=4)
    layer = engine.model.model.layers[1]
    assert layer.self_attn.q_proj.qweight.kind == "int4"  # from Q4_K
    assert layer.self_attn.o_proj.qweight.kind == "int8"  # from Q8_0
    system = "You are a helpful assistant who answers briefly. "
    requests = [(system + p, a) for p, a in mixed_requests(8)]
    outputs = run_staggered(engine, requests, 16)
    assert engine.kv.prefix_cache_hits > 0
    assert_matches_reference(engine, reference, adapters, requests, outputs, 16)


@pytest.mark.slow
def test_smollm2_served_from_its_gguf_matches_peft(smollm2_dir, make_adapter, tmp_path):
    """The embedded default's own 4-bit file against transformers + PEFT on its float32
    conversion (the same values)."""
    from loramux.engine.model.gguf_convert import extract_gguf_metadata
    from loramux.platform.base_model import embedded_gguf_path

    gguf_file = embedded_gguf_path()
    metadata = extract_gguf_metadata(gguf_file, tmp_path / "metadata", log=lambda _: None)
    adapters = {name: make_adapter(smollm2_dir, **spec) for name, spec in ADAPTER_SPECS.items()}
    engine = build_engine(metadata, adapters, gguf_file=str(gguf_file), kv_cache_bytes=64 << 20)
    assert engine.model.model.layers[0].mlp.down_proj.qweight.kind == "int4"  # Q4_1
    assert engine.model.lm_head.qweight is engine.model.model.embed_tokens.qweight  # tied Q8_0
    requests = mixed_requests(4)  # the base and each adapter
    outs = engine.generate(
        [p for p, _ in requests],
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        adapters=[a for _, a in requests],
    )
    assert_matches_reference(
        engine, smollm2_dir, adapters, requests, [o.token_ids for o in outs], 12
    )
