"""Batched LoRA over a paged adapter-weight pool (S-LoRA / Punica style): the definition.

Each target module keeps two pools per layer, indexed by *rank rows*: ``a_pool[R, in]``
holds rows of A (``A_a[i, :]``) and ``b_pool[R, out]`` rows of B transposed (``B_a[:, i]``).
An adapter of rank r owns r rows (no padding to a maximum rank).

The ops work on the slices of a fused projection at once (q/k/v: 3, gate/up: 2, others:
1), with the step's metadata in one ``LoRABatch`` (``loramux.kernels.lora_batch``) shared
by all layers and modules. For slice s, token t with adapter a, r = rank[s, a],
c = scale[s, a]:

    shrink:  y[s, t, :r]                  = x[t] @ A_s[rows[a, :r]]^T
    expand:  out[t, off_s : off_s + n_s] += c * (y[s, t, :r] @ B_s[rows[a, :r]])

which is PEFT's ``base(x) + lora_B(lora_A(x)) * scaling`` with ``A_a = a_pool[rows_a]``
and ``B_a = b_pool[rows_a]^T``. Tokens with no adapter are untouched.

The references below are the definition, one matmul per (slice, segment). The
implementations the engine runs are the Triton SGMV/BGMV kernels
(``loramux.kernels.lora_triton``), the CPU's native op (``loramux.kernels.lora_native``)
and the torch ones of ``loramux.kernels.lora_torch``;
the gather-bmm pair here is the classic torch baseline the GPU benchmark compares with.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loramux.kernels.lora_batch import LoRABatch

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
