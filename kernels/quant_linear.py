"""Weight-only quantized linear layers: the packed forms, their definition and the torch reference.

A :class:`QuantizedWeight` stands for a float matrix ``W [N, K]`` (``N`` outputs, ``K``
inputs) stored in groups of ``G`` consecutive inputs of one output row (``G`` divides
``K``; ``g = k // G``):

* ``int8``: ``W[n, k] = scales[n, g] * q[n, k]`` with ``q`` in int8 (symmetric).
  Per-channel int8 is ``G = K``; GGUF's ``Q8_0`` is ``G = 32``.
* ``int4``: ``W[n, k] = scales[n, g] * q[n, k] + mins[n, g]`` with ``q`` in ``0..15``
  (asymmetric). GGUF's ``Q4_0`` (``mins = -8 scales``), ``Q4_1`` and ``Q4_K`` (the
  super-block's 6-bit scales and mins folded into one scale and min per 32) all take this
  form with ``G = 32``; quantizing a float checkpoint gives ``G`` in 32, 64 or 128.

Scales and mins are float32 (GGUF's fp16 values convert exactly). int4 values are packed
two per byte in chunks of 32 inputs: byte ``j < 16`` of a chunk holds input ``j`` in its
low nibble and input ``j + 16`` in its high one (GGUF's ``Q4_0`` order, which also suits
SIMD: one 16-byte load gives 32 values by a mask and a shift).

The op is ``y = x @ W^T (+ bias)``: :func:`quant_linear_reference` de-quantizes ``W`` in
float32 and multiplies, which is the definition (and what the exactness tests run through
PEFT). The engine's implementations compute the same sum grouped by ``g``,

    y[t, n] = sum_g scales[n, g] * (x[t, g] . q[n, g]) + mins[n, g] * sum(x[t, g])

(the CPU's native op, ``quant_native``) or de-quantize tiles in the kernel (Triton,
``quant_triton``); both accumulate in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

QUANT_KINDS = ("int8", "int4")
INT4_CHUNK = 32  # inputs per packed int4 chunk: 16 bytes
INT4_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True, eq=False)  # tensors: compared by identity
class QuantizedWeight:
    """A quantized ``[out_features, in_features]`` matrix (see the module docstring)."""

    kind: str  # "int8" or "int4"
    qweight: torch.Tensor  # int8 [N, K], or uint8 [N, K // 2] for int4
    scales: torch.Tensor  # float32 [N, K // group_size]
    mins: torch.Tensor | None  # float32 [N, K // group_size] for int4, None for int8
    group_size: int

    def __post_init__(self) -> None:
        check_quantized(self)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.scales.shape[1] * self.group_size

    @property
    def nbytes(self) -> int:
        tensors = (self.qweight, self.scales, self.mins)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        mins = None if self.mins is None else self.mins.to(device)
        return QuantizedWeight(
            self.kind, self.qweight.to(device), self.scales.to(device), mins, self.group_size
        )

    def rows(self, index: torch.Tensor | slice) -> QuantizedWeight:
        """The matrix of the output rows ``index`` (a permutation, an embedding's lookup, a
        tile)."""
        mins = None if self.mins is None else self.mins[index]
        return QuantizedWeight(
            self.kind, self.qweight[index], self.scales[index], mins, self.group_size
        )


def check_quantized(weight: QuantizedWeight) -> None:
    """Raise ValueError unless ``weight``'s tensors have the kinds and shapes it claims."""
    kind, q, scales, mins, group = (
        weight.kind,
        weight.qweight,
        weight.scales,
        weight.mins,
        weight.group_size,
    )
    if kind not in QUANT_KINDS:
        raise ValueError(f"quantized weight kind must be one of {QUANT_KINDS}, got {kind!r}")
    if scales.dim() != 2 or scales.dtype != torch.float32 or group <= 0:
        raise ValueError("scales must be a float32 [N, K / group_size] tensor")
    if q.device != scales.device or (mins is not None and mins.device != scales.device):
        raise ValueError("a quantized weight's tensors must be on one device")
    n, k = scales.shape[0], scales.shape[1] * group
    if kind == "int8":
        if q.dtype != torch.int8 or tuple(q.shape) != (n, k) or mins is not None:
            raise ValueError(f"int8 weights must be int8 [{n}, {k}] without mins")
    else:
        if group % INT4_CHUNK:
            raise ValueError(f"int4 groups must be a multiple of {INT4_CHUNK}, got {group}")
        if q.dtype != torch.uint8 or tuple(q.shape) != (n, k // 2):
            raise ValueError(f"int4 weights must be uint8 [{n}, {k // 2}] (two per byte)")
        if mins is None or mins.dtype != torch.float32 or mins.shape != scales.shape:
            raise ValueError("int4 weights need float32 mins shaped like their scales")


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``q`` as uint8 ``[N, K]`` (values 0..15) from its packed ``[N, K // 2]`` form."""
    n = packed.shape[0]
    chunks = packed.view(n, -1, INT4_CHUNK // 2)  # [N, K/32, 16]
    return torch.cat([chunks & 0x0F, chunks >> 4], dim=-1).view(n, -1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """The packed ``[N, K // 2]`` form of ``q`` (uint8 ``[N, K]``, values 0..15)."""
    n = q.shape[0]
    chunks = q.to(torch.uint8).view(n, -1, INT4_CHUNK)  # [N, K/32, 32]
    half = INT4_CHUNK // 2
    return (chunks[..., :half] | (chunks[..., half:] << 4)).reshape(n, -1)


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """``W`` in float32, ``[N, K]``: the definition of the packed form."""
    group = weight.group_size
    if weight.kind == "int8":
        q = weight.qweight.to(torch.float32)
        return (q.view(q.shape[0], -1, group) * weight.scales[..., None]).view(q.shape)
    q = unpack_int4(weight.qweight).to(torch.float32)
    grouped = q.view(q.shape[0], -1, group) * weight.scales[..., None] + weight.mins[..., None]
    return grouped.view(q.shape)


def quant_linear_reference(
    x: torch.Tensor,  # [T, K]
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, N] in x's dtype
    """``x @ dequantize(W)^T + bias``, in float32."""
    y = F.linear(x.to(torch.float32), dequantize(weight).to(x.device), None)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


# --- quantizing a float matrix (round to nearest) ----------------------------------------


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric round-to-nearest: ``scales = max|W_g| / 127`` per group (``None``: one
    group per output row, per-channel)."""
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    group = k if group_size is None else group_size
    _check_group(k, group)
    grouped = w.view(n, k // group, group)
    scales = grouped.abs().amax(-1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(grouped / safe[..., None]).clamp(-127, 127).to(torch.int8).view(n, k)
    return QuantizedWeight("int8", q.contiguous(), scales.contiguous(), None, group)


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """Asymmetric round-to-nearest per group: ``mins = min W_g``,
    ``scales = (max W_g - min W_g) / 15``, ``q = round((W - mins) / scales)``."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    _check_group(k, group_size)
    grouped = w.view(n, k // group_size, group_size)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scales = (high - low) / 15.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((grouped - low[..., None]) / safe[..., None]).clamp(0, 15).view(n, k)
    return QuantizedWeight("int4", pack_int4(q), scales.contiguous(), low.contiguous(), group_size)


def _check_group(in_features: int, group: int) -> None:
    if group <= 0 or in_features % group:
        raise ValueError(f"group size {group} does not divide the {in_features} input features")


# --- the torch implementation (no C compiler, or activations other than float32) ---------

TORCH_TILE_ELEMENTS = 1 << 20  # weights de-quantized at once (4 MiB in float32)


def quant_linear_torch(
    x: torch.Tensor,  # [T, K]
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, N] in x's dtype
    """``quant_linear_reference`` over tiles of output rows, so no full float copy of ``W``
    exists at any time (an LM head's would be hundreds of MB)."""
    n, k = weight.out_features, weight.in_features
    rows = max(1, min(n, TORCH_TILE_ELEMENTS // k))
    if rows == n:
        return F.linear(x, dequantize(weight).to(x.dtype), bias)
    y = x.new_empty(x.shape[0], n)
    for first in range(0, n, rows):
        index = slice(first, min(n, first + rows))
        tile = dequantize(weight.rows(index)).to(x.dtype)
        y[:, index] = F.linear(x, tile, None if bias is None else bias[index])
    return y
