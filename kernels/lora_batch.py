"""Per-step LoRA metadata for the multi-slice ops, built once per step on the device.

One ``LoRABatch`` serves every layer and every target module of a step: it names, for
each token, the adapter it uses, and for each adapter its pool rows and, per *slice*,
its rank and scale. A slice is one target module's output block: a fused q/k/v
projection is three slices, gate/up two, o and down one each. The table may hold all
of a model's target modules; an op on a fused projection reads the contiguous run of
slices ``first_slice .. first_slice + len(pools)`` (see ``loramux.kernels.lora``).

Two views of the same token → adapter map:

* SGMV (prefill): segments, maximal runs of consecutive tokens with the same adapter:
  ``seg_adapter[g]`` for tokens ``seg_start[g] .. seg_start[g] + seg_len[g] - 1``.
  Adjacent spans with the same adapter are merged (a kernel tile then reads that
  adapter's weights once for all of them). Tokens with no adapter are in no segment,
  except in a ``per_token`` batch (fixed buffers for CUDA graphs): one segment per token,
  ``seg_adapter[g] = -1`` where the token has none.
* BGMV (decode): ``token_adapter[t]`` = t's adapter, or -1.

Adapter table, for adapter a (an index into the step's table, not an adapter id):

    rows[a, i]     = pool row of a's i-th rank row, the same row in every pool
    rank[s, a]     = r_{s,a}, a's rank in slice s (0: a does not target that module)
    scale[s, a]    = c_{s,a}, a's LoRA scaling in slice s

Only ``rows[a, :r_{s,a}]`` is ever read: the table is ``max_rank`` wide (the largest
rank in any slice), rows an adapter owns beyond that are left out, and entries past an
adapter's row count are 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRABatch:
    num_tokens: int
    # SGMV view
    seg_start: torch.Tensor  # [S] int32, first token of segment g
    seg_len: torch.Tensor  # [S] int32, its token count (≥ 1)
    seg_adapter: torch.Tensor  # [S] int32, its adapter (index into the table below)
    max_seg_len: int  # max(seg_len), 0 without segments
    # BGMV view
    token_adapter: torch.Tensor  # [T] int32, adapter index or -1
    # adapter table
    rows: torch.Tensor  # [A, max_rank] int32, pool rows of each adapter
    rank: torch.Tensor  # [num_slices, A] int32
    scale: torch.Tensor  # [num_slices, A] float32
    max_rank: int  # max(rank), the width of the shrink output

    @property
    def num_slices(self) -> int:
        return self.rank.shape[0]

    @property
    def num_segments(self) -> int:
        return self.seg_start.shape[0]

    @property
    def is_decode(self) -> bool:
        """Every segment has one token: per-token (BGMV) grids beat per-segment tiles."""
        return self.max_seg_len <= 1

    @classmethod
    def per_token(
        cls,
        token_adapter: torch.Tensor,  # [T] int32, adapter index or -1
        rows: torch.Tensor,  # [A, max_rank] int32
        rank: torch.Tensor,  # [num_slices, A] int32
        scale: torch.Tensor,  # [num_slices, A] float32
    ) -> LoRABatch:
        """A decode batch over the caller's fixed device buffers (the CUDA-graph path).

        The buffers are refilled before every replay, so nothing here may depend on their
        values: the segment view is one segment per token (``seg_adapter`` is
        ``token_adapter`` itself) and ``max_rank`` is the buffers' width, the largest rank
        any adapter may have.
        """
        num_tokens = token_adapter.shape[0]
        seg_start = torch.arange(num_tokens, dtype=torch.int32, device=token_adapter.device)
        return cls(
            num_tokens=num_tokens,
            seg_start=seg_start,
            seg_len=torch.ones_like(seg_start),
            seg_adapter=token_adapter,
            max_seg_len=min(num_tokens, 1),
            token_adapter=token_adapter,
            rows=rows,
            rank=rank,
            scale=scale,
            max_rank=rows.shape[1],
        )

    @classmethod
    def build(
        cls,
        spans: list[tuple[int, int, int | None]],
        adapter_rows: list[list[int]],
        ranks: list[list[int]],
        scales: list[list[float]],
        num_tokens: int,
        device: torch.device | str,
    ) -> LoRABatch:
        """Metadata for tokens ``[start, end)`` using adapter index ``a`` (or None), per span.

        ``spans`` cover ``0 .. num_tokens`` in order. ``adapter_rows[a]`` are adapter a's
        pool rows; ``ranks[s][a]`` (≤ ``len(adapter_rows[a])``) and ``scales[s][a]`` its
        rank and scaling in slice s. All tensors are filled on the host and copied to
        ``device`` in one transfer.
        """
        num_adapters = len(adapter_rows)
        _check_spans(spans, num_tokens, num_adapters)
        _check_table(adapter_rows, ranks, scales)

        segments: list[list[int]] = []  # [start, length, adapter], adjacent same-adapter merged
        token_adapter = [-1] * num_tokens
        for start, end, adapter in spans:
            if adapter is None or end == start:
                continue
            token_adapter[start:end] = [adapter] * (end - start)
            last = segments[-1] if segments else None
            if last is not None and last[2] == adapter and last[0] + last[1] == start:
                last[1] += end - start
            else:
                segments.append([start, end - start, adapter])

        max_rank = max((r for slice_ranks in ranks for r in slice_ranks), default=0)
        rows = [(list(r) + [0] * max_rank)[:max_rank] for r in adapter_rows]
        seg_columns = [list(column) for column in zip(*segments, strict=True)] or [[], [], []]
        num_segments = len(segments)
        num_slices = len(ranks)

        # One int32 host buffer, one copy, then views: the float32 scales travel as their
        # bit patterns (same element size), reinterpreted on the device.
        flat_scales = torch.tensor([c for s in scales for c in s], dtype=torch.float32)
        host = torch.cat(
            [
                torch.tensor(
                    [*seg_columns[0], *seg_columns[1], *seg_columns[2], *token_adapter]
                    + [i for r in rows for i in r]
                    + [r for s in ranks for r in s],
                    dtype=torch.int32,
                ),
                flat_scales.view(torch.int32),
            ]
        )
        buffer = host.to(device)
        parts = buffer.split(
            [num_segments] * 3
            + [num_tokens, num_adapters * max_rank, num_slices * num_adapters]
            + [num_slices * num_adapters]
        )
        return cls(
            num_tokens=num_tokens,
            seg_start=parts[0],
            seg_len=parts[1],
            seg_adapter=parts[2],
            max_seg_len=max((s[1] for s in segments), default=0),
            token_adapter=parts[3],
            rows=parts[4].view(num_adapters, max_rank),
            rank=parts[5].view(num_slices, num_adapters),
            scale=parts[6].view(torch.float32).view(num_slices, num_adapters),
            max_rank=max_rank,
        )


@dataclass(frozen=True)
class LoRATable:
    """A step's adapter table on the host: the arguments of :meth:`LoRABatch.build`.

    ``spans`` are ``(start, end, adapter index or None)`` covering ``0 .. num_tokens``;
    ``adapter_rows[a]`` adapter a's pool rows; ``ranks[s][a]`` / ``scales[s][a]`` its rank
    and scaling in slice s. The engine's static decode path copies it into buffers of its
    own instead of building a ``LoRABatch``. ``dora_rows[a]``: the pool row holding DoRA
    adapter a's per-output scales, -1 for the others (None: no DoRA adapter in the step;
    the LoRA ops never read it, the engine's DoRA term does).
    """

    spans: list[tuple[int, int, int | None]]
    adapter_rows: list[list[int]]
    ranks: list[list[int]]
    scales: list[list[float]]
    num_tokens: int
    dora_rows: list[int] | None = None
    bias_rows: list[int] | None = None  # the same for adapters with a LoRA bias (lora_bias)
    # Per adapter, its experts' LoRA rank (0: none; the engine's lora/expert_lora.py);
    # None: no adapter of the step has any. The LoRA ops never read it.
    expert_ranks: list[int] | None = None
    # Per adapter, its embedding and head rows (the engine's ``lora/tokens.AdapterTokens``,
    # None for one without); None: no adapter of the step has any. The LoRA ops never read it.
    tokens: list | None = None
    # Further passes over the same tokens and adapter table (requests composing several
    # adapters: the engine's ``lora/mix.py``), each a table of its own; the LoRA ops read
    # one table, the engine runs one per pass.
    more_passes: tuple[LoRATable, ...] = ()

    @property
    def max_rank(self) -> int:
        return max((r for slice_ranks in self.ranks for r in slice_ranks), default=0)

    @property
    def plain(self) -> bool:
        """Whether one pass of the LoRA ops is all the step's adapters need (no DoRA, LoRA
        bias, token rows or further passes)."""
        return (
            self.dora_rows is None
            and self.bias_rows is None
            and self.tokens is None
            and self.expert_ranks is None
            and not self.more_passes
        )

    def first_rows(self) -> list[int]:
        """Each adapter's first pool row, for ops that read an adapter's rows as one slice:
        a ValueError unless each adapter's rows are consecutive (the pool's are)."""
        firsts = []
        for rows in self.adapter_rows:
            first = rows[0] if rows else 0
            if rows != list(range(first, first + len(rows))):
                raise ValueError(f"an adapter's pool rows must be consecutive, got {rows}")
            firsts.append(first)
        return firsts

    def to_batch(self, device: torch.device | str) -> LoRABatch:
        return LoRABatch.build(
            self.spans, self.adapter_rows, self.ranks, self.scales, self.num_tokens, device
        )


def _check_spans(
    spans: list[tuple[int, int, int | None]], num_tokens: int, num_adapters: int
) -> None:
    position = 0
    for start, end, adapter in spans:
        if start != position or end < start:
            raise ValueError(
                f"spans must cover the tokens in order; got {start}..{end} at {position}"
            )
        if adapter is not None and not 0 <= adapter < num_adapters:
            raise ValueError(f"adapter index {adapter} outside the table of {num_adapters}")
        position = end
    if position != num_tokens:
        raise ValueError(f"spans cover {position} tokens, the batch has {num_tokens}")


def _check_table(
    adapter_rows: list[list[int]], ranks: list[list[int]], scales: list[list[float]]
) -> None:
    num_adapters = len(adapter_rows)
    if len(scales) != len(ranks):
        raise ValueError(f"{len(ranks)} slices of ranks but {len(scales)} of scales")
    for s, (slice_ranks, slice_scales) in enumerate(zip(ranks, scales, strict=True)):
        if len(slice_ranks) != num_adapters or len(slice_scales) != num_adapters:
            raise ValueError(f"slice {s}: one rank and one scale per adapter expected")
        for a, rank in enumerate(slice_ranks):
            if not 0 <= rank <= len(adapter_rows[a]):
                raise ValueError(
                    f"slice {s}: adapter {a} has rank {rank} but {len(adapter_rows[a])} rows"
                )
