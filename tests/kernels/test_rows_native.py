"""The CPU's native row ops (kernels/csrc/rows_cpu.c) against the torch code they stand in for:
the decoder's RMSNorm and SiLU times up, on rows beyond the vector width, with a tail, strided
rows, extreme values and NaN."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loramux.engine.model.config import ModelConfig
from loramux.engine.model.llama import NATIVE_MIN_ROWS, LlamaMLP, RMSNorm, install_native_rows
from loramux.kernels.rows_native import load_native_rows


@pytest.fixture(scope="module")
def rows():
    native, how = load_native_rows()
    if native is None:
        pytest.fail(f"the native row ops did not build: {how}")
    return native


@pytest.mark.parametrize("size", [576, 37])
def test_rms_norm_matches_the_decoder_s(rows, size):
    generator = torch.Generator().manual_seed(0)
    wide = torch.randn(70, size + 5, generator=generator) * 3
    wide[1] *= 1e-3  # a mean square near eps: eps must count as the definition counts it
    x = wide[:, :size]  # rows strided
    norm = RMSNorm(size, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=generator)
    expected = norm(x)
    torch.testing.assert_close(rows.rms_norm(x, norm.weight, norm.eps), expected)
    norm.native = rows  # the module's own switch, from NATIVE_MIN_ROWS rows
    torch.testing.assert_close(norm(x), expected)


def test_silu_mul_matches_torch_across_the_range(rows):
    generator = torch.Generator().manual_seed(1)
    gate = torch.randn(NATIVE_MIN_ROWS, 1543, generator=generator) * 6
    gate[0, :8] = torch.tensor([-200.0, -90.0, -88.0, 0.0, 88.0, 90.0, 200.0, -0.0])
    up = torch.randn(NATIVE_MIN_ROWS, 1543, generator=generator)
    expected = F.silu(gate) * up
    torch.testing.assert_close(rows.silu_mul(gate, up), expected, rtol=2e-6, atol=1e-7)


def test_non_finite_values_propagate(rows):
    gate = torch.zeros(2, 32)
    gate[0, 3], gate[1, 20] = float("nan"), float("inf")
    up = torch.ones(2, 32)
    out = rows.silu_mul(gate, up)
    assert torch.isnan(out[0, 3]) and out[1, 20] == float("inf")
    x = torch.ones(2, 32)
    x[1, 5] = float("nan")
    normed = rows.rms_norm(x, torch.ones(32), 1e-5)
    assert torch.isnan(normed[1]).all() and torch.isfinite(normed[0]).all()


def test_install_reaches_llama_norms_and_mlps_only(rows):
    config = ModelConfig.from_hf_dict(
        {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32}
    )  # fmt: skip
    from loramux.engine.model.llama import LlamaForCausalLM

    model = LlamaForCausalLM(config)
    install_native_rows(model, rows)
    layer = model.model.layers[0]
    assert layer.input_layernorm.native is rows and isinstance(layer.mlp, LlamaMLP)
    assert layer.mlp.native is rows and model.model.norm.native is rows


@pytest.mark.parametrize("dim", [64, 16])
def test_rope_matches_apply_rotary_in_place(rows, dim):
    from loramux.engine.model.rope import apply_rotary

    generator = torch.Generator().manual_seed(3)
    fused = torch.randn(NATIVE_MIN_ROWS, 5 * dim, generator=generator)  # q and k side by side
    q = fused[:, : 3 * dim].view(NATIVE_MIN_ROWS, 3, dim)  # rows strided, as a fused qkv's
    angles = torch.rand(NATIVE_MIN_ROWS, dim // 2, generator=generator) * 50
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    expected = apply_rotary(q.clone(), cos, sin)
    untouched = fused[:, 3 * dim :].clone()
    assert rows.rope_(q, cos, sin) is q
    torch.testing.assert_close(q, expected, rtol=0, atol=0)  # the same three roundings
    assert torch.equal(fused[:, 3 * dim :], untouched)
