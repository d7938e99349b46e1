"""Quantized linear layers: the packed forms' definition, round-to-nearest quantization, and
the CPU's implementations (the native op and the torch tiles) against the reference.

The native op is built here as the engine builds it: under CI a machine without a C
compiler fails these tests rather than skipping them.
"""

from __future__ import annotations

import pytest
import torch

from loramux.kernels import quant_native
from loramux.kernels.quant_linear import (
    QuantizedWeight,
    dequantize,
    pack_int4,
    quant_linear_reference,
    quant_linear_torch,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from loramux.kernels.quant_native import NativeQuantLinear, load_native_quant_linear

# (kind, group size; None: per channel); int8 in 16s is how a GGUF's Q6_K is held
KINDS = [("int8", None), ("int8", 16), ("int8", 32), ("int4", 32), ("int4", 64), ("int4", 128)]
# (out, in): odd output counts; inputs a multiple of 128 so every group size applies
SHAPES = [(1, 128), (37, 256), (130, 384)]
# around the native op's switch from its dot products to de-quantized tiles
TOKEN_COUNTS = [1, 2, 3, 4, 5, 8, 9, 33]


@pytest.fixture(scope="module")
def native() -> NativeQuantLinear:
    op, how = load_native_quant_linear()
    assert op is not None, f"the native quantized linear op must build here: {how}"
    return op


def _quantized(kind, group, shape, seed=0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * 0.05
    return quantize_int8(w, group) if kind == "int8" else quantize_int4(w, group)


def _expected(x, weight, bias):
    """The definition in float64: no float32 rounding to compare against."""
    y = x.double() @ dequantize(weight).double().T
    return y if bias is None else y + bias.double()


def _assert_close(actual, expected):
    scale = expected.abs().max().item() or 1.0
    assert torch.allclose(actual.double(), expected, rtol=0, atol=2e-6 * scale * 4), (
        (actual.double() - expected).abs().max().item()
    )


# --- the packed forms ----------------------------------------------------------------


def test_int4_packing_puts_input_j_and_j_plus_16_in_one_byte():
    q = torch.arange(64, dtype=torch.uint8).remainder(16).view(1, 64)
    packed = pack_int4(q)
    assert packed.shape == (1, 32)
    assert int(packed[0, 0]) == (q[0, 0] | (q[0, 16] << 4))  # GGUF's Q4_0 order
    assert int(packed[0, 16]) == (q[0, 32] | (q[0, 48] << 4))
    assert torch.equal(unpack_int4(packed), q)


@pytest.mark.parametrize("kind,group", KINDS)
def test_round_to_nearest_error_is_at_most_half_a_step(kind, group):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 256, generator=gen)
    packed = quantize_int8(w, group) if kind == "int8" else quantize_int4(w, group)
    step = packed.scales.repeat_interleave(packed.group_size, dim=1)
    assert ((dequantize(packed) - w).abs() <= step / 2 + 1e-6).all()
    # The extremes of each group are kept (int8: the largest magnitude; int4: min and max).
    g = packed.group_size
    grouped = w.view(48, -1, g)
    back = dequantize(packed).view(48, -1, g)
    if kind == "int4":
        assert torch.allclose(back.amin(-1), grouped.amin(-1), atol=1e-6)
        assert torch.allclose(back.amax(-1), grouped.amax(-1), atol=1e-5)
    else:
        assert torch.allclose(back.abs().amax(-1), grouped.abs().amax(-1), atol=1e-6)


def test_constant_and_zero_groups_quantize_exactly():
    w = torch.zeros(2, 64)
    w[1, 32:] = 0.75
    for packed in (quantize_int8(w, 32), quantize_int4(w, 32)):
        assert torch.equal(dequantize(packed), w)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: quantize_int4(torch.zeros(4, 64), 48), "group size must be one of"),
        (lambda: quantize_int8(torch.zeros(4, 60), 32), "does not divide"),
        (lambda: quantize_int8(torch.zeros(4, 64), 0), "does not divide"),
        (
            lambda: QuantizedWeight("int3", torch.zeros(1, 32), torch.zeros(1, 1), None, 32),
            "kind must be one of",
        ),
        (
            lambda: QuantizedWeight(
                "int4", torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 2), None, 32
            ),
            "need float32 mins",
        ),
        (
            lambda: QuantizedWeight(
                "int8", torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(2, 2), None, 32
            ),
            "must be int8",
        ),
    ],
)
def test_malformed_weights_are_refused_with_the_reason(build, message):
    with pytest.raises(ValueError, match=message):
        build()


# --- the implementations ----------------------------------------------------------------


@pytest.mark.parametrize("kind,group", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
def test_native_op_matches_the_definition(native, kind, group, shape, tokens):
    weight = _quantized(kind, group, shape)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, shape[1], generator=gen)
    bias = torch.randn(shape[0], generator=gen) if tokens % 2 else None
    _assert_close(native.linear(x, weight, bias), _expected(x, weight, bias))


@pytest.mark.parametrize("kind,group", KINDS)
@pytest.mark.parametrize("tokens", [1, 6, 40])
def test_torch_tiles_match_the_definition(kind, group, tokens, monkeypatch):
    # Tiles of 4 rows: the loop over tiles runs, with a partial last one.
    monkeypatch.setattr("loramux.kernels.quant_linear.TORCH_TILE_ELEMENTS", 4 * 256)
    weight = _quantized(kind, group, (37, 256))
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(37)
    _assert_close(quant_linear_torch(x, weight, bias), _expected(x, weight, bias))
    _assert_close(quant_linear_reference(x, weight, bias), _expected(x, weight, bias))


def test_native_tiles_cover_every_row_with_a_partial_last_tile(native, monkeypatch):
    monkeypatch.setattr(quant_native, "TILE_BYTES", 4 * 256 * 3)  # 3 rows a tile
    weight = _quantized("int4", 32, (37, 256))
    x = torch.randn(20, 256)
    _assert_close(native.linear(x, weight), _expected(x, weight, None))


def test_native_op_reads_strided_rows_and_propagates_nan(native):
    weight = _quantized("int4", 32, (16, 128))
    wide = torch.randn(3, 200)
    x = wide[:, 7:135]  # rows 200 floats apart
    x[1, 5] = float("nan")
    y = native.linear(x, weight)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()
    _assert_close(y[[0, 2]], _expected(x[[0, 2]], weight, None))


@pytest.mark.parametrize(
    "x, bias, message",
    [
        (torch.randn(2, 128, dtype=torch.float64), None, "x must be float32"),
        (torch.randn(2, 64), None, "x must be float32"),
        (torch.randn(2, 128), torch.randn(15), "bias must be float32"),
    ],
)
def test_native_op_refuses_what_it_cannot_take(native, x, bias, message):
    with pytest.raises(ValueError, match=message):
        native.linear(x, _quantized("int8", None, (16, 128)), bias)


def test_the_native_library_is_built_once(tmp_path):
    first, how = load_native_quant_linear(tmp_path)
    assert first is not None, how
    built = sorted(tmp_path.iterdir())
    assert len(built) == 1 and built[0].name.startswith("quant_cpu-")
    again, _ = load_native_quant_linear(tmp_path)
    assert again.path == first.path
