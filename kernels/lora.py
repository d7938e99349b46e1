"""Batched LoRA over a paged adapter-weight pool (S-LoRA / Punica style).

Tokens arrive grouped in segments, one adapter slot per segment (or none). Each
module keeps two pools per layer, indexed by *rank rows*: ``a_pool[R, in]`` holds
rows of A (``A_a[i, :]``) and ``b_pool[R, out]`` holds rows of B transposed
(``B_a[:, i]``). An adapter of rank r owns r rows, named by ``rows_a`` (any r
distinct row indices: no padding to a maximum rank, and rows need not be contiguous).

Semantics, for every segment ``[s, e)`` with adapter a (rank r, scale c):

    shrink:  y[t, :r]    = x[t] @ a_pool[rows_a]^T                 t in [s, e)
    expand:  out[t, :]  += c * (y[t, :r] @ b_pool[rows_a])

which is PEFT's ``base(x) + lora_B(lora_A(x)) * scaling`` with ``A_a = a_pool[rows_a]``
and ``B_a = b_pool[rows_a]^T``. Tokens in segments with no adapter are untouched.

The multi-slice ops (``lora_shrink_slices`` / ``lora_expand_slices``) do the same for
the slices of a fused projection at once (q/k/v: 3, gate/up: 2, others: 1), with the
step's metadata in one ``LoRABatch`` (``loramux.kernels.lora_batch``) shared by all
layers and modules. For slice s, token t with adapter a, r = rank[s, a], c = scale[s, a]:

    shrink:  y[s, t, :r]                  = x[t] @ A_s[rows[a, :r]]^T
    expand:  out[t, off_s : off_s + n_s] += c * (y[s, t, :r] @ B_s[rows[a, :r]])

On CUDA they run the Triton SGMV (prefill) or BGMV (decode) kernels of
``loramux.kernels.lora_triton``; elsewhere the references below.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loramux.kernels.dispatch import use_triton
from loramux.kernels.lora_batch import LoRABatch


@dataclass(frozen=True)
class LoRASegment:
    start: int  # first token of the segment in the batch
    end: int  # one past its last token
    rows: torch.Tensor  # [r] int64 row indices into the pools
    rank: int
    scale: float
    contiguous_start: int | None  # rows are start..start+r: slice instead of gather


def _pool_rows(pool: torch.Tensor, segment: LoRASegment) -> torch.Tensor:
    if segment.contiguous_start is not None:
        return pool[segment.contiguous_start : segment.contiguous_start + segment.rank]
    return pool.index_select(0, segment.rows)


def lora_shrink_reference(
    x: torch.Tensor,  # [T, in]
    a_pool: torch.Tensor,  # [R, in]
    segments: list[LoRASegment],
    max_rank: int,
) -> torch.Tensor:
    """y: [T, max_rank]; columns past a segment's rank (and untouched tokens) are 0."""
    y = x.new_zeros(x.shape[0], max_rank)
    for seg in segments:
        y[seg.start : seg.end, : seg.rank] = x[seg.start : seg.end] @ _pool_rows(a_pool, seg).T
    return y


def lora_expand_reference(
    out: torch.Tensor,  # [T, out], updated in place
    y: torch.Tensor,  # [T, max_rank]
    b_pool: torch.Tensor,  # [R, out]
    segments: list[LoRASegment],
) -> None:
    for seg in segments:
        delta = y[seg.start : seg.end, : seg.rank] @ _pool_rows(b_pool, seg)
        out[seg.start : seg.end] += delta * seg.scale


def lora_shrink(x, a_pool, segments, max_rank):
    """Public op (reference only for now; the Triton SGMV/BGMV kernels join behind it)."""
    return lora_shrink_reference(x, a_pool, segments, max_rank)


def lora_expand(out, y, b_pool, segments):
    """Public op (reference only for now; the Triton SGMV/BGMV kernels join behind it)."""
    lora_expand_reference(out, y, b_pool, segments)


@dataclass(frozen=True)
class LoRADenseBatch:
    """The same batch as a row mask over one span of pool rows (built once per step).

    When the step's adapters all sit in a short span of pool rows, computing every
    token against every row of the span and masking costs a few large ops instead of
    several small ops per segment, which is what a CPU wants:

        y = (x @ a_pool[s:e]^T) * mask          mask[t, r] = 1 iff row s+r is t's adapter's
        out += (y @ b_pool[s:e]) * scale[t]      scale[t] = c of t's adapter (0 if none)

    Masked-out rows contribute exact zeros, so this equals the segment form.
    """

    row_start: int
    row_end: int
    mask: torch.Tensor  # [T, row_end - row_start], 0/1 in the compute dtype
    scale: torch.Tensor  # [T, 1] per-token scale, 0 for tokens without this module's adapter


def lora_dense_reference(
    x: torch.Tensor,  # [T, in]
    out: torch.Tensor,  # [T, out], updated in place
    a_pool: torch.Tensor,  # [R, in]
    b_pool: torch.Tensor,  # [R, out]
    batch: LoRADenseBatch,
) -> None:
    rows = slice(batch.row_start, batch.row_end)
    y = (x @ a_pool[rows].T) * batch.mask
    out += (y @ b_pool[rows]) * batch.scale


def lora_dense(x, out, a_pool, b_pool, batch):
    """Public op for the masked-dense form (reference; CPU path)."""
    lora_dense_reference(x, out, a_pool, b_pool, batch)


# --- multi-slice ops over a LoRABatch ---------------------------------------------------


def _host_segments(batch: LoRABatch) -> list[tuple[int, int, int]]:
    """(start, end, adapter) per segment with an adapter, read back to the host (references
    only; a ``per_token`` batch has segments of adapter -1, which are skipped)."""
    starts, lengths = batch.seg_start.tolist(), batch.seg_len.tolist()
    adapters = batch.seg_adapter.tolist()
    return [(s, s + n, a) for s, n, a in zip(starts, lengths, adapters, strict=True) if a >= 0]


def lora_shrink_slices_reference(
    x: torch.Tensor,  # [T, in]
    a_pools: Sequence[torch.Tensor],  # per slice [R, in]
    batch: LoRABatch,
    *,
    first_slice: int = 0,
) -> torch.Tensor:
    """y: [len(a_pools), T, max_rank] in x's dtype, one matmul per (slice, segment).

    ``y[s, t, :r] = x[t] @ A_s[rows[a, :r]]^T`` with a = t's adapter and
    r = ``batch.rank[first_slice + s, a]``; every other entry is 0.
    """
    y = x.new_zeros(len(a_pools), x.shape[0], batch.max_rank)
    ranks = batch.rank[first_slice : first_slice + len(a_pools)].tolist()
    rows = batch.rows.long()
    for s, pool in enumerate(a_pools):
        for start, end, a in _host_segments(batch):
            r = ranks[s][a]
            if r:
                y[s, start:end, :r] = x[start:end] @ pool.index_select(0, rows[a, :r]).T
    return y


def lora_expand_slices_reference(
    out: torch.Tensor,  # [T, out_features], updated in place
    y: torch.Tensor,  # [len(b_pools), T, ≥ max_rank]
    b_pools: Sequence[torch.Tensor],  # per slice [R, n_s]
    slice_offsets: Sequence[int],  # off_s: first column of slice s in out
    batch: LoRABatch,
    *,
    first_slice: int = 0,
) -> None:
    """``out[t, off_s : off_s + n_s] += c * (y[s, t, :r] @ B_s[rows[a, :r]])`` per slice.

    a = t's adapter, r and c its rank and scale in slice ``first_slice + s``. Tokens with
    no adapter, slices with r = 0, and y's columns past r are not read.
    """
    ranks = batch.rank[first_slice : first_slice + len(b_pools)].tolist()
    scales = batch.scale[first_slice : first_slice + len(b_pools)].tolist()
    rows = batch.rows.long()
    for s, (pool, offset) in enumerate(zip(b_pools, slice_offsets, strict=True)):
        for start, end, a in _host_segments(batch):
            r = ranks[s][a]
            if r:
                delta = y[s, start:end, :r] @ pool.index_select(0, rows[a, :r])
                out[start:end, offset : offset + pool.shape[1]] += delta * scales[s][a]


def _token_table(
    batch: LoRABatch, first_slice: int, s: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token: its adapter's rows ``[T, max_rank]``, which of them count, and its scale."""
    adapter = batch.token_adapter.long()
    has_adapter = adapter >= 0
    index = adapter.clamp(min=0)  # tokens without an adapter gather adapter 0, then mask
    rank = batch.rank[first_slice + s].long()[index]  # [T]
    columns = torch.arange(batch.max_rank, device=adapter.device)
    keep = has_adapter[:, None] & (columns[None, :] < rank[:, None])  # [T, max_rank]
    scale = torch.where(has_adapter, batch.scale[first_slice + s][index], 0.0)  # [T]
    return batch.rows.long()[index], keep, scale


def lora_shrink_slices_gather_bmm(
    x: torch.Tensor,
    a_pools: Sequence[torch.Tensor],
    batch: LoRABatch,
    *,
    first_slice: int = 0,
) -> torch.Tensor:
    """Same result as ``lora_shrink_slices_reference``, as the classic torch baseline.

    Per slice, gather every token's adapter rows ``W[t] = A_s[rows[a_t]]`` ([T, max_rank,
    in], padded to max_rank) and ``y[s] = bmm(W, x[:, :, None])``, masked past each rank.
    Padded rows are real pool rows (finite), so masking the product suffices.
    """
    y = x.new_zeros(len(a_pools), x.shape[0], batch.max_rank)
    for s, pool in enumerate(a_pools):
        rows, keep, _ = _token_table(batch, first_slice, s)
        product = torch.bmm(pool[rows], x[:, :, None]).squeeze(-1)  # [T, max_rank]
        y[s] = torch.where(keep, product, 0)
    return y


def lora_expand_slices_gather_bmm(
    out: torch.Tensor,
    y: torch.Tensor,
    b_pools: Sequence[torch.Tensor],
    slice_offsets: Sequence[int],
    batch: LoRABatch,
    *,
    first_slice: int = 0,
) -> None:
    """Same result as ``lora_expand_slices_reference``, as the classic torch baseline.

    ``delta[t] = y[s, t, :max_rank] (masked past t's rank) @ B_s[rows[a_t]]`` by one bmm
    over ``[T, max_rank, n_s]`` gathered rows, then ``out[t, off_s:] += c_t * delta[t]``
    (c_t = 0 for tokens without an adapter).
    """
    for s, (pool, offset) in enumerate(zip(b_pools, slice_offsets, strict=True)):
        rows, keep, scale = _token_table(batch, first_slice, s)
        ys = torch.where(keep, y[s, :, : batch.max_rank], 0)  # never read past the rank
        delta = torch.bmm(ys[:, None, :], pool[rows]).squeeze(1)  # [T, n_s]
        out[:, offset : offset + pool.shape[1]] += delta * scale.to(out.dtype)[:, None]


def lora_shrink_slices(
    x: torch.Tensor,
    a_pools: Sequence[torch.Tensor],
    batch: LoRABatch,
    *,
    first_slice: int = 0,
) -> torch.Tensor:
    """Public op: ``y[s, t, :r] = x[t] @ A_s[rows[a, :r]]^T`` for all slices at once.

    ``x [T, in]``, ``a_pools[s] [R, in]``; returns ``y [len(a_pools), T, max_rank]`` in x's
    dtype, zero past each rank and for tokens without an adapter. Slice s reads
    ``batch.rank[first_slice + s]``. CUDA: Triton BGMV when ``batch.is_decode``, else
    SGMV (fp32 accumulation); elsewhere ``lora_shrink_slices_reference``.
    """
    if use_triton(x):
        from loramux.kernels import lora_triton  # triton only where a Triton path runs

        kernel = lora_triton.lora_shrink_bgmv if batch.is_decode else lora_triton.lora_shrink_sgmv
        return kernel(x, a_pools, batch, first_slice=first_slice)
    return lora_shrink_slices_reference(x, a_pools, batch, first_slice=first_slice)


def lora_expand_slices(
    out: torch.Tensor,
    y: torch.Tensor,
    b_pools: Sequence[torch.Tensor],
    slice_offsets: Sequence[int],
    batch: LoRABatch,
    *,
    first_slice: int = 0,
) -> None:
    """Public op: ``out[t, off_s : off_s + n_s] += c * (y[s, t, :r] @ B_s[rows[a, :r]])``.

    In place on ``out [T, out_features]``, for every slice s (``b_pools[s] [R, n_s]``,
    ``slice_offsets[s] = off_s``) with c, r = ``batch.scale/rank[first_slice + s, a]``.
    Reads only ``y[s, t, :r]``. CUDA: Triton BGMV when ``batch.is_decode``, else SGMV
    (fp32 accumulation, one rounding of the sum); elsewhere the reference.
    """
    if use_triton(out):
        from loramux.kernels import lora_triton

        kernel = lora_triton.lora_expand_bgmv if batch.is_decode else lora_triton.lora_expand_sgmv
        kernel(out, y, b_pools, slice_offsets, batch, first_slice=first_slice)
        return
    lora_expand_slices_reference(out, y, b_pools, slice_offsets, batch, first_slice=first_slice)
