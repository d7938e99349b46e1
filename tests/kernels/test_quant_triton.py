"""The Triton quantized linear kernel against its definition, ``quant_linear_reference``.

Without a GPU the kernel runs in Triton's interpreter (``conftest.py``) on CPU tensors;
with one, on the GPU (plus the ``gpu``-marked tests: real shapes, CUDA-graph capture).

Weights come from ``quantize_int8`` / ``quantize_int4`` of random matrices and from
hand-built extremes (q only at its ends, all-zero groups, constant groups, GGUF Q4_0's
``mins = -8 scales``), over odd shapes: one token to several T tiles, N not a multiple of
the N tile, per-channel int8 with K not a multiple of the K block.

Tolerances, against the float32 definition: float32 within 1e-5 of the result's scale;
16-bit within half an ulp of the float32 value (2^-8 relative for bfloat16, 2^-11 for
float16: the kernel rounds its float32 sum once) plus the same 1e-5 of the scale for
float32 summation order.
"""

from __future__ import annotations

import pytest
import torch

from loramux.kernels.quant_linear import (
    QuantizedWeight,
    pack_int4,
    quant_linear_reference,
    quantize_int4,
    quantize_int8,
)
from loramux.kernels.quant_triton import block_k_for, quant_linear_triton
from tests.kernels.helpers import compile_for_hopper, run_python

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (dtype, rtol): see the module doc.
DTYPES = [
    pytest.param(torch.float32, 1e-5, id="float32"),
    pytest.param(torch.bfloat16, 2.0**-8, id="bfloat16"),
    pytest.param(torch.float16, 2.0**-11, id="float16"),
]
SHAPES = [(1, 48, 64), (3, 96, 128), (17, 48, 256), (17, 96, 64), (1, 96, 256)]  # (T, N, K)
KINDS = ["int8-channel", "int8-g16", "int8-g32", "int4-g32", "int4-g64", "int4-g128"]
CASES = [
    pytest.param(t, n, k, kind, id=f"T{t}-N{n}-K{k}-{kind}")
    for t, n, k in SHAPES
    for kind in KINDS
    if not kind.endswith("g128") or k % 128 == 0
]


def _quantize(kind: str, w: torch.Tensor) -> QuantizedWeight:
    bits, group = kind.split("-")
    if bits == "int8":
        return quantize_int8(w, None if group == "channel" else int(group[1:]))
    return quantize_int4(w, int(group[1:]))


def _random(shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _assert_matches_definition(y, x, weight, bias, rtol) -> None:
    """``y`` (x's dtype) against the float32 definition on the same values."""
    expected = quant_linear_reference(x.float(), weight, None if bias is None else bias.float())
    assert y.dtype == x.dtype and y.shape == expected.shape
    assert not torch.isnan(y).any()
    atol = 1e-5 * float(expected.abs().max())
    torch.testing.assert_close(y.double(), expected.double(), rtol=rtol, atol=atol)


# --- against the definition -------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "rtol"), DTYPES)
@pytest.mark.parametrize(("tokens", "n", "k", "kind"), CASES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_matches_reference(tokens, n, k, kind, dtype, rtol, with_bias):
    weight = _quantize(kind, _random((n, k), 1, 0.1)).to(DEVICE)
    x = _random((tokens, k), 2).to(DEVICE, dtype)
    bias = _random((n,), 3).to(DEVICE, dtype) if with_bias else None

    y = quant_linear_triton(x, weight, bias)

    _assert_matches_definition(y, x, weight, bias, rtol)


@pytest.mark.parametrize(("dtype", "rtol"), DTYPES)
@pytest.mark.parametrize("k", [40, 72, 200])
def test_per_channel_int8_with_a_partial_k_block(k, dtype, rtol):
    """G = K not a multiple of 16 or of the K block: the last block is masked."""
    weight = quantize_int8(_random((33, k), 4)).to(DEVICE)
    assert block_k_for(weight) > k or k % block_k_for(weight)
    x = _random((5, k), 5).to(DEVICE, dtype)
    bias = _random((33,), 6).to(DEVICE, torch.float32)

    _assert_matches_definition(quant_linear_triton(x, weight, bias), x, weight, bias, rtol)


@pytest.mark.parametrize("kind", ["int8-g32", "int4-g32", "int4-g128"])
def test_several_tiles_in_t_and_n(kind):
    """T = 70 spans two T tiles of 64 and N = 130 three N tiles."""
    weight = _quantize(kind, _random((130, 256), 7, 0.1)).to(DEVICE)
    x = _random((70, 256), 8).to(DEVICE)

    _assert_matches_definition(quant_linear_triton(x, weight), x, weight, None, 1e-5)


# --- hand-built extremes ----------------------------------------------------------------------


def _extreme_int4(n: int, k: int, group: int) -> QuantizedWeight:
    """q only 0 or 15; row 0 all-zero groups (scale and min 0); row 1 constant groups
    (scale 0, min ≠ 0); even rows GGUF Q4_0 (mins = -8 scales); a wide range of scales."""
    gen = torch.Generator().manual_seed(9)
    q = torch.randint(0, 2, (n, k), generator=gen, dtype=torch.uint8) * 15
    groups = k // group
    scales = torch.rand(n, groups, generator=gen) * 10.0 ** torch.randint(-3, 2, (n, groups))
    mins = torch.randn(n, groups, generator=gen)
    mins[::2] = -8 * scales[::2]
    scales[0], mins[0] = 0.0, 0.0
    scales[1] = 0.0
    scales[3, ::2], mins[3, ::2] = 0.0, 0.0  # every other group of row 3 is zero
    return QuantizedWeight("int4", pack_int4(q), scales, mins, group)


def _extreme_int8(n: int, k: int, group: int) -> QuantizedWeight:
    """q only -128, -127, 0 or 127; row 0 all-zero (q = 0); row 1 scale 0; zero groups."""
    gen = torch.Generator().manual_seed(10)
    values = torch.tensor([-128, -127, 0, 127], dtype=torch.int8)
    q = values[torch.randint(0, 4, (n, k), generator=gen)]
    q[0] = 0
    groups = k // group
    scales = torch.rand(n, groups, generator=gen) * 10.0 ** torch.randint(-4, 0, (n, groups))
    scales[1] = 0.0
    q[2, :group] = 0  # row 2's first group: q all zero
    return QuantizedWeight("int8", q, scales, None, group)


@pytest.mark.parametrize(("dtype", "rtol"), DTYPES)
@pytest.mark.parametrize(
    ("kind", "group"), [("int8", 128), ("int8", 32), ("int4", 32), ("int4", 64), ("int4", 128)]
)
def test_extreme_weights(kind, group, dtype, rtol):
    n, k = 48, 128
    build = _extreme_int4 if kind == "int4" else _extreme_int8
    weight = build(n, k, group).to(DEVICE)
    x = _random((3, k), 11).to(DEVICE, dtype)
    bias = _random((n,), 12).to(DEVICE, dtype)

    y = quant_linear_triton(x, weight, bias)

    _assert_matches_definition(y, x, weight, bias, rtol)
    if kind == "int8":  # row 0 (q all zero) and row 1 (scale 0) give the bias alone
        torch.testing.assert_close(y[:, :2], bias[:2].expand(3, 2), rtol=0, atol=0)
    else:  # row 0 (all-zero groups): the bias alone
        torch.testing.assert_close(y[:, 0], bias[0].expand(3), rtol=0, atol=0)


# --- operands: views, out, edge sizes, errors -------------------------------------------------


@pytest.mark.parametrize("kind", ["int8-channel", "int4-g32"])
def test_strided_views_and_out(kind):
    """x a column view, bias strided, out a view into a wider buffer: written in place."""
    n, k, tokens = 48, 64, 5
    weight = _quantize(kind, _random((n, k), 13, 0.1)).to(DEVICE)
    x = _random((tokens, k + 3), 14).to(DEVICE, torch.bfloat16)[:, 1 : k + 1]
    bias = _random((2 * n,), 15).to(DEVICE, torch.bfloat16)[::2]
    buffer = torch.full((tokens, n + 9), 7.0, dtype=torch.bfloat16, device=DEVICE)
    out = buffer[:, 4 : 4 + n]

    y = quant_linear_triton(x, weight, bias, out=out)

    assert y is out
    _assert_matches_definition(out, x, weight, bias, 2.0**-8)
    assert torch.all(buffer[:, :4] == 7.0) and torch.all(buffer[:, 4 + n :] == 7.0)


def test_no_tokens():
    weight = quantize_int4(_random((48, 64), 16)).to(DEVICE)
    y = quant_linear_triton(torch.empty(0, 64, device=DEVICE), weight)
    assert y.shape == (0, 48) and y.dtype == torch.float32


def test_block_k_lies_within_one_group():
    def block(kind: str, n: int, k: int, group: int | None) -> int:
        w = _random((n, k), 17)
        weight = quantize_int8(w, group) if kind == "int8" else quantize_int4(w, group)
        return block_k_for(weight)

    assert block("int8", 8, 4096, None) == 128  # per-channel: capped
    assert block("int8", 8, 40, None) == 64  # per-channel: one masked block
    assert block("int8", 8, 256, 32) == 32
    assert block("int8", 8, 192, 48) == 16  # the largest power of two dividing 48
    assert block("int4", 8, 256, 32) == 32
    assert block("int4", 8, 256, 64) == 64
    assert block("int4", 8, 256, 128) == 128
    assert block("int4", 8, 128, 128) == 128  # G = K for int4: whole chunks, no mask


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda x, w, b, o: (x[:, :32], w, b, o), r"x must be \[T, 64\]"),
        (lambda x, w, b, o: (x.to(torch.int32), w, b, o), "unsupported activation dtype"),
        (lambda x, w, b, o: (x, w, b[:5], o), r"bias must be a float \[48\]"),
        (lambda x, w, b, o: (x, w, b, o[:, :5]), r"out must be \[3, 48\]"),
        (lambda x, w, b, o: (x, w, b, o.half()), r"out must be"),
        (lambda x, w, b, o: (x, quantize_int8(torch.randn(48, 64), 8), b, o), "multiple of 16"),
    ],
)
def test_rejects_operands_that_do_not_fit(change, message):
    weight = quantize_int4(_random((48, 64), 18))
    x, bias, out = torch.randn(3, 64), torch.randn(48), torch.empty(3, 48)
    x, weight, bias, out = change(x, weight, bias, out)
    with pytest.raises(ValueError, match=message):
        quant_linear_triton(x, weight, bias, out=out)


# --- GPU only -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["int8-channel", "int8-g32", "int4-g32", "int4-g128"])
@pytest.mark.parametrize("tokens", [1, 16, 100, 600])
@pytest.mark.parametrize(("dtype", "rtol"), DTYPES)
def test_real_shapes_on_gpu(kind, tokens, dtype, rtol):
    weight = _quantize(kind, _random((1536, 4096), 19, 0.02)).to("cuda")
    x = _random((tokens, 4096), 20).to("cuda", dtype)
    bias = _random((1536,), 21).to("cuda", dtype)

    _assert_matches_definition(quant_linear_triton(x, weight, bias), x, weight, bias, rtol)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    """Captured once with static buffers, replayed on new activations: same as eager."""
    weight = quantize_int4(_random((512, 1024), 22, 0.02), 32).to("cuda")
    x = torch.zeros(8, 1024, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(8, 512, dtype=torch.bfloat16, device="cuda")
    quant_linear_triton(x, weight, out=out)  # warm-up: compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quant_linear_triton(x, weight, out=out)
    for seed in (23, 24):
        x.copy_(_random((8, 1024), seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, quant_linear_triton(x, weight))


# --- the compiled path ------------------------------------------------------------------------


def _compile_for_hopper() -> None:
    """Compile the kernel for sm_90 without a GPU (run in a subprocess): the native 16-bit
    dots the interpreter never runs, and the float32 ones, for both kinds."""
    from loramux.kernels import quant_triton

    for act in ("bf16", "fp16", "fp32"):
        for int4 in (False, True):
            constexprs = {
                "IN_FEATURES": 4096,
                "GROUP_SIZE": 32 if int4 else 4096,
                "INT4": int4,
                "HAS_BIAS": True,
                "DOT_FP32": act == "fp32",
                "BLOCK_T": 16,
                "BLOCK_N": 64,
                "BLOCK_K": 32 if int4 else 128,
            }
            pointers = {
                **dict.fromkeys(("x_ptr", "bias_ptr", "out_ptr"), f"*{act}"),
                **dict.fromkeys(("scales_ptr", "mins_ptr"), "*fp32"),
                "q_ptr": "*u8" if int4 else "*i8",
            }
            compile_for_hopper(quant_triton._quant_linear_kernel, pointers, constexprs)


def test_kernel_compiles_for_hopper():
    """The compiled (non-interpreted) path type-checks and lowers to sm_90 code.

    Triton's cache keys on the kernel source, so a cached compile is a valid pass."""
    run_python(
        "from tests.kernels.test_quant_triton import _compile_for_hopper; _compile_for_hopper()",
        interpret=False,
    )
