"""PEFT's other adapter formats: DoRA (``engine/lora/dora.py``: read, folded once per device
write) and an adapter's own embedding and LM-head rows (``engine/lora/tokens.py``:
modules_to_save, trainable_token_indices), served with transformers + PEFT's outputs on
every path (eager torch, Triton, a quantized base, a tied embedding). Tensor parallelism is
in ``parallel/test_tensor_parallel.py``, the other families in ``test_model_families.py``,
the Triton and static paths in ``test_triton_path.py`` and ``test_static_decode.py``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from loramux.engine import SamplingParams
from loramux.engine.lora.adapter import AdapterError, ModuleWeights, load_adapter
from loramux.engine.lora.dora import DoRAFold
from loramux.engine.lora.host_cache import weights_nbytes
from loramux.engine.lora.output_terms import StepOutputTerms
from loramux.engine.model.config import ModelConfig
from loramux.kernels.lora_batch import LoRATable
from tests.engine.factories import build_engine
from tests.engine.test_exactness import (
    ADAPTER_SPECS,
    FORMAT_ADAPTER_SPECS,
    assert_first_step_logits_match,
    assert_matches_reference,
    mixed_requests,
    run_staggered,
)

WEIGHTS = "adapter_model.safetensors"
MAGNITUDE = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"


@pytest.fixture(scope="module")
def dora_adapters(tiny_model_dir, make_adapter):
    return {
        name: make_adapter(tiny_model_dir, **spec) for name, spec in FORMAT_ADAPTER_SPECS.items()
    }


@pytest.fixture(scope="module")
def dora_adapter(dora_adapters):
    return dora_adapters["r8-attn"]


def test_a_dora_adapter_reads_its_magnitudes_and_takes_one_more_row(tiny_model_dir, dora_adapter):
    config = ModelConfig.from_pretrained(tiny_model_dir)
    weights = load_adapter(dora_adapter, config)
    assert weights.dora and (weights.rank, weights.num_rows, weights.dora_row) == (8, 9, 8)
    q = weights.modules["q_proj"]
    assert set(q.magnitude) == set(q.a) and q.magnitude[0].shape == (config.q_size,)
    magnitudes = sum(m.nbytes for mw in weights.modules.values() for m in mw.magnitude.values())
    a_and_b = sum(
        t.nbytes for mw in weights.modules.values() for t in (*mw.a.values(), *mw.b.values())
    )
    tokens = weights.embed.rows.nbytes  # its prompts' tokens' embedding rows
    assert weights.head is None  # the tiny model's head is not tied to its embedding
    assert weights_nbytes(weights) == a_and_b + magnitudes + tokens  # the host tier counts all


def test_folding_gives_peft_s_dora_projection():
    """One projection with a bias: base output + the DoRA term + the LoRA delta of the
    folded B equal PEFT's (g - 1)·Wx + g·s·BAx on top of Wx + b (in float64; the fold
    computes its norms in float32)."""
    torch.manual_seed(0)
    out_f, in_f, rank, scale = 6, 5, 3, 1.7
    linear = torch.nn.Linear(in_f, out_f).double()
    a, b = torch.randn(rank, in_f).double(), torch.randn(out_f, rank).double()
    magnitude = torch.rand(out_f).double() + 0.5
    x = torch.randn(4, in_f).double()

    wx = x @ linear.weight.detach().T
    norm = torch.linalg.norm(linear.weight.detach() + scale * (b @ a), dim=1)
    g = magnitude / norm
    expected = wx + linear.bias.detach() + (g - 1) * wx + g * scale * (x @ a.T @ b.T)

    model = _OneProjection(linear)
    weights = _weights(ModuleWeights(rank, scale, a={0: a}, b={0: b}, magnitude={0: magnitude}))
    folded = DoRAFold(model)(weights).modules["q_proj"]
    pool = torch.zeros(2, out_f, dtype=torch.float64)
    pool[1] = folded.dora_excess[0]
    table = LoRATable([(0, 4, 0)], [[0]], [[rank]], [[scale]], 4, dora_rows=[1])
    term = StepOutputTerms.for_step(table, _Pools(pool), torch.device("cpu"))
    out = linear(x)
    term.add([out], [linear.bias], 0, ("q_proj",))
    out = out + scale * (x @ a.T @ folded.b[0].T)
    torch.testing.assert_close(out, expected.detach(), rtol=1e-5, atol=1e-6)


def test_every_format_matches_peft_in_one_batch(tiny_model_dir, dora_adapters):
    """A whole LM head (r4-qv), DoRA with trainable tokens (r8-attn) and plain LoRA, with
    the base model, staggered; each adapter's token rows take rank-rows after its own."""
    engine = build_engine(tiny_model_dir, dora_adapters)
    assert_first_step_logits_match(engine, tiny_model_dir, dora_adapters)
    requests = [("Answer briefly. " + p, a) for p, a in mixed_requests(6)]
    outputs = run_staggered(engine, requests, 6)
    assert_matches_reference(engine, tiny_model_dir, dora_adapters, requests, outputs, 6)
    pool = engine.lora_pool
    dora = pool.resident(engine.tiers.get("r8-attn").adapter_id)
    assert (dora.dora_offset, dora.token_offset) == (8, 9) and dora.token_rows >= 1
    head = pool.resident(engine.tiers.get("r4-qv").adapter_id)
    config = engine.model.config
    slab_rows = head.token_rows * engine.arena.layout.row_width * 2 * config.num_layers
    assert (head.token_offset, head.head.count) == (4, config.vocab_size)
    assert slab_rows >= config.vocab_size * config.hidden_size  # the whole head fits in them


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory, tokenizer_dir):
    from tests.fixtures.models import build_tiny_model

    out = tmp_path_factory.mktemp("tiny-tied")
    return build_tiny_model(out, tokenizer_dir, tie_word_embeddings=True)


def test_a_tied_embedding_s_trainable_tokens_replace_the_head_s_rows_too(
    tied_model_dir, make_adapter
):
    """PEFT ties trainable tokens of a tied embedding to the head (one set of rows, kept
    once); a whole embedding saved alone leaves the head the base's."""
    adapters = {
        "r4-qv": make_adapter(
            tied_model_dir, **ADAPTER_SPECS["r4-qv"], modules_to_save=("embed_tokens",)
        ),
        "r8-attn": make_adapter(tied_model_dir, **FORMAT_ADAPTER_SPECS["r8-attn"]),
        "r16-mlp": make_adapter(tied_model_dir, **ADAPTER_SPECS["r16-mlp"]),
    }
    config = ModelConfig.from_pretrained(tied_model_dir)
    tokens = load_adapter(adapters["r8-attn"], config)
    assert tokens.head is tokens.embed and tokens.token_rows == tokens.embed.count
    table = load_adapter(adapters["r4-qv"], config)
    assert table.head is None and table.embed.count == config.vocab_size
    engine = build_engine(tied_model_dir, adapters, kv_cache_bytes=32 << 20)
    assert_first_step_logits_match(engine, tied_model_dir, adapters)
    requests = mixed_requests(8)
    outputs = run_staggered(engine, requests, 6)
    assert_matches_reference(engine, tied_model_dir, adapters, requests, outputs, 6)


def test_dora_on_a_quantized_base_is_normed_against_its_dequantized_weights(
    tiny_model_dir, tmp_path, make_adapter
):
    """An int8 engine's norms are of the weights it serves: its tokens equal PEFT's on the
    de-quantized model, with the adapter trained on that model."""
    from tests.fixtures.models import build_dequantized_model

    reference = build_dequantized_model(tiny_model_dir, tmp_path / "deq", quantization="int8")
    adapters = {
        name: make_adapter(reference, **spec) for name, spec in FORMAT_ADAPTER_SPECS.items()
    }
    engine = build_engine(tiny_model_dir, adapters, quantization="int8")
    requests = mixed_requests(4)
    outs = engine.generate(
        [p for p, _ in requests],
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
        adapters=[a for _, a in requests],
    )
    assert_matches_reference(engine, reference, adapters, requests, [o.token_ids for o in outs], 5)


def _rewrite(adapter_dir, *, config=None, tensors=None):
    if config is not None:
        path = adapter_dir / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors is not None:
        path = adapter_dir / WEIGHTS
        save_file(tensors(load_file(path)), path, metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            {"config": {"use_dora": False}},
            r"layers\.0\.k_proj\.lora_magnitude_vector is a DoRA tensor, but "
            r"adapter_config\.json does not say use_dora: true",
        ),
        (
            {"tensors": lambda ts: {k: v for k, v in ts.items() if k != MAGNITUDE}},
            r"layers\.0\.q_proj has no lora_magnitude_vector, which an adapter with use_dora: true",
        ),
        (
            {"tensors": lambda ts: {**ts, MAGNITUDE: ts[MAGNITUDE][:5]}},
            r"layers\.0\.q_proj\.lora_magnitude_vector has shape \(5,\); the base model needs",
        ),
        (
            {"tensors": lambda ts: {**ts, MAGNITUDE: ts[MAGNITUDE] * float("nan")}},
            r"layers\.0\.q_proj\.lora_magnitude_vector holds NaN",
        ),
        (
            {"config": {"trainable_token_indices": None}},
            "hold trainable token rows of embed_tokens, but adapter_config.json.s "
            "trainable_token_indices names none",
        ),
        (
            {"config": {"trainable_token_indices": [1, 2]}},
            r"embed_tokens \(trainable_token_indices\) has shape \(\d+, 64\); the base model "
            r"needs \[2, 64\]",
        ),
        (
            {"config": {"modules_to_save": ["score"]}},
            "modules_to_save names 'score'; only the embedding .embed_tokens. and the LM head "
            ".lm_head. can be served from it",
        ),
        (
            {"config": {"modules_to_save": ["lm_head"]}},
            "modules_to_save lists lm_head, but the weights hold no table of it",
        ),
        (
            {"config": {"trainable_token_indices": [49152]}},
            "names token 49152, beyond the base model's vocabulary of 49152",
        ),
    ],
    ids=[
        "magnitude-without-use-dora",
        "use-dora-without-magnitude",
        "wrong-shape",
        "nan",
        "token-rows-without-indices",
        "indices-not-the-rows",
        "unsupported-module-to-save",
        "module-to-save-missing",
        "token-beyond-vocabulary",
    ],
)
def test_an_adapter_whose_parts_do_not_add_up_is_refused(
    tiny_model_dir, dora_adapter, adapter_copy, damage, message
):
    adapter = adapter_copy(dora_adapter)
    _rewrite(adapter, **damage)
    with pytest.raises(AdapterError, match=message):
        load_adapter(adapter, ModelConfig.from_pretrained(tiny_model_dir))


def test_a_dora_adapter_with_trainable_tokens_is_accepted_at_upload(tiny_model_dir, dora_adapter):
    from loramux.platform.ingest import validate_adapter_dir

    info = validate_adapter_dir(
        dora_adapter,
        ModelConfig.from_pretrained(tiny_model_dir),
        base_model_id=None,
        max_rank=64,
        max_bytes=10 << 20,
    )
    assert (info.rank, info.target_modules) == (8, ["k_proj", "o_proj", "q_proj", "v_proj"])


class _OneProjection:
    """What ``DoRAFold`` reads of a model: one layer's q_proj, no ranks."""

    ranks = None

    def __init__(self, linear):
        self.linear = linear

    def projection(self, layer, module):
        return self.linear


class _Pools:
    weights_version = 0

    def __init__(self, b):
        self.b = b

    def b_pool(self, layer, module):
        return self.b


def _weights(module_weights):
    from loramux.engine.lora.adapter import LoRAWeights

    return LoRAWeights(name="dora", modules={"q_proj": module_weights})


BIAS = "base_model.model.model.layers.0.mlp.down_proj.lora_B.bias"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            {"config": {"lora_bias": False}},
            r"layers\.0\.down_proj\.lora_B\.bias is a LoRA bias, but adapter_config\.json does "
            "not say lora_bias: true",
        ),
        (
            {"tensors": lambda ts: {k: v for k, v in ts.items() if k != BIAS}},
            r"layers\.0\.down_proj has no lora_B\.bias, which an adapter with lora_bias: true",
        ),
        (
            {"tensors": lambda ts: {**ts, BIAS: ts[BIAS][:3]}},
            r"layers\.0\.down_proj\.lora_B\.bias has shape \(3,\)",
        ),
        (
            {"config": {"use_dora": True}},
            "use_dora and lora_bias are both true, which PEFT does not train together",
        ),
        (
            {"config": {"bias": "all"}},
            "bias='all' retrain the base model's own biases, which are not served per adapter",
        ),
    ],
    ids=[
        "bias-without-lora-bias",
        "lora-bias-without-bias",
        "wrong-shape",
        "with-dora",
        "bias-all",
    ],
)
def test_a_lora_bias_that_does_not_add_up_is_refused(
    tiny_model_dir, dora_adapters, adapter_copy, damage, message
):
    adapter = adapter_copy(dora_adapters["r16-mlp"])
    _rewrite(adapter, **damage)
    with pytest.raises(AdapterError, match=message):
        load_adapter(adapter, ModelConfig.from_pretrained(tiny_model_dir))
