"""The CPU's native decode forward (engine/native_decode.py, kernels/csrc/decode_cpu.c) against
the eager torch forward of the same step: hidden states and the KV it writes.

A random Llama decoder (with a tail chunk in its int4 rows, shared KV heads and, in one
variant, projection biases) prefills sequences of several lengths over a shuffled paged
cache with the eager forward; then one decode step of them runs both ways from copies of
that cache.
"""

from __future__ import annotations

import copy

import pytest
import torch

from loramux.engine.lora.torch_backend import TorchBackend
from loramux.engine.model.config import ModelConfig
from loramux.engine.model.llama import LORA_TARGETS, LlamaForCausalLM
from loramux.engine.model.quantized import quantize_model_
from loramux.engine.native_decode import native_decode_for, unsupported
from loramux.engine.step_batch import ForwardInputs
from loramux.kernels.decode_native import load_native_decode
from loramux.kernels.lora_batch import LoRATable
from loramux.kernels.quant_native import load_native_quant_linear

CPU = torch.device("cpu")
BLOCK = 4
BLOCKS = 64
CONFIG = {
    "model_type": "llama",
    "vocab_size": 300,
    # 96 inputs: an int4 row is one pair of 32-input chunks and a tail chunk
    "hidden_size": 96,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def library():
    library, how = load_native_decode()
    if library is None:
        pytest.fail(f"the native decode did not build: {how}")
    return library


def _model(quantization: str, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_hf_dict({**CONFIG, **overrides})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # not all ones: the norms' weights must count
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0, 0.1)
    if quantization != "none":
        quant, how = load_native_quant_linear()
        assert quant is not None, how
        quantize_model_(model, quantization, 32, op=quant.linear)
    return model


def _caches(model: LlamaForCausalLM):
    c = model.config
    shape = (BLOCKS, BLOCK, c.num_kv_heads, c.head_dim)
    # Stale values everywhere, as in a used arena: only a sequence's own slots may be read.
    generator = torch.Generator().manual_seed(2)
    return [
        (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
        for _ in range(c.num_layers)
    ]


def _prefilled(model, lengths: list[int]):
    """Each sequence's prompt through the eager forward; returns its caches and block tables
    (shuffled physical blocks, room for one more token each)."""
    caches = _caches(model)
    order = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
    tables = []
    for length in lengths:
        blocks = -(-(length + 1) // BLOCK)
        tables.append([order.pop() for _ in range(blocks)])
    ids = torch.randint(0, CONFIG["vocab_size"], (sum(lengths),), generator=torch.Generator())
    attention = TorchBackend(CPU).plan_attention(tables, lengths, lengths, BLOCK, CPU)
    with torch.inference_mode():
        model(ids, attention, caches)
    return caches, tables


def _decode_inputs(lengths: list[int], tables) -> ForwardInputs:
    new = [(7 * i + 3) % CONFIG["vocab_size"] for i in range(len(lengths))]
    contexts = [n + 1 for n in lengths]
    return ForwardInputs(new, tables, contexts, [1] * len(lengths), None, [])


def _eager(model, caches, inputs: ForwardInputs) -> torch.Tensor:
    attention = TorchBackend(CPU).plan_attention(
        inputs.block_tables, inputs.context_lens, inputs.query_lens, BLOCK, CPU
    )
    with torch.inference_mode():
        return model(torch.tensor(inputs.input_ids), attention, caches)


@pytest.mark.parametrize(
    ("quantization", "overrides"),
    [
        ("int4", {}),
        ("int8", {}),
        ("none", {}),
        ("int4", {"attention_bias": True}),
    ],
)
@pytest.mark.parametrize("lengths", [[9], [3, 12, 7, 1, 16]])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_step_matches_the_eager_forward(library, quantization, overrides, lengths, threads):
    model = _model(quantization, **overrides)
    caches, tables = _prefilled(model, lengths)
    inputs = _decode_inputs(lengths, tables)
    eager_caches = copy.deepcopy(caches)
    expected = _eager(model, eager_caches, inputs)
    native = native_decode_for(model, caches, BLOCK, library)
    assert native is not None and native.runs(inputs)
    native.threads = lambda: threads
    got = native.run(inputs)
    assert native.steps_run == 1
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for (keys, values), (eager_keys, eager_values) in zip(caches, eager_caches, strict=True):
        torch.testing.assert_close(keys, eager_keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(values, eager_values, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "heads",
    [
        # head_dim 64 and 128: the attention's register paths (16 elsewhere: the generic one)
        {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1},
        {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1},
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_wide_heads_match_the_eager_forward(library, heads, threads):
    # contexts of 2 to 61 keys: whole and partial blocks, whole and partial runs of 16 scores
    lengths = [1, 15, 16, 33, 60]
    model = _model("int4", **heads)
    caches, tables = _prefilled(model, lengths)
    inputs = _decode_inputs(lengths, tables)
    expected = _eager(model, copy.deepcopy(caches), inputs)
    native = native_decode_for(model, caches, BLOCK, library)
    native.threads = lambda: threads
    torch.testing.assert_close(native.run(inputs), expected, rtol=1e-4, atol=1e-4)


def test_it_runs_only_decode_steps_without_adapters(library):
    model = _model("int4")
    caches, tables = _prefilled(model, [5, 6])
    native = native_decode_for(model, caches, BLOCK, library)
    decode = _decode_inputs([5, 6], tables)
    assert native.runs(decode)
    prefill = ForwardInputs([1, 2, 3], tables, [8, 7], [2, 1], None, [])
    assert not native.runs(prefill)
    with_adapter = ForwardInputs(
        decode.input_ids, tables, decode.context_lens, [1, 1], object(), []
    )
    assert not native.runs(with_adapter)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"model_type": "qwen3", "head_dim": 16}, "norms queries and keys"),
        ({"hidden_act": "gelu_pytorch_tanh"}, "activation"),
    ],
)
def test_it_says_which_models_it_does_not_take(library, overrides, reason):
    model = _model("none", **overrides)
    assert reason in unsupported(model, _caches(model))
    assert native_decode_for(model, _caches(model), BLOCK, library) is None


def test_it_does_not_take_a_half_precision_cache(library):
    model = _model("int4")
    caches = [(k.half(), v.half()) for k, v in _caches(model)]
    assert unsupported(model, caches) == "the KV cache is not float32"


class _Pools:
    """Adapter rows per (layer, module), as the arena's pool views give them."""

    weights_version = 0

    def __init__(self, model: LlamaForCausalLM, rows: int):
        generator = torch.Generator().manual_seed(5)
        config = model.config
        self.a, self.b = {}, {}
        for layer in range(config.num_layers):
            for module in LORA_TARGETS:
                out_dim, in_dim = config.module_shape(module)[::-1]
                wide = torch.randn(rows, in_dim + 8, generator=generator) * 0.2
                self.a[layer, module] = wide[:, :in_dim]  # rows strided, as the arena's
                self.b[layer, module] = torch.randn(rows, out_dim, generator=generator) * 0.2

    def a_pool(self, layer, module):
        return self.a[layer, module]

    def b_pool(self, layer, module):
        return self.b[layer, module]


def _table(tokens: int) -> LoRATable:
    """Adapter 0 (rank 4, every module) on tokens 0 and 3; adapter 1 (rank 8, q, v and down
    only) on tokens 1 and 4; token 2 and any further ones the base model's."""
    spans = [(0, 1, 0), (1, 2, 1), (2, 3, None), (3, 4, 0), (4, 5, 1)][:tokens]
    if tokens > 5:
        spans.append((5, tokens, None))
    only = {"q_proj", "v_proj", "down_proj"}
    return LoRATable(
        spans=spans,
        adapter_rows=[list(range(2, 6)), list(range(10, 18))],
        ranks=[[4, 8 if m in only else 0] for m in LORA_TARGETS],
        scales=[[0.5, 2.0] for _ in LORA_TARGETS],
        num_tokens=tokens,
    )


@pytest.mark.parametrize("lengths", [[9], [3, 12, 7, 1, 16]])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_step_with_adapters_matches_the_eager_forward(library, lengths, threads):
    model = _model("int4")
    pools = _Pools(model, 20)
    caches, tables = _prefilled(model, lengths)
    plain = _decode_inputs(lengths, tables)
    inputs = ForwardInputs(
        plain.input_ids, tables, plain.context_lens, plain.query_lens, _table(len(lengths)), []
    )
    eager_caches = copy.deepcopy(caches)
    attention = TorchBackend(CPU).plan_attention(
        tables, plain.context_lens, [1] * len(lengths), BLOCK, CPU
    )
    lora = TorchBackend(CPU).lora_step(inputs.lora, pools)
    with torch.inference_mode():
        expected = model(torch.tensor(inputs.input_ids), attention, eager_caches, lora)
        base = model(torch.tensor(inputs.input_ids), attention, copy.deepcopy(caches))
    native = native_decode_for(model, caches, BLOCK, library, pools)
    assert native.runs(inputs)
    native.threads = lambda: threads
    got = native.run(inputs)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    adapted = [0, 1, 3, 4][: len(lengths)]
    assert not torch.allclose(got[adapted], base[adapted], atol=1e-2)  # the adapters count
    for (keys, _), (eager_keys, _) in zip(caches, eager_caches, strict=True):
        torch.testing.assert_close(keys, eager_keys, rtol=1e-5, atol=1e-5)


def test_a_step_with_adapters_needs_the_pool_bound(library):
    model = _model("int4")
    caches, tables = _prefilled(model, [4, 5])
    plain = _decode_inputs([4, 5], tables)
    inputs = ForwardInputs(plain.input_ids, tables, plain.context_lens, [1, 1], _table(2), [])
    assert not native_decode_for(model, caches, BLOCK, library).runs(inputs)
    assert native_decode_for(model, caches, BLOCK, library, _Pools(model, 20)).runs(inputs)
