"""Triton kernels for the multi-slice batched LoRA ops (SGMV for prefill, BGMV for decode).

Semantics (``loramux.kernels.lora`` holds the torch references, which define them): for
token t with adapter a (``batch.token_adapter[t]``), slice s with rank r = rank[s, a]
and scale c = scale[s, a], rows ρ = rows[a, :r]:

    shrink:  y[s, t, :r]                 = x[t] @ A_s[ρ]^T            (A_s: [R, in])
    expand:  out[t, off_s : off_s + n_s] += c · (y[s, t, :r] @ B_s[ρ])  (B_s: [R, n_s])

Every product accumulates in fp32. Rows are gathered through ``rows`` (any rows, no
padding of weights to a maximum rank); ranks may differ per adapter and per slice.
All slices of a projection group run in one launch: the pools are reached through a
small device table of base pointers (``_slice_table``), one row per slice, and each
slice's output is its own pointer argument (a group's modules write separate tensors; the
``out`` + offsets form passes column views of one). A decode-sized step fuses shrink and
expand into one launch instead (``loramux.kernels.lora_triton_fused``).

Two grids over the same maths:

* SGMV: one program per (segment, tile of ``BLOCK_M`` tokens, slice × output tile);
  a tile reads its adapter's weights once for up to ``BLOCK_M`` tokens, and uses
  ``tl.dot``. Programs past a segment's length or an adapter's rank exit at once.
* BGMV: one program per (token, slice × output tile); a token's dot products are
  broadcast multiplies and ``tl.sum`` (one row of x: nothing for ``tl.dot`` to tile).

The shrink output ``y [num_slices, T, max_rank]`` has x's dtype and is zero wherever
nothing was computed (tokens without an adapter, columns past a rank); expand reads only
``y[s, t, :r]``.

Three habits come from Triton's CPU interpreter (``TRITON_INTERPRET=1``), which the CPU
tests run these kernels in, and keep a single code path that those tests cover:

* tiles are cast to fp32 before any arithmetic: the interpreter keeps bf16 as raw
  uint16 and adds/multiplies those integers. ``tl.dot`` then runs on fp32 operands with
  ``input_precision="tf32"`` for 16-bit inputs, which is exact: every bf16 and fp16
  value is representable in tf32 (8-bit exponent, 10-bit mantissa), so products are
  exact and sums are fp32, as with a native 16-bit dot. fp32 inputs use ``"ieee"``.
* fp32 → bf16 rounds to nearest even by integer arithmetic (``_round_to``): the
  interpreter's bf16 cast truncates; the GPU's native cast rounds the same way as ours.
* loop bounds are constexpr (``IN_FEATURES``, ``NUM_R_TILES``): Triton 3.6's interpreter
  cannot run ``range`` over a runtime value with NumPy ≥ 2.4 (triton-lang/triton#9171).
  On a GPU this costs one compile per distinct in_features (a model has two or three)
  and lets the compiler drop the masks when ``in_features`` is a multiple of ``BLOCK_K``;
  expand's rank tiles past an adapter's rank are fully masked and load nothing.

Each launch reads a small per-slice table (pool base addresses, strides, widths) on the
device; activations never enter it (their addresses change every step). The tables are cached by content: a model's pools are few and fixed (views
of the KV arena), so launches reuse them instead of copying one to the device every time,
and a CUDA-graph capture (which cannot copy from pageable host memory) finds them made by
its warm-up run.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from loramux.kernels.lora_batch import LoRABatch

# Launch tiles. Rank tiles (BLOCK_R) cover ranks up to 64 in one tile; larger ranks take
# several output tiles (shrink) or loop iterations (expand). tl.dot needs every tile
# dimension ≥ 16.
SGMV_BLOCK_K = 64  # reduction over in_features
SGMV_BLOCK_N = 64  # expand output columns
BGMV_BLOCK_K = 64
BGMV_BLOCK_N = 64
MAX_BLOCK_M = 64
MAX_BLOCK_R = 64


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """fp32 ``x`` → ``dtype``, rounding to nearest, ties to even."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        # Adding 0x7FFF plus the lowest kept bit carries into the kept half exactly when
        # the dropped half is above one half-ulp, or equal to it with an odd kept half.
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        quiet_nan = (bits >> 16) | 0x40  # NaN stays NaN (rounding could carry it to inf)
        out = tl.where(x != x, quiet_nan, rounded).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = x.to(dtype)
    return out


@triton.jit
def _slice_out(slice_id, out0_ptr, out1_ptr, out2_ptr, stride_o0, stride_o1, stride_o2):
    """Slice ``slice_id``'s output (base pointer, row stride): a group has at most three
    slices, each written to its own tensor (or a column view of a shared one)."""
    if slice_id == 0:
        out_base = out0_ptr
        stride_o = stride_o0
    elif slice_id == 1:
        out_base = out1_ptr
        stride_o = stride_o1
    else:
        out_base = out2_ptr
        stride_o = stride_o2
    return out_base, stride_o


@triton.jit
def _shrink_sgmv_kernel(
    x_ptr,  # [T, in]
    y_ptr,  # [num_slices, T, max_rank]
    a_table_ptr,  # [num_slices, 2] int64: (A_s base address, A_s row stride)
    seg_start_ptr,
    seg_len_ptr,
    seg_adapter_ptr,
    rows_ptr,  # [A, max_rank]
    rank_ptr,  # [num_slices, A] (already offset to the op's first slice)
    stride_xt,
    stride_ys,
    stride_yt,
    stride_rows,
    stride_rank,
    num_r_tiles,
    IN_FEATURES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    slice_id = tl.program_id(2) // num_r_tiles
    r0 = (tl.program_id(2) % num_r_tiles) * BLOCK_R
    adapter = tl.load(seg_adapter_ptr + seg)
    rank = tl.load(rank_ptr + slice_id * stride_rank + adapter)
    seg_len = tl.load(seg_len_ptr + seg)
    if m0 >= seg_len or r0 >= rank:  # past the segment or the rank (0: slice not targeted)
        return
    tokens = tl.load(seg_start_ptr + seg) + m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    token_mask = m0 + tl.arange(0, BLOCK_M) < seg_len
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    rows = tl.load(rows_ptr + adapter * stride_rows + offs_r, mask=r_mask, other=0).to(tl.int64)
    a_base = tl.load(a_table_ptr + slice_id * 2).to(tl.pointer_type(x_ptr.dtype.element_ty))
    a_stride = tl.load(a_table_ptr + slice_id * 2 + 1)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]  # [M, K]
    a_ptrs = a_base + rows[None, :] * a_stride + offs_k[:, None]  # [K, R]: A_s[ρ]^T
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, IN_FEATURES, BLOCK_K):
        k_mask = offs_k < IN_FEATURES - k0
        x = tl.load(x_ptrs, mask=token_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        # acc[m, i] += Σ_k x[t_m, k] · A_s[ρ_i, k]
        acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    y_ptrs = y_ptr + slice_id * stride_ys + tokens.to(tl.int64)[:, None] * stride_yt + offs_r
    tl.store(
        y_ptrs, _round_to(acc, y_ptr.dtype.element_ty), mask=token_mask[:, None] & r_mask[None, :]
    )


@triton.jit
def _shrink_bgmv_kernel(
    x_ptr,  # [T, in]
    y_ptr,  # [num_slices, T, max_rank]
    a_table_ptr,  # [num_slices, 2] int64: (A_s base address, A_s row stride)
    token_adapter_ptr,
    rows_ptr,
    rank_ptr,
    stride_xt,
    stride_ys,
    stride_yt,
    stride_rows,
    stride_rank,
    num_r_tiles,
    IN_FEATURES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0)
    slice_id = tl.program_id(1) // num_r_tiles
    r0 = (tl.program_id(1) % num_r_tiles) * BLOCK_R
    adapter = tl.load(token_adapter_ptr + token)
    if adapter < 0:  # no adapter: y stays 0
        return
    rank = tl.load(rank_ptr + slice_id * stride_rank + adapter)
    if r0 >= rank:
        return
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    rows = tl.load(rows_ptr + adapter * stride_rows + offs_r, mask=r_mask, other=0).to(tl.int64)
    a_base = tl.load(a_table_ptr + slice_id * 2).to(tl.pointer_type(x_ptr.dtype.element_ty))
    a_stride = tl.load(a_table_ptr + slice_id * 2 + 1)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token.to(tl.int64) * stride_xt + offs_k  # [K]
    a_ptrs = a_base + rows[:, None] * a_stride + offs_k[None, :]  # [R, K]: A_s[ρ]
    # Partial products per (i, k) lane, reduced over k once at the end.
    acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, IN_FEATURES, BLOCK_K):
        k_mask = offs_k < IN_FEATURES - k0
        x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_ptrs, mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += a * x[None, :]  # acc[i, k] += A_s[ρ_i, k] · x[t, k]
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)  # [R]: y[s, t, i] = Σ_k A_s[ρ_i, k] · x[t, k]
    y_ptrs = y_ptr + slice_id * stride_ys + token.to(tl.int64) * stride_yt + offs_r
    tl.store(y_ptrs, _round_to(y, y_ptr.dtype.element_ty), mask=r_mask)


@triton.jit(do_not_specialize=["stride_o0", "stride_o1", "stride_o2"])
def _expand_sgmv_kernel(
    y_ptr,  # [num_slices, T, ≥ max_rank]
    out0_ptr,  # slice s's output [T, n_s] (s = 0, 1, 2), updated in place
    out1_ptr,
    out2_ptr,
    b_table_ptr,  # [num_slices, 3] int64: (B_s base, B_s row stride, n_s)
    seg_start_ptr,
    seg_len_ptr,
    seg_adapter_ptr,
    rows_ptr,
    rank_ptr,
    scale_ptr,
    stride_ys,
    stride_yt,
    stride_o0,
    stride_o1,
    stride_o2,
    stride_rows,
    stride_rank,
    stride_scale,
    num_n_tiles,
    NUM_R_TILES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seg = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    slice_id = tl.program_id(2) // num_n_tiles
    n0 = (tl.program_id(2) % num_n_tiles) * BLOCK_N
    adapter = tl.load(seg_adapter_ptr + seg)
    rank = tl.load(rank_ptr + slice_id * stride_rank + adapter)
    seg_len = tl.load(seg_len_ptr + seg)
    width = tl.load(b_table_ptr + slice_id * 3 + 2)
    if m0 >= seg_len or rank == 0 or n0 >= width:  # nothing to add in this tile
        return
    b_base = tl.load(b_table_ptr + slice_id * 3).to(tl.pointer_type(out0_ptr.dtype.element_ty))
    b_stride = tl.load(b_table_ptr + slice_id * 3 + 1)
    out_base, stride_ot = _slice_out(
        slice_id, out0_ptr, out1_ptr, out2_ptr, stride_o0, stride_o1, stride_o2
    )
    scale = tl.load(scale_ptr + slice_id * stride_scale + adapter)
    tokens = (tl.load(seg_start_ptr + seg) + m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    token_mask = m0 + tl.arange(0, BLOCK_M) < seg_len
    offs_n = tl.arange(0, BLOCK_N)
    n_mask = offs_n < width - n0
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r_tile in range(NUM_R_TILES):  # tiles past this adapter's rank load nothing
        r0 = r_tile * BLOCK_R
        r_mask = offs_r < rank - r0
        rows = tl.load(rows_ptr + adapter * stride_rows + r0 + offs_r, mask=r_mask, other=0)
        y_ptrs = y_ptr + slice_id * stride_ys + tokens[:, None] * stride_yt + r0 + offs_r[None, :]
        y = tl.load(y_ptrs, mask=token_mask[:, None] & r_mask[None, :], other=0.0)  # [M, R]
        b_ptrs = b_base + rows.to(tl.int64)[:, None] * b_stride + n0 + offs_n[None, :]
        b = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # [R, N]
        # acc[m, j] += Σ_i y[s, t_m, i] · B_s[ρ_i, n0 + j]
        acc = tl.dot(y.to(tl.float32), b.to(tl.float32), acc, input_precision=DOT_PRECISION)
    out_ptrs = out_base + tokens[:, None] * stride_ot + n0 + offs_n[None, :]
    out_mask = token_mask[:, None] & n_mask[None, :]
    # One rounding of out + c·acc, both in fp32.
    result = tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32) + scale * acc
    tl.store(out_ptrs, _round_to(result, out0_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["stride_o0", "stride_o1", "stride_o2"])
def _expand_bgmv_kernel(
    y_ptr,  # [num_slices, T, ≥ max_rank]
    out0_ptr,  # slice s's output [T, n_s] (s = 0, 1, 2), updated in place
    out1_ptr,
    out2_ptr,
    b_table_ptr,  # [num_slices, 3] int64: (B_s base, B_s row stride, n_s)
    token_adapter_ptr,
    rows_ptr,
    rank_ptr,
    scale_ptr,
    stride_ys,
    stride_yt,
    stride_o0,
    stride_o1,
    stride_o2,
    stride_rows,
    stride_rank,
    stride_scale,
    num_n_tiles,
    NUM_R_TILES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    token = tl.program_id(0)
    slice_id = tl.program_id(1) // num_n_tiles
    n0 = (tl.program_id(1) % num_n_tiles) * BLOCK_N
    adapter = tl.load(token_adapter_ptr + token)
    if adapter < 0:
        return
    rank = tl.load(rank_ptr + slice_id * stride_rank + adapter)
    width = tl.load(b_table_ptr + slice_id * 3 + 2)
    if rank == 0 or n0 >= width:
        return
    b_base = tl.load(b_table_ptr + slice_id * 3).to(tl.pointer_type(out0_ptr.dtype.element_ty))
    b_stride = tl.load(b_table_ptr + slice_id * 3 + 1)
    out_base, stride_ot = _slice_out(
        slice_id, out0_ptr, out1_ptr, out2_ptr, stride_o0, stride_o1, stride_o2
    )
    scale = tl.load(scale_ptr + slice_id * stride_scale + adapter)
    offs_n = tl.arange(0, BLOCK_N)
    n_mask = offs_n < width - n0
    offs_r = tl.arange(0, BLOCK_R)
    y_row = y_ptr + slice_id * stride_ys + token.to(tl.int64) * stride_yt
    # Partial sums per (i, j) lane, reduced over the rank once at the end.
    acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    for r_tile in range(NUM_R_TILES):  # tiles past this adapter's rank load nothing
        r0 = r_tile * BLOCK_R
        r_mask = offs_r < rank - r0
        rows = tl.load(rows_ptr + adapter * stride_rows + r0 + offs_r, mask=r_mask, other=0)
        y = tl.load(y_row + r0 + offs_r, mask=r_mask, other=0.0).to(tl.float32)  # [R]
        b_ptrs = b_base + rows.to(tl.int64)[:, None] * b_stride + n0 + offs_n[None, :]
        b = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
        acc += y[:, None] * b  # acc[i, j] += y[s, t, i] · B_s[ρ_i, n0 + j]
    out_ptrs = out_base + token.to(tl.int64) * stride_ot + n0 + offs_n
    result = tl.load(out_ptrs, mask=n_mask, other=0.0).to(tl.float32) + scale * tl.sum(acc, 0)
    tl.store(out_ptrs, _round_to(result, out0_ptr.dtype.element_ty), mask=n_mask)


# --- launchers ---------------------------------------------------------------------------


def lora_shrink_sgmv(
    x: torch.Tensor,
    a_pools: Sequence[torch.Tensor],
    batch: LoRABatch,
    *,
    first_slice: int = 0,
    block_m: int | None = None,
) -> torch.Tensor:
    """Shrink over segments (prefill): ``y [len(a_pools), T, max_rank]``, see the module doc.

    ``block_m``: tokens per tile (a power of two ≥ 16); by default the longest segment's
    length rounded up to a power of two, at most ``MAX_BLOCK_M``.
    """
    y, a_table, rank = _shrink_setup(x, a_pools, batch, first_slice)
    if batch.num_segments == 0 or batch.max_rank == 0:
        return y
    block_m = block_m or _block(batch.max_seg_len, 16, MAX_BLOCK_M)
    block_r = _block(batch.max_rank, 16, MAX_BLOCK_R)
    num_r_tiles = triton.cdiv(batch.max_rank, block_r)
    grid = (
        batch.num_segments,
        triton.cdiv(batch.max_seg_len, block_m),
        len(a_pools) * num_r_tiles,
    )
    _shrink_sgmv_kernel[grid](
        x,
        y,
        a_table,
        batch.seg_start,
        batch.seg_len,
        batch.seg_adapter,
        batch.rows,
        rank,
        x.stride(0),
        y.stride(0),
        y.stride(1),
        batch.rows.stride(0),
        rank.stride(0),
        num_r_tiles,
        IN_FEATURES=x.shape[1],
        DOT_PRECISION=_dot_precision(x.dtype),
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=SGMV_BLOCK_K,
    )
    return y


def lora_shrink_bgmv(
    x: torch.Tensor, a_pools: Sequence[torch.Tensor], batch: LoRABatch, *, first_slice: int = 0
) -> torch.Tensor:
    """Shrink per token (decode): ``y [len(a_pools), T, max_rank]``, see the module doc."""
    y, a_table, rank = _shrink_setup(x, a_pools, batch, first_slice)
    if batch.num_segments == 0 or batch.max_rank == 0:
        return y
    block_r = _block(batch.max_rank, 1, MAX_BLOCK_R)
    num_r_tiles = triton.cdiv(batch.max_rank, block_r)
    _shrink_bgmv_kernel[(batch.num_tokens, len(a_pools) * num_r_tiles)](
        x,
        y,
        a_table,
        batch.token_adapter,
        batch.rows,
        rank,
        x.stride(0),
        y.stride(0),
        y.stride(1),
        batch.rows.stride(0),
        rank.stride(0),
        num_r_tiles,
        IN_FEATURES=x.shape[1],
        BLOCK_R=block_r,
        BLOCK_K=BGMV_BLOCK_K,
    )
    return y


def lora_expand_sgmv(
    out: torch.Tensor,
    y: torch.Tensor,
    b_pools: Sequence[torch.Tensor],
    slice_offsets: Sequence[int],
    batch: LoRABatch,
    *,
    first_slice: int = 0,
    block_m: int | None = None,
) -> None:
    """Expand over segments (prefill), adding into ``out`` in place; see the module doc.

    ``block_m`` as for ``lora_shrink_sgmv``.
    """
    outs = slice_views(out, b_pools, slice_offsets)
    lora_expand_sgmv_outs(outs, y, b_pools, batch, first_slice=first_slice, block_m=block_m)


def lora_expand_sgmv_outs(
    outs: Sequence[torch.Tensor],
    y: torch.Tensor,
    b_pools: Sequence[torch.Tensor],
    batch: LoRABatch,
    *,
    first_slice: int = 0,
    block_m: int | None = None,
) -> None:
    """``lora_expand_sgmv`` into one output per slice (``outs[s]``: ``[T, n_s]``, unit
    column stride), as a projection group's modules produce them: one launch."""
    b_table, rank, scale, out_args = _expand_setup(outs, y, b_pools, batch, first_slice)
    if batch.num_segments == 0 or batch.max_rank == 0:
        return
    block_m = block_m or _block(batch.max_seg_len, 16, MAX_BLOCK_M)
    block_r = _block(batch.max_rank, 16, MAX_BLOCK_R)
    num_n_tiles = triton.cdiv(max(p.shape[1] for p in b_pools), SGMV_BLOCK_N)
    grid = (
        batch.num_segments,
        triton.cdiv(batch.max_seg_len, block_m),
        len(b_pools) * num_n_tiles,
    )
    pointers, strides = out_args
    _expand_sgmv_kernel[grid](
        y,
        *pointers,
        b_table,
        batch.seg_start,
        batch.seg_len,
        batch.seg_adapter,
        batch.rows,
        rank,
        scale,
        y.stride(0),
        y.stride(1),
        *strides,
        batch.rows.stride(0),
        rank.stride(0),
        scale.stride(0),
        num_n_tiles,
        NUM_R_TILES=triton.cdiv(batch.max_rank, block_r),
        DOT_PRECISION=_dot_precision(outs[0].dtype),
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_N=SGMV_BLOCK_N,
    )


def lora_expand_bgmv(
    out: torch.Tensor,
    y: torch.Tensor,
    b_pools: Sequence[torch.Tensor],
    slice_offsets: Sequence[int],
    batch: LoRABatch,
    *,
    first_slice: int = 0,
) -> None:
    """Expand per token (decode), adding into ``out`` in place; see the module doc."""
    outs = slice_views(out, b_pools, slice_offsets)
    lora_expand_bgmv_outs(outs, y, b_pools, batch, first_slice=first_slice)


def lora_expand_bgmv_outs(
    outs: Sequence[torch.Tensor],
    y: torch.Tensor,
    b_pools: Sequence[torch.Tensor],
    batch: LoRABatch,
    *,
    first_slice: int = 0,
) -> None:
    """``lora_expand_bgmv`` into one output per slice, as ``lora_expand_sgmv_outs``."""
    b_table, rank, scale, out_args = _expand_setup(outs, y, b_pools, batch, first_slice)
    if batch.num_segments == 0 or batch.max_rank == 0:
        return
    block_r = _block(batch.max_rank, 1, MAX_BLOCK_R)
    num_n_tiles = triton.cdiv(max(p.shape[1] for p in b_pools), BGMV_BLOCK_N)
    pointers, strides = out_args
    _expand_bgmv_kernel[(batch.num_tokens, len(b_pools) * num_n_tiles)](
        y,
        *pointers,
        b_table,
        batch.token_adapter,
        batch.rows,
        rank,
        scale,
        y.stride(0),
        y.stride(1),
        *strides,
        batch.rows.stride(0),
        rank.stride(0),
        scale.stride(0),
        num_n_tiles,
        NUM_R_TILES=triton.cdiv(batch.max_rank, block_r),
        BLOCK_R=block_r,
        BLOCK_N=BGMV_BLOCK_N,
    )


# --- helpers -----------------------------------------------------------------------------


def _block(size: int, smallest: int, largest: int) -> int:
    """The power-of-two tile for ``size`` elements, clamped to [smallest, largest]."""
    return min(largest, max(smallest, triton.next_power_of_2(max(size, 1))))


def _dot_precision(dtype: torch.dtype) -> str:
    # 16-bit values are exact in tf32 (see the module doc); fp32 needs the full product.
    return "ieee" if dtype == torch.float32 else "tf32"


def _slice_table(columns: list[list[int]], device: torch.device) -> torch.Tensor:
    """``[num_slices, len(columns[0])]`` int64 on ``device``: per slice, base address etc."""
    return _device_table(tuple(map(tuple, columns)), torch.device(device))


@functools.lru_cache(maxsize=4096)
def _device_table(columns: tuple[tuple[int, ...], ...], device: torch.device) -> torch.Tensor:
    # Keyed by the table's own values, so a hit is always the right table (module doc);
    # never written after it is made.
    return torch.tensor(columns, dtype=torch.int64, device=device)


def _slice_rows(table: torch.Tensor, first_slice: int, count: int) -> torch.Tensor:
    if first_slice < 0 or first_slice + count > table.shape[0]:
        raise ValueError(
            f"slices {first_slice}..{first_slice + count} outside the batch's {table.shape[0]}"
        )
    return table[first_slice : first_slice + count]


def _check_rows_contiguous(name: str, tensor: torch.Tensor, like: torch.Tensor) -> None:
    if tensor.dim() != 2 or tensor.stride(1) != 1:
        raise ValueError(f"{name} must be 2-D with unit column stride")
    if tensor.dtype != like.dtype or tensor.device != like.device:
        raise ValueError(f"{name} must have the activations' dtype and device")


def _shrink_setup(
    x: torch.Tensor, a_pools: Sequence[torch.Tensor], batch: LoRABatch, first_slice: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_rows_contiguous("x", x, x)
    if x.shape[0] != batch.num_tokens:
        raise ValueError(f"x has {x.shape[0]} tokens, the batch {batch.num_tokens}")
    for s, pool in enumerate(a_pools):
        _check_rows_contiguous(f"a_pools[{s}]", pool, x)
        if pool.shape[1] != x.shape[1]:
            raise ValueError(f"a_pools[{s}] has {pool.shape[1]} columns, x {x.shape[1]}")
    rank = _slice_rows(batch.rank, first_slice, len(a_pools))
    y = x.new_zeros(len(a_pools), x.shape[0], batch.max_rank)
    a_table = _slice_table([[p.data_ptr(), p.stride(0)] for p in a_pools], x.device)
    return y, a_table, rank


# A projection group has at most this many slices (q, k, v): each has its own output
# pointer argument, so tables cached by content never hold a step's activations.
MAX_SLICES = 3


def slice_views(
    out: torch.Tensor, b_pools: Sequence[torch.Tensor], slice_offsets: Sequence[int]
) -> list[torch.Tensor]:
    """Slice s's columns ``out[:, off_s : off_s + n_s]``, checked to lie inside ``out``."""
    if len(slice_offsets) != len(b_pools):
        raise ValueError("one slice offset per B pool expected")
    views = []
    for s, (pool, offset) in enumerate(zip(b_pools, slice_offsets, strict=True)):
        if not 0 <= offset <= out.shape[1] - pool.shape[1]:
            raise ValueError(f"slice {s} (columns {offset}+{pool.shape[1]}) outside out")
        views.append(out[:, offset : offset + pool.shape[1]])
    return views


def out_arguments(
    outs: Sequence[torch.Tensor], b_pools: Sequence[torch.Tensor], num_tokens: int
) -> tuple[list[torch.Tensor], list[int]]:
    """The kernels' three output pointers and row strides (unused slots repeat slice 0's),
    after checking each ``outs[s]`` is ``[num_tokens, n_s]`` with unit column stride."""
    if not 1 <= len(outs) <= MAX_SLICES or len(outs) != len(b_pools):
        raise ValueError(f"one output per B pool expected, 1 to {MAX_SLICES} of them")
    for s, (out, pool) in enumerate(zip(outs, b_pools, strict=True)):
        _check_rows_contiguous(f"outs[{s}]", out, outs[0])
        if tuple(out.shape) != (num_tokens, pool.shape[1]):
            raise ValueError(
                f"outs[{s}] must be {num_tokens} × {pool.shape[1]}, got {tuple(out.shape)}"
            )
    padded = [*outs, *[outs[0]] * (MAX_SLICES - len(outs))]
    return padded, [out.stride(0) for out in padded]


def _expand_setup(
    outs: Sequence[torch.Tensor],
    y: torch.Tensor,
    b_pools: Sequence[torch.Tensor],
    batch: LoRABatch,
    first_slice: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[list[torch.Tensor], list[int]]]:
    out_args = out_arguments(outs, b_pools, batch.num_tokens)
    out = outs[0]
    expected = (len(b_pools), batch.num_tokens)
    if y.dim() != 3 or tuple(y.shape[:2]) != expected or y.shape[2] < batch.max_rank:
        raise ValueError(f"y must be {expected} × ≥{batch.max_rank}, got {tuple(y.shape)}")
    if y.stride(2) != 1 or y.dtype != out.dtype or y.device != out.device:
        raise ValueError("y must have unit rank stride and out's dtype and device")
    for s, pool in enumerate(b_pools):
        _check_rows_contiguous(f"b_pools[{s}]", pool, out)
    rank = _slice_rows(batch.rank, first_slice, len(b_pools))
    scale = _slice_rows(batch.scale, first_slice, len(b_pools))
    b_table = _slice_table([[p.data_ptr(), p.stride(0), p.shape[1]] for p in b_pools], out.device)
    return b_table, rank, scale, out_args
