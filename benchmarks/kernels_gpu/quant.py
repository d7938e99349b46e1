"""Weight-only quantized linear: the Triton int8/int4 kernel against dense ``F.linear``.

A case is one projection of Llama-7B (``q/o`` 4096 × 4096, ``gate/up`` 11008 × 4096,
``down`` 4096 × 11008, as ``N × K``: outputs × inputs), ``T`` tokens (1: one decode
token; 2048: a prefill chunk) and one quantized form of its weight (``quantize_int8``
per-channel, ``quantize_int4`` in groups of 32 or 128). The op timed is
``quant_triton.quant_linear_triton(x, W)`` (no bias, ``y`` allocated per call, as the
engine's ``QuantizedLinear`` calls it). Weights are random, ``W ~ N(0, 1/K)``, so that
``y ~ N(0, 1)`` for ``x ~ N(0, 1)``: the cost does not depend on the values.

The baseline is the dense layer the quantized one replaces: ``F.linear(x, W_dense)`` in
the benchmark's dtype (bfloat16 on the GPU), with ``W_dense = dequantize(W)`` rounded to
that dtype: it costs exactly what the original bf16 layer costs, and computes the same
function up to that rounding, so it is checked like the other sections' baselines.

Bytes and FLOPs of the floor, with e the activations' element size and ``|W|`` the packed
weight's bytes (``QuantizedWeight.nbytes``: ``q`` plus the float32 scales, and the int4
mins, one per group of G inputs of each output row):

    bytes = |W|  +  e T K  +  e T N          weights read once, x read, y written
    flops = 2 T N K
    |W|   = N K + 4 N                         int8 per-channel
          = N K / 2 + 8 N K / G               int4, G in 32, 64, 128
          = e N K                             dense (the baseline's floor)

``floor_speedup`` is the dense floor over the quantized one: what a kernel at its floor
would gain over a dense layer at its own. Rows with ``T = 1`` also give the achieved
bandwidth (bytes / time) of the kernel and of the dense baseline, and the kernel's
fraction of the measured copy bandwidth. Correctness: both outputs against
``quant_linear_reference`` on the upcast activations (float32), within the run's
tolerance (the baseline within 3x that), as ``kernel_row`` checks every kernel.

Expected on an H100 (no target is judged): decode (``T`` up to ~16: the kernel pads ``T``
to 16 rows of ``tl.dot``) is bound by reading the weights, so a kernel near its floor runs
~2x faster than dense bf16 with int8, ~3.6x with int4 g128 and ~2.7x with int4 g32 (the
float32 scale and min of each group add 2 bits per weight). As ``T`` grows the op turns
compute-bound (past ``T`` ≈ 270 for bf16 and ≈ 75 for int4 at 800 TFLOP/s over 3 TB/s),
and the untuned kernel (64 × 64 tiles that unpack their weights before each dot) may fall
to cuBLAS's dense speed at ``T = 2048``: the speedup column says where quantization stops
paying.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from loramux.benchmarks.kernels_gpu.timing import BenchContext, kernel_row, run_case
from loramux.kernels.quant_linear import (
    QuantizedWeight,
    dequantize,
    quant_linear_reference,
    quantize_int4,
    quantize_int8,
)


def projection_shapes(hidden: int, intermediate: int) -> tuple[tuple[str, int, int], ...]:
    """``(projection, N, K)`` of a Llama layer's distinct weight shapes, with as many query
    heads × head dim as ``hidden`` (Llama-7B's 32 × 128): q and o are square."""
    return (
        ("q/o", hidden, hidden),
        ("gate/up", intermediate, hidden),
        ("down", hidden, intermediate),
    )


@dataclass(frozen=True)
class QuantCase:
    projection: str  # a label of projection_shapes
    out_features: int  # N
    in_features: int  # K
    tokens: int  # T; 1: one decode token
    kind: str  # "int8" or "int4"
    group_size: int | None  # None: per-channel (int8 only)

    @property
    def weights(self) -> str:  # "int8 per-channel", "int4 g32"
        group = "per-channel" if self.group_size is None else f"g{self.group_size}"
        return f"{self.kind} {group}"

    def quantize(self, weight: torch.Tensor) -> QuantizedWeight:
        quantize = quantize_int8 if self.kind == "int8" else quantize_int4
        return quantize(weight, self.group_size)  # int4 refuses None


def run_quant_case(case: QuantCase, ctx: BenchContext) -> dict:
    fields = {
        "projection": case.projection,
        "out_features": case.out_features,
        "in_features": case.in_features,
        "tokens": case.tokens,
        "weights": case.weights,
        "kind": case.kind,
        "group_size": case.group_size,  # None: per-channel
    }
    return run_case(fields, lambda: _measure(case, ctx))


def _measure(case: QuantCase, ctx: BenchContext) -> dict:
    from loramux.kernels import quant_triton  # after the caller chose compiler or interpreter

    n, k, t = case.out_features, case.in_features, case.tokens
    # W ~ N(0, 1/K), quantized on the device; its float32 original is dropped at once.
    weight = case.quantize(torch.randn(n, k, device=ctx.device) * k**-0.5)
    dense = dequantize(weight).to(ctx.dtype)  # [N, K]: the bf16 layer it replaces
    x = torch.randn(t, k, dtype=ctx.dtype, device=ctx.device)  # [T, K]
    expected = quant_linear_reference(x.float(), weight)  # [T, N] float32
    triton_fn = partial(quant_triton.quant_linear_triton, x, weight)
    baseline_fn = partial(F.linear, x, dense)
    # The floor by the module docstring.
    activation_bytes = ctx.dtype.itemsize * t * (k + n)
    num_bytes = weight.nbytes + activation_bytes
    dense_bytes = dense.numel() * dense.element_size() + activation_bytes
    flops = 2 * t * n * k
    row = kernel_row(ctx, triton_fn, baseline_fn, expected, num_bytes, flops)
    dense_floor_ms = ctx.rates.floor_s(dense_bytes, flops) * 1e3
    row |= {
        "weight_bytes": weight.nbytes,
        "dense_weight_bytes": dense.numel() * dense.element_size(),
        "dense_floor_ms": dense_floor_ms,
        "floor_speedup": dense_floor_ms / row["floor_ms"],
    }
    if t != 1:
        return row
    achieved = num_bytes / (row["triton_ms"] / 1e3)
    return {
        **row,
        "achieved_gbs": achieved / 1e9,
        "copy_fraction": achieved / ctx.rates.copy_bytes_per_s,
        "baseline_gbs": dense_bytes / (row["baseline_ms"] / 1e3) / 1e9,
    }
