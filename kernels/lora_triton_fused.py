"""Fused LoRA: shrink and expand of a projection group's slices in one Triton launch.

The same maths as ``loramux.kernels.lora`` (whose references define it), for token t
with adapter a, slice s of rank r = rank[s, a], scale c = scale[s, a], rows ρ = rows[a, :r]:

    y_s[t]                        = round(x[t] @ A_s[ρ]^T)        (r values, x's dtype)
    out_s[t, :]                  += c · (y_s[t] @ B_s[ρ])

computed by one program per (token or segment tile, slice, column split): it reduces
``x[t] @ A_s[ρ]^T`` over ``in`` into registers, rounds it to x's dtype exactly as the
two-launch path stores its intermediate ``y`` (so the results are the same), and adds
``c · y_s @ B_s[ρ]`` into its share of slice s's columns. Nothing is written between the
two halves: a decode step's LoRA is one launch per projection group (q/k/v, o, gate/up,
down), where the two-launch path makes a shrink, an expand and the intermediate's
allocation.

The output columns of each slice are split across programs (``FusedTiles``) so that a
small batch still fills the device; each split recomputes its token's shrink, rereading
``A_s[ρ]`` (``r × in`` values, from L2 after the first). The rank is one tile
(``block_r`` ≥ the step's largest rank), so the intermediate never leaves the program;
``block_k`` and ``block_n`` shrink for large ranks (``FusedTiles.rank_budget``).

Two forms:

* per token (``lora_fused_bgmv``): every segment is one token (decode; the CUDA-graph
  path's batches); dot products are broadcast multiplies and ``tl.sum``.
* per segment tile (``lora_fused_sgmv``): runs of tokens with one adapter (one adapter
  decoding for many sequences, small prefill chunks), ``block_m`` tokens a tile with
  ``tl.dot``, so a tile reads its adapter's rows once.

The interpreter habits of ``lora_triton`` hold here too (fp32 tiles, ``_round_to``,
constexpr loop bounds).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from loramux.kernels.lora_batch import LoRABatch
from loramux.kernels.lora_tiles import FusedTiles
from loramux.kernels.lora_triton import (
    _block,
    _check_rows_contiguous,
    _dot_precision,
    _round_to,
    _slice_out,
    _slice_rows,
    _slice_table,
    out_arguments,
)


@triton.jit(do_not_specialize=["stride_o0", "stride_o1", "stride_o2"])
def _fused_bgmv_kernel(
    x_ptr,  # [T, in]
    out0_ptr,  # slice s's output [T, n_s] (s = 0, 1, 2), updated in place
    out1_ptr,
    out2_ptr,
    table_ptr,  # [num_slices, 5] int64: (A_s base, A_s row stride, B_s base, its stride, n_s)
    token_adapter_ptr,
    rows_ptr,  # [A, max_rank]
    rank_ptr,  # [num_slices, A] (already offset to the op's first slice)
    scale_ptr,
    stride_xt,
    stride_o0,
    stride_o1,
    stride_o2,
    stride_rows,
    stride_rank,
    stride_scale,
    num_splits,
    IN_FEATURES: tl.constexpr,
    TILES_PER_SPLIT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    token = tl.program_id(0)
    slice_id = tl.program_id(1) // num_splits
    n_first = (tl.program_id(1) % num_splits) * (TILES_PER_SPLIT * BLOCK_N)
    adapter = tl.load(token_adapter_ptr + token)
    if adapter < 0:  # no adapter: out unchanged
        return
    rank = tl.load(rank_ptr + slice_id * stride_rank + adapter)
    width = tl.load(table_ptr + slice_id * 5 + 4)
    if rank == 0 or n_first >= width:  # slice not targeted, or a split past its columns
        return
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    rows = tl.load(rows_ptr + adapter * stride_rows + offs_r, mask=r_mask, other=0).to(tl.int64)

    # Shrink: partial products per (i, k) lane, reduced over k once at the end.
    a_base = tl.load(table_ptr + slice_id * 5).to(tl.pointer_type(x_ptr.dtype.element_ty))
    a_stride = tl.load(table_ptr + slice_id * 5 + 1)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token.to(tl.int64) * stride_xt + offs_k  # [K]
    a_ptrs = a_base + rows[:, None] * a_stride + offs_k[None, :]  # [R, K]: A_s[ρ]
    acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, IN_FEATURES, BLOCK_K):
        k_mask = offs_k < IN_FEATURES - k0
        x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_ptrs, mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += a * x[None, :]  # acc[i, k] += A_s[ρ_i, k] · x[t, k]
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    # y[i] = Σ_k A_s[ρ_i, k] · x[t, k], rounded as the two-launch path stores it (0 past r).
    y = _round_to(tl.sum(acc, axis=1), x_ptr.dtype.element_ty).to(tl.float32)

    # Expand into this split's columns.
    b_base = tl.load(table_ptr + slice_id * 5 + 2).to(tl.pointer_type(x_ptr.dtype.element_ty))
    b_stride = tl.load(table_ptr + slice_id * 5 + 3)
    scale = tl.load(scale_ptr + slice_id * stride_scale + adapter)
    out_base, stride_o = _slice_out(
        slice_id, out0_ptr, out1_ptr, out2_ptr, stride_o0, stride_o1, stride_o2
    )
    out_row = out_base + token.to(tl.int64) * stride_o
    offs_n = tl.arange(0, BLOCK_N)
    for tile in range(TILES_PER_SPLIT):  # tiles past the slice's width load nothing
        n0 = n_first + tile * BLOCK_N
        n_mask = offs_n < width - n0
        b_ptrs = b_base + rows[:, None] * b_stride + n0 + offs_n[None, :]  # [R, N]
        b = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
        delta = tl.sum(y[:, None] * b, axis=0)  # delta[j] = Σ_i y[i] · B_s[ρ_i, n0 + j]
        out_ptrs = out_row + n0 + offs_n
        # One rounding of out + c·delta, both in fp32.
        result = tl.load(out_ptrs, mask=n_mask, other=0.0).to(tl.float32) + scale * delta
        tl.store(out_ptrs, _round_to(result, out0_ptr.dtype.element_ty), mask=n_mask)


@triton.jit(do_not_specialize=["stride_o0", "stride_o1", "stride_o2"])
def _fused_sgmv_kernel(
    x_ptr,  # [T, in]
    out0_ptr,
    out1_ptr,
    out2_ptr,
    table_ptr,  # [num_slices, 5] int64, as in _fused_bgmv_kernel
    seg_start_ptr,
    seg_len_ptr,
    seg_adapter_ptr,
    rows_ptr,
    rank_ptr,
    scale_ptr,
    stride_xt,
    stride_o0,
    stride_o1,
    stride_o2,
    stride_rows,
    stride_rank,
    stride_scale,
    num_splits,
    IN_FEATURES: tl.constexpr,
    TILES_PER_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seg = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    slice_id = tl.program_id(2) // num_splits
    n_first = (tl.program_id(2) % num_splits) * (TILES_PER_SPLIT * BLOCK_N)
    adapter = tl.load(seg_adapter_ptr + seg)
    seg_len = tl.load(seg_len_ptr + seg)
    if adapter < 0 or m0 >= seg_len:  # a per-token batch's token without adapter, or past
        return
    rank = tl.load(rank_ptr + slice_id * stride_rank + adapter)
    width = tl.load(table_ptr + slice_id * 5 + 4)
    if rank == 0 or n_first >= width:
        return
    tokens = (tl.load(seg_start_ptr + seg) + m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    token_mask = m0 + tl.arange(0, BLOCK_M) < seg_len
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    rows = tl.load(rows_ptr + adapter * stride_rows + offs_r, mask=r_mask, other=0).to(tl.int64)

    # Shrink: acc[m, i] = Σ_k x[t_m, k] · A_s[ρ_i, k], one tile of the segment's tokens.
    a_base = tl.load(table_ptr + slice_id * 5).to(tl.pointer_type(x_ptr.dtype.element_ty))
    a_stride = tl.load(table_ptr + slice_id * 5 + 1)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :]  # [M, K]
    a_ptrs = a_base + rows[None, :] * a_stride + offs_k[:, None]  # [K, R]: A_s[ρ]^T
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, IN_FEATURES, BLOCK_K):
        k_mask = offs_k < IN_FEATURES - k0
        x = tl.load(x_ptrs, mask=token_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    y = _round_to(acc, x_ptr.dtype.element_ty).to(tl.float32)  # [M, R], 0 past r

    # Expand: out_s[t_m, n0 + j] += c · Σ_i y[m, i] · B_s[ρ_i, n0 + j].
    b_base = tl.load(table_ptr + slice_id * 5 + 2).to(tl.pointer_type(x_ptr.dtype.element_ty))
    b_stride = tl.load(table_ptr + slice_id * 5 + 3)
    scale = tl.load(scale_ptr + slice_id * stride_scale + adapter)
    out_base, stride_o = _slice_out(
        slice_id, out0_ptr, out1_ptr, out2_ptr, stride_o0, stride_o1, stride_o2
    )
    offs_n = tl.arange(0, BLOCK_N)
    for tile in range(TILES_PER_SPLIT):
        n0 = n_first + tile * BLOCK_N
        n_mask = offs_n < width - n0
        b_ptrs = b_base + rows[:, None] * b_stride + n0 + offs_n[None, :]  # [R, N]
        b = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        delta = tl.dot(y, b.to(tl.float32), input_precision=DOT_PRECISION)  # [M, N]
        out_ptrs = out_base + tokens[:, None] * stride_o + n0 + offs_n[None, :]
        out_mask = token_mask[:, None] & n_mask[None, :]
        result = tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32) + scale * delta
        tl.store(out_ptrs, _round_to(result, out0_ptr.dtype.element_ty), mask=out_mask)


# --- launchers ---------------------------------------------------------------------------


def lora_fused_bgmv(
    x: torch.Tensor,  # [T, in]
    outs: Sequence[torch.Tensor],  # per slice [T, n_s], updated in place
    a_pools: Sequence[torch.Tensor],  # per slice [R, in]
    b_pools: Sequence[torch.Tensor],  # per slice [R, n_s]
    batch: LoRABatch,
    tiles: FusedTiles,
    *,
    first_slice: int = 0,
) -> int:
    """Shrink and expand per token in one launch (see the module doc); the launches made
    (0 when no token has an adapter)."""
    setup = _fused_setup(x, outs, a_pools, b_pools, batch, first_slice)
    if batch.num_segments == 0 or batch.max_rank == 0:
        return 0
    table, rank, scale, (pointers, strides) = setup
    block_r = triton.next_power_of_2(batch.max_rank)  # the whole rank: one tile
    shape = _split_shape(x, b_pools, tiles, block_r, batch.num_tokens * len(a_pools))
    block_k, block_n, num_splits, tiles_per_split = shape
    _fused_bgmv_kernel[(batch.num_tokens, len(a_pools) * num_splits)](
        x,
        *pointers,
        table,
        batch.token_adapter,
        batch.rows,
        rank,
        scale,
        x.stride(0),
        *strides,
        batch.rows.stride(0),
        rank.stride(0),
        scale.stride(0),
        num_splits,
        IN_FEATURES=x.shape[1],
        TILES_PER_SPLIT=tiles_per_split,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        BLOCK_N=block_n,
        num_warps=tiles.num_warps,
    )
    return 1


def lora_fused_sgmv(
    x: torch.Tensor,
    outs: Sequence[torch.Tensor],
    a_pools: Sequence[torch.Tensor],
    b_pools: Sequence[torch.Tensor],
    batch: LoRABatch,
    tiles: FusedTiles,
    *,
    first_slice: int = 0,
) -> int:
    """Shrink and expand per segment tile in one launch (see the module doc); the
    launches made."""
    setup = _fused_setup(x, outs, a_pools, b_pools, batch, first_slice)
    if batch.num_segments == 0 or batch.max_rank == 0:
        return 0
    table, rank, scale, (pointers, strides) = setup
    block_m = _block(batch.max_seg_len, 16, tiles.block_m)
    block_r = max(16, triton.next_power_of_2(batch.max_rank))  # tl.dot needs ≥ 16
    m_tiles = triton.cdiv(batch.max_seg_len, block_m)
    rows_of_grid = batch.num_segments * m_tiles * len(a_pools)
    block_k, block_n, num_splits, tiles_per_split = _split_shape(
        x, b_pools, tiles, block_r, rows_of_grid
    )
    _fused_sgmv_kernel[(batch.num_segments, m_tiles, len(a_pools) * num_splits)](
        x,
        *pointers,
        table,
        batch.seg_start,
        batch.seg_len,
        batch.seg_adapter,
        batch.rows,
        rank,
        scale,
        x.stride(0),
        *strides,
        batch.rows.stride(0),
        rank.stride(0),
        scale.stride(0),
        num_splits,
        IN_FEATURES=x.shape[1],
        TILES_PER_SPLIT=tiles_per_split,
        DOT_PRECISION=_dot_precision(x.dtype),
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        BLOCK_N=block_n,
        num_warps=tiles.num_warps,
    )
    return 1


# --- helpers -----------------------------------------------------------------------------


def _split_shape(
    x: torch.Tensor,
    b_pools: Sequence[torch.Tensor],
    tiles: FusedTiles,
    block_r: int,
    programs_per_split: int,
) -> tuple[int, int, int, int]:
    """(block_k, block_n, column splits, tiles per split) for a launch.

    ``block_k`` / ``block_n`` are the table's, no wider than the data and within the rank
    budget; the columns of the widest slice are split until the grid has about
    ``tiles.target_programs`` programs (never more splits than column tiles).
    """
    budget = max(16, tiles.rank_budget // block_r)
    block_k = min(tiles.block_k, budget, _block(x.shape[1], 16, tiles.block_k))
    widest = max(p.shape[1] for p in b_pools)
    block_n = min(tiles.block_n, budget, _block(widest, 16, tiles.block_n))
    num_n_tiles = triton.cdiv(widest, block_n)
    wanted = triton.cdiv(tiles.target_programs, max(programs_per_split, 1))
    tiles_per_split = triton.cdiv(num_n_tiles, min(max(wanted, 1), num_n_tiles))
    return block_k, block_n, triton.cdiv(num_n_tiles, tiles_per_split), tiles_per_split


def _fused_setup(
    x: torch.Tensor,
    outs: Sequence[torch.Tensor],
    a_pools: Sequence[torch.Tensor],
    b_pools: Sequence[torch.Tensor],
    batch: LoRABatch,
    first_slice: int,
):
    _check_rows_contiguous("x", x, x)
    if x.shape[0] != batch.num_tokens:
        raise ValueError(f"x has {x.shape[0]} tokens, the batch {batch.num_tokens}")
    if len(a_pools) != len(b_pools):
        raise ValueError("one A pool and one B pool per slice expected")
    for s, (a_pool, b_pool) in enumerate(zip(a_pools, b_pools, strict=True)):
        _check_rows_contiguous(f"a_pools[{s}]", a_pool, x)
        _check_rows_contiguous(f"b_pools[{s}]", b_pool, x)
        if a_pool.shape[1] != x.shape[1]:
            raise ValueError(f"a_pools[{s}] has {a_pool.shape[1]} columns, x {x.shape[1]}")
    out_args = out_arguments(outs, b_pools, batch.num_tokens)
    if outs[0].dtype != x.dtype or outs[0].device != x.device:
        raise ValueError("outs must have the activations' dtype and device")
    rank = _slice_rows(batch.rank, first_slice, len(a_pools))
    scale = _slice_rows(batch.scale, first_slice, len(a_pools))
    table = _slice_table(
        [
            [a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), b.shape[1]]
            for a, b in zip(a_pools, b_pools, strict=True)
        ],
        x.device,
    )
    return table, rank, scale, out_args
