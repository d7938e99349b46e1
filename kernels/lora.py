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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
