"""LoRA over the adapter pool in torch, shaped for a CPU: few ops per layer, whatever the
number of adapters.

Same semantics as the references of :mod:`loramux.kernels.lora` (they are the
definition). For the slices s of a projection group (q/k/v, gate/up, or one module), a
token t using adapter a with rank r_s and scaling c_s in slice s:

    out_s[t] += c_s * ((x[t] @ A_s[rows_a[:r_s]]^T) @ B_s[rows_a[:r_s]])

Two forms, which the engine's torch backend picks per segment (a run of consecutive tokens
with one adapter):

* **Long segments** (prefill chunks), :func:`lora_segments`: one matmul pair per (segment,
  slice) straight from the pool. The op count grows with the segments, but each one's
  matmuls are large.
* **Short segments** (decodes, one or a few tokens per adapter), :func:`lora_stacked`: the
  adapters' rows gathered once into dense stacks (:func:`stack_weights`), then per group
  one batched matmul for the shrink of every slice and one per slice for the expand:

      X[i, j]      = x[token j of adapter i]        (zeros where adapter i has fewer)
      Y            = bmm(X, A^T)                    A[i] = [A_s[rows_i] for s], zero past r_{s,i}
      D_s          = bmm(Y[:, :, s-th R columns], B_s) * c_s
      out_s[t]    += D_s[i, j]                      for the (i, j) holding token t

  Rows past an adapter's rank are zeros in the stacks, so every adapter may be padded to
  the widest rank R and the padding adds exact zeros. A stack is a copy of the adapters'
  weights for one layer and group: the backend keeps it for as long as the same adapters
  decode together (see ``loramux.engine.lora.torch_backend``).

Padding rows of X are zeros, and their outputs are never added anywhere, so an adapter
whose weights are not finite touches only its own tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SegmentRows:
    """Tokens ``[start, end)`` use the adapter whose rank rows start at pool row ``row``."""

    start: int
    end: int
    row: int  # first pool row of the adapter (its rows are row .. row + its row count - 1)
    ranks: tuple[int, ...]  # r_s per slice of the group (0: the slice has no LoRA)
    scales: tuple[float, ...]  # c_s per slice


def lora_segments(
    x: torch.Tensor,  # [T, in]
    outs: Sequence[torch.Tensor],  # per slice [T, out_s], updated in place
    a_pools: Sequence[torch.Tensor],  # per slice [R, in]
    b_pools: Sequence[torch.Tensor],  # per slice [R, out_s]
    segments: Sequence[SegmentRows],
) -> None:
    """``out_s[start:end] += c_s * ((x[start:end] @ A_s[rows]^T) @ B_s[rows])`` per segment."""
    for seg in segments:
        xs = x[seg.start : seg.end]
        for out, a_pool, b_pool, rank, scale in zip(
            outs, a_pools, b_pools, seg.ranks, seg.scales, strict=True
        ):
            if rank:
                rows = slice(seg.row, seg.row + rank)
                y = xs @ a_pool[rows].T  # [n, r]
                out[seg.start : seg.end] += (y @ b_pool[rows]) * scale


@dataclass(frozen=True)
class StackedWeights:
    """Adapters' weights for one layer and group, stacked for ``bmm`` (zeros past ranks)."""

    a: torch.Tensor  # [n, S * R, in]: slice s of adapter i at rows [s * R, s * R + r_{s,i})
    b: tuple[torch.Tensor, ...]  # per slice [n, R, out_s]
    scale: torch.Tensor  # [S, n, 1, 1] c_{s,i}
    rank_width: int  # R

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, *self.b))


def stack_weights(
    a_pools: Sequence[torch.Tensor],  # per slice [R_pool, in]
    b_pools: Sequence[torch.Tensor],  # per slice [R_pool, out_s]
    first_rows: Sequence[int],  # adapter i's rows start at first_rows[i] (contiguous)
    ranks: Sequence[Sequence[int]],  # ranks[s][i] = r_{s,i}
    scales: Sequence[Sequence[float]],  # scales[s][i] = c_{s,i}
) -> StackedWeights:
    """Copy the adapters' rows of every slice into :class:`StackedWeights`."""
    device = a_pools[0].device
    width = max((r for slice_ranks in ranks for r in slice_ranks), default=0)
    offsets = torch.arange(width, device=device)
    starts = torch.tensor(list(first_rows), dtype=torch.long, device=device)
    a_stacks, b_stacks = [], []
    for a_pool, b_pool, slice_ranks in zip(a_pools, b_pools, ranks, strict=True):
        rank = torch.tensor(list(slice_ranks), dtype=torch.long, device=device)
        keep = offsets[None, :] < rank[:, None]  # [n, R]
        # Rows past an adapter's rank may be another adapter's: read row 0 there, then zero.
        index = torch.where(keep, starts[:, None] + offsets[None, :], 0)
        a_stacks.append(torch.where(keep[..., None], a_pool[index], 0))  # [n, R, in]
        b_stacks.append(torch.where(keep[..., None], b_pool[index], 0))  # [n, R, out_s]
    scale = torch.tensor([list(s) for s in scales], dtype=a_pools[0].dtype, device=device)
    return StackedWeights(
        a=torch.cat(a_stacks, dim=1).contiguous(),
        b=tuple(b.contiguous() for b in b_stacks),
        scale=scale[:, :, None, None],
        rank_width=width,
    )


@dataclass(frozen=True)
class StackedTokens:
    """Where the short segments' tokens sit in ``X [n, m, in]`` (adapter i, slot j)."""

    num_adapters: int  # n
    slots: int  # m, the most tokens any of the adapters has
    gather: torch.Tensor  # [n * m] int64 token row of each slot; T (a zero row) for padding
    tokens: torch.Tensor  # [V] int64 token row of each filled slot, in slot order
    filled: torch.Tensor | None  # [V] int64 positions of the filled slots; None: all are

    @classmethod
    def build(
        cls, token_rows: Sequence[Sequence[int]], num_tokens: int, device: torch.device | str
    ) -> StackedTokens:
        """``token_rows[i]``: the rows of the tokens using adapter i (T = ``num_tokens``)."""
        slots = max((len(rows) for rows in token_rows), default=0)
        gather, filled, tokens = [], [], []
        for i, rows in enumerate(token_rows):
            gather += [*rows, *[num_tokens] * (slots - len(rows))]
            filled += range(i * slots, i * slots + len(rows))
            tokens += rows
        all_filled = len(tokens) == len(gather)
        long = {"dtype": torch.long, "device": device}
        return cls(
            num_adapters=len(token_rows),
            slots=slots,
            gather=torch.tensor(gather, **long),
            tokens=torch.tensor(tokens, **long),
            filled=None if all_filled else torch.tensor(filled, **long),
        )


def lora_stacked(
    x: torch.Tensor,  # [T, in]
    outs: Sequence[torch.Tensor],  # per slice [T, out_s], updated in place
    weights: StackedWeights,
    tokens: StackedTokens,
) -> None:
    """The module docstring's stacked form: one shrink ``bmm`` for every slice of the group,
    one expand ``bmm`` per slice, scattered back with ``index_add_``."""
    n, m, width = tokens.num_adapters, tokens.slots, weights.rank_width
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])  # row T: the padding slots' zeros
    xs = padded.index_select(0, tokens.gather).view(n, m, x.shape[1])
    y = torch.bmm(xs, weights.a.transpose(1, 2))  # [n, m, S * R]
    for s, out in enumerate(outs):
        delta = torch.bmm(y[:, :, s * width : (s + 1) * width], weights.b[s]) * weights.scale[s]
        delta = delta.view(n * m, out.shape[1])
        if tokens.filled is not None:
            delta = delta.index_select(0, tokens.filled)
        out.index_add_(0, tokens.tokens, delta)
