"""LoRA over the adapter pool in torch, shaped for a CPU: few ops per layer, whatever the
number of adapters.

Same semantics as the references of :mod:`loramux.kernels.lora` (they are the
definition). For the slices s of a projection group (q/k/v, gate/up, or one module), a
token t using adapter a with rank r_s and scaling c_s in slice s:

    out_s[t] += c_s * ((x[t] @ A_s[rows_a[:r_s]]^T) @ B_s[rows_a[:r_s]])

The step's adapters' rows are first copied into dense stacks (:func:`stack_weights`),
adapter i at index i, every adapter padded to the widest rank R with zero rows:

    A^T[i] = [A_s[rows_i]^T for s]     [in, S * R], zero past r_{s,i} in slice s's columns
    C_s[i] = c_{s,i} B_s[rows_i]       [R, out_s], zero past r_{s,i}

(the scaling folded into C: ``c (y B)`` and ``y (c B)`` differ only in rounding). The
engine's torch backend keeps the stacks for as long as the same adapters run together
(``loramux.engine.lora.torch_backend``), so the copy is made once for many steps. Then:

* **Short segments** (decodes: one or a few tokens per adapter), :func:`lora_stacked`: per
  group one batched matmul for the shrink of every slice and one per slice for the expand:

      X[i, j]      = x[token j of adapter i]        (zeros where adapter i has fewer)
      Y            = bmm(X, A^T)                    [n, m, S * R]
      out_s[t]    += bmm(Y[:, :, s-th R columns], C_s)[i, j]   for the (i, j) holding t

* **Long segments** (prefill chunks), :func:`lora_segments`: one matmul for the group's
  shrink and one per slice for the expand, per segment, on adapter i's stacks: padding
  every adapter to the longest chunk would cost more than the extra ops.

The zero rows past each rank add exact zeros. Padding slots of X are zeros and their
outputs are never added anywhere, so an adapter whose weights are not finite touches only
its own tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StackedWeights:
    """Adapters' weights for one layer and group, stacked for ``bmm`` (zeros past ranks)."""

    # [n, in, S * R]: A^T, slice s of adapter i at columns [s * R, s * R + r_{s,i}) (stored
    # transposed: bmm streams a contiguous right operand faster, ~20 vs ~15 GB/s here)
    a_t: torch.Tensor
    b: tuple[torch.Tensor, ...]  # per slice [n, R, out_s]: c_{s,i} B_s[rows_i], zero past r_{s,i}
    rank_width: int  # R

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a_t, *self.b))


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
    for a_pool, b_pool, slice_ranks, slice_scales in zip(
        a_pools, b_pools, ranks, scales, strict=True
    ):
        rank = torch.tensor(list(slice_ranks), dtype=torch.long, device=device)
        scale = torch.tensor(list(slice_scales), dtype=b_pool.dtype, device=device)
        keep = offsets[None, :] < rank[:, None]  # [n, R]
        # Rows past an adapter's rank may be another adapter's: read row 0 there, then zero.
        index = torch.where(keep, starts[:, None] + offsets[None, :], 0)
        a_stacks.append(torch.where(keep[..., None], a_pool[index], 0))  # [n, R, in]
        scaled = b_pool[index] * scale[:, None, None]
        b_stacks.append(torch.where(keep[..., None], scaled, 0))  # [n, R, out_s]
    return StackedWeights(
        a_t=torch.cat(a_stacks, dim=1).transpose(1, 2).contiguous(),
        b=tuple(b.contiguous() for b in b_stacks),
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
    # (lo, hi) when slot i * m + j is token lo + i * m + j (every slot filled, tokens in
    # order: the usual decode step): X is a view of x and the outputs add to out[lo:hi].
    contiguous: tuple[int, int] | None = None

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
        first = tokens[0] if tokens else 0
        in_order = all_filled and tokens == list(range(first, first + len(tokens)))
        long = {"dtype": torch.long, "device": device}
        return cls(
            num_adapters=len(token_rows),
            slots=slots,
            gather=torch.tensor(gather, **long),
            tokens=torch.tensor(tokens, **long),
            filled=None if all_filled else torch.tensor(filled, **long),
            contiguous=(first, first + len(tokens)) if in_order else None,
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
    if tokens.contiguous is not None:
        lo, hi = tokens.contiguous
        xs = x[lo:hi].reshape(n, m, x.shape[1])
    elif tokens.filled is None:  # no padding slot: no zero row needed
        xs = x.index_select(0, tokens.gather).view(n, m, x.shape[1])
    else:
        padded = torch.cat([x, x.new_zeros(1, x.shape[1])])  # row T: the padding slots' zeros
        xs = padded.index_select(0, tokens.gather).view(n, m, x.shape[1])
    y = torch.bmm(xs, weights.a_t)  # [n, m, S * R]
    for y_s, b_s, out in zip(y.split(width, dim=2), weights.b, outs, strict=True):
        if tokens.contiguous is not None and out.is_contiguous():
            out[lo:hi].view(n, m, out.shape[1]).baddbmm_(y_s, b_s)  # += y_s @ b_s, in place
            continue
        delta = torch.bmm(y_s, b_s).view(n * m, out.shape[1])
        if tokens.filled is not None:
            delta = delta.index_select(0, tokens.filled)
        out.index_add_(0, tokens.tokens, delta)


def lora_segments(
    x: torch.Tensor,  # [T, in]
    outs: Sequence[torch.Tensor],  # per slice [T, out_s], updated in place
    weights: StackedWeights,
    segments: Sequence[tuple[int, int, int]],  # (start, end, adapter index in the stacks)
) -> None:
    """``out_s[start:end] += (x[start:end] @ A^T[i])[:, s-th R columns] @ C_s[i]``."""
    width = weights.rank_width
    for start, end, i in segments:
        y = x[start:end] @ weights.a_t[i]  # [n, S * R]
        for y_s, b_s, out in zip(y.split(width, dim=1), weights.b, outs, strict=True):
            out[start:end].addmm_(y_s, b_s[i])
