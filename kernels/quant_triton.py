"""Triton kernel for weight-only quantized linear layers (the CUDA path).

Same definition as :mod:`loramux.kernels.quant_linear` (``quant_linear_reference`` is the
definition): for ``x [T, K]`` and a quantized ``W [N, K]`` in groups of ``G`` inputs
(``g = k // G``; ``s`` the scales, ``m`` the mins, zero for int8),

    W[n, k] = s[n, g] · q[n, k] + m[n, g]
    y[t, n] = Σ_k x[t, k] · W[n, k] + bias[n]
            = Σ_g ( s[n, g] · Σ_{k ∈ g} x[t, k] · q[n, k]  +  m[n, g] · Σ_{k ∈ g} x[t, k] ) + bias[n]

One program computes a ``[BLOCK_T, BLOCK_N]`` tile of ``y`` and walks ``K`` in blocks of
``BLOCK_K`` inputs. Every block lies inside one group: ``BLOCK_K`` divides ``G``, or the
matrix has one group (``G = K``, per-channel int8; the last block is then masked). So a
block ``[k0, k0 + BLOCK_K)`` of group ``g = k0 // G`` de-quantizes as a whole by its
group's scale and min, applied to the block's product rather than to each weight:

    acc[t, n] += s[n, g] · (x_b @ q_b^T)[t, n]  +  m[n, g] · Σ_{k ∈ b} x[t, k]

Each tile of ``W`` is unpacked in the kernel (int8 bytes, or int4 nibbles) to integer
values; ``q`` (``|q| ≤ 128``) is exact in bfloat16, float16 and tf32, so ``tl.dot`` of
``x`` (in its own dtype) with ``q`` forms exact products summed in float32, and the
result differs from the float32 definition only by float32 rounding, whatever the
activations' dtype. (Multiplying ``s · q + m`` out first and rounding ``W`` to 16 bits
for the dot would add an error of up to 2^-9 per weight in bfloat16.) Scales, mins, bias
and all sums are float32; ``y`` is rounded to ``x``'s dtype once, at the end.

int4 blocks: ``BLOCK_K`` is a multiple of 32, so a block is ``BLOCK_K / 32`` whole packed
chunks, the ``BLOCK_K / 2`` bytes from byte ``k0 / 2`` of the row. Byte ``i`` of the
block (chunk ``c = i // 16``, ``j = i % 16``) holds input ``k0 + 32c + j`` in its low
nibble and ``k0 + 32c + 16 + j`` in its high one, so each byte is loaded once and the
block is two dots of ``BLOCK_K / 2``: ``x[:, lo] @ (byte & 15)`` and ``x[:, hi] @ (byte >> 4)``.

``tl.dot`` needs every tile dimension ≥ 16: ``BLOCK_T`` is ``T`` rounded up to a power of
two, at least 16 (masked rows load zeros and store nothing), at most ``MAX_BLOCK_T``.
A decode step (``T`` of 1..16) thus pays 16 rows of tensor-core work, which is free next
to reading the weights it is bound by.

CUDA graphs: the launch allocates nothing but ``y`` (nothing at all given ``out``), never
reads a device value on the host, and its grid and constants depend on shapes only.

The interpreter (``TRITON_INTERPRET=1``, the CPU tests) keeps bfloat16 as raw uint16 and
would multiply bit patterns, so there the dot operands are float32 (exact, as above) and
the final bfloat16 rounding is done on the bits (``_round_to``); on a GPU the dot takes
``x``'s 16-bit dtype natively. float32 activations use full-precision ("ieee") dots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loramux.kernels.lora_triton import _round_to
from loramux.kernels.quant_linear import QuantizedWeight

# Launch tiles (not yet tuned on hardware). BLOCK_K is the largest power of two that
# divides the group size, at most MAX_BLOCK_K (32 for GGUF's groups of 32); per-channel
# int8 takes next_pow2(K), at most MAX_BLOCK_K, with a masked last block.
BLOCK_N = 64
# In Triton's interpreter each program is a Python loop over numpy tiles: wide tiles make
# few programs (an LM head of 49,152 outputs: 4.3 s a call at 64, under a second at 2048).
INTERPRETER_BLOCK_N = 2048
MAX_BLOCK_T = 64
MAX_BLOCK_K = 128
MIN_DOT = 16  # tl.dot's smallest tile dimension
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _block_dot(x, q, DOT_FP32: tl.constexpr):
    """``x @ q`` in float32 (``q`` integer-valued): float32 operands with full-precision
    products (float32 activations, or the interpreter), else native 16-bit operands."""
    if DOT_FP32:
        return tl.dot(x.to(tl.float32), q.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(x, q.to(x.dtype))


@triton.jit
def _quant_linear_kernel(
    x_ptr,  # [T, K]
    q_ptr,  # int8 [N, K], or uint8 [N, K / 2] (int4, packed)
    scales_ptr,  # float32 [N, K / G]
    mins_ptr,  # float32 [N, K / G] (int4; unused for int8)
    bias_ptr,  # [N] (read only when HAS_BIAS)
    out_ptr,  # [T, N]
    num_tokens,
    out_features,
    stride_xt,
    stride_xk,
    stride_qn,
    stride_qk,
    stride_sn,
    stride_sg,
    stride_mn,
    stride_mg,
    stride_bias,
    stride_ot,
    stride_on,
    IN_FEATURES: tl.constexpr,  # K
    GROUP_SIZE: tl.constexpr,  # G (= K per-channel)
    INT4: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides GROUP_SIZE, or GROUP_SIZE == IN_FEATURES
):
    # Programs along T are adjacent, so a W tile read from memory serves every T tile.
    t0 = tl.program_id(0) * BLOCK_T
    n0 = tl.program_id(1) * BLOCK_N
    offs_t = t0 + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    offs_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    t_mask = offs_t < num_tokens
    n_mask = offs_n < out_features
    x_rows = x_ptr + offs_t.to(tl.int64)[:, None] * stride_xt  # [BLOCK_T, 1]
    q_cols = q_ptr + offs_n.to(tl.int64)[None, :] * stride_qn  # [1, BLOCK_N]: W^T's columns
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, IN_FEATURES, BLOCK_K):
        g = k0 // GROUP_SIZE  # the group the whole block lies in
        scale = tl.load(scales_ptr + offs_n * stride_sn + g * stride_sg, mask=n_mask, other=0.0)
        if INT4:
            # BLOCK_K | G | K: no partial block. Byte i of the block: chunk i // 16, slot i % 16.
            offs_b = tl.arange(0, BLOCK_K // 2)  # [BLOCK_K / 2]
            k_lo = k0 + (offs_b // 16) * 32 + offs_b % 16  # inputs of the low nibbles
            k_hi = k_lo + 16  # inputs of the high nibbles
            packed = tl.load(
                q_cols + (k0 // 2 + offs_b)[:, None] * stride_qk, mask=n_mask[None, :], other=0
            )  # [BLOCK_K / 2, BLOCK_N] uint8: W^T's packed rows
            x_lo = tl.load(x_rows + k_lo[None, :] * stride_xk, mask=t_mask[:, None], other=0.0)
            x_hi = tl.load(x_rows + k_hi[None, :] * stride_xk, mask=t_mask[:, None], other=0.0)
            # part[t, n] = Σ_{k ∈ b} x[t, k] · q[n, k], exact products in float32
            part = _block_dot(x_lo, packed & 0x0F, DOT_FP32)
            part += _block_dot(x_hi, packed >> 4, DOT_FP32)
            # Σ_{k ∈ b} x[t, k], for the group's min
            x_sum = tl.sum(x_lo.to(tl.float32), axis=1) + tl.sum(x_hi.to(tl.float32), axis=1)
            mn = tl.load(mins_ptr + offs_n * stride_mn + g * stride_mg, mask=n_mask, other=0.0)
            # acc[t, n] += s[n, g] · part[t, n] + m[n, g] · Σ_{k ∈ b} x[t, k]
            acc += part * scale[None, :] + x_sum[:, None] * mn[None, :]
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            k_mask = offs_k < IN_FEATURES  # only per-channel's last block is partial
            x = tl.load(
                x_rows + offs_k[None, :] * stride_xk,
                mask=t_mask[:, None] & k_mask[None, :],
                other=0.0,
            )  # [BLOCK_T, BLOCK_K]
            q = tl.load(
                q_cols + offs_k[:, None] * stride_qk,
                mask=k_mask[:, None] & n_mask[None, :],
                other=0,
            )  # [BLOCK_K, BLOCK_N] int8: W^T's rows
            # acc[t, n] += s[n, g] · Σ_{k ∈ b} x[t, k] · q[n, k]
            acc += _block_dot(x, q, DOT_FP32) * scale[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=n_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_t.to(tl.int64)[:, None] * stride_ot + offs_n[None, :] * stride_on
    # One rounding of the float32 result to the activations' dtype.
    tl.store(
        out_ptrs, _round_to(acc, out_ptr.dtype.element_ty), mask=t_mask[:, None] & n_mask[None, :]
    )


# --- launcher ------------------------------------------------------------------------------


def quant_linear_triton(
    x: torch.Tensor,  # [T, K] float32, bfloat16 or float16
    weight: QuantizedWeight,  # W [N, K]
    bias: torch.Tensor | None = None,  # [N]
    out: torch.Tensor | None = None,  # [T, N] in x's dtype (any strides), written in place
) -> torch.Tensor:  # [T, N] in x's dtype
    """``y = x @ dequantize(weight)^T + bias`` in float32, rounded to ``x``'s dtype (see the
    module doc); written into ``out`` when given, which is then returned."""
    tokens, n, k = _check(x, weight, bias, out)
    if out is None:
        out = torch.empty(tokens, n, dtype=x.dtype, device=x.device)
    if tokens == 0 or n == 0:
        return out
    block_t = min(MAX_BLOCK_T, max(MIN_DOT, triton.next_power_of_2(tokens)))
    block_k = block_k_for(weight)
    int4 = weight.kind == "int4"
    mins = weight.mins if int4 else weight.scales  # int8: a placeholder, never read
    block_n = INTERPRETER_BLOCK_N if _interpreting() else BLOCK_N
    grid = (triton.cdiv(tokens, block_t), triton.cdiv(n, block_n))
    _quant_linear_kernel[grid](
        x,
        weight.qweight,
        weight.scales,
        mins,
        out if bias is None else bias,  # no bias: a placeholder, never read
        out,
        tokens,
        n,
        x.stride(0),
        x.stride(1),
        weight.qweight.stride(0),
        weight.qweight.stride(1),
        weight.scales.stride(0),
        weight.scales.stride(1),
        mins.stride(0),
        mins.stride(1),
        0 if bias is None else bias.stride(0),
        out.stride(0),
        out.stride(1),
        IN_FEATURES=k,
        GROUP_SIZE=weight.group_size,
        INT4=int4,
        HAS_BIAS=bias is not None,
        DOT_FP32=x.dtype == torch.float32 or _interpreting(),
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out


def block_k_for(weight: QuantizedWeight) -> int:
    """The K-block of ``weight``: a power of two ≥ 16 that divides its group size (so each
    block lies in one group), or, with a single group, ``next_pow2(K)`` (the last block
    masked); at most ``MAX_BLOCK_K``. ValueError for a group size that allows neither."""
    group, k = weight.group_size, weight.in_features
    if group == k and weight.kind == "int8":  # one group: any block lies in it
        return min(MAX_BLOCK_K, max(MIN_DOT, triton.next_power_of_2(k)))
    # The largest power of two dividing G. int4: G is a multiple of INT4_CHUNK
    # (check_quantized), so blocks are whole chunks and never partial.
    block = min(MAX_BLOCK_K, group & -group)
    if block < MIN_DOT:
        raise ValueError(
            f"quant_linear_triton: group size {group} must be a multiple of {MIN_DOT} "
            f"(or the {k} input features: per-channel)"
        )
    return block


def _interpreting() -> bool:
    """Whether the kernels run in Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_quant_linear_kernel, triton.runtime.JITFunction)


def _check(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    out: torch.Tensor | None,
) -> tuple[int, int, int]:
    """``(T, N, K)``; ValueError unless the operands fit each other (shapes only: no sync)."""
    n, k = weight.out_features, weight.in_features
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"quant_linear_triton: x must be [T, {k}], got {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"quant_linear_triton: unsupported activation dtype {x.dtype}")
    tokens = x.shape[0]
    tensors = {"qweight": weight.qweight, "scales": weight.scales}
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != n or not bias.is_floating_point():
            raise ValueError(f"quant_linear_triton: bias must be a float [{n}] tensor")
        tensors["bias"] = bias
    if weight.mins is not None:
        tensors["mins"] = weight.mins
    if out is not None:
        if tuple(out.shape) != (tokens, n) or out.dtype != x.dtype:
            raise ValueError(f"quant_linear_triton: out must be [{tokens}, {n}] in {x.dtype}")
        tensors["out"] = out
    for name, tensor in tensors.items():
        if tensor.device != x.device:
            raise ValueError(f"quant_linear_triton: {name} is on {tensor.device}, x on {x.device}")
    block_k_for(weight)  # the group size is one the kernel can block
    return tokens, n, k
