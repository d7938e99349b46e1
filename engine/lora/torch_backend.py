"""The torch backend: the CPU's LoRA and paged attention (and CUDA's, when forced).

LoRA per projection group, with the ops of ``loramux.kernels.lora_torch``:

* segments longer than :data:`SHORT_SEGMENT_TOKENS` (prefill chunks) by a matmul pair per
  segment, straight from the pool;
* the short ones (decodes) by a few batched matmuls over the adapters' weights stacked
  into dense tensors. Stacking copies the adapters' rows, so the stacks of each (layer,
  group) are kept in a :class:`StackCache` and reused for as long as the same adapters
  decode together, with the same pool contents (the pool's ``weights_version``): in a
  run of decode steps the copy is made once, and every step costs a fixed handful of ops
  per layer however many adapters it serves.

Attention: ``loramux.kernels.paged_attention``'s torch implementation and plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loramux.engine.lora.backend import BoundAttention, KernelBackend
from loramux.engine.model.llama import LORA_TARGETS, LoRAWeightSource
from loramux.kernels.lora_batch import LoRATable
from loramux.kernels.lora_torch import (
    SegmentRows,
    StackedTokens,
    StackedWeights,
    lora_segments,
    lora_stacked,
    stack_weights,
)
from loramux.kernels.paged_attention import attend_reference, plan_attention

# A segment of at most this many tokens is served from the stacks. Longer ones (prefill)
# take a matmul pair per slice: stacking them would pad every adapter to the longest.
SHORT_SEGMENT_TOKENS = 8


class StackCache:
    """Per (layer, group): the last stacked weights built, and the key they were built for.

    Holds at most one set of adapters per (layer, group), so its memory is bounded by the
    weights of the adapters decoding together (padded to their widest rank).
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[int, int], tuple[tuple, StackedWeights]] = {}
        self.builds = 0  # stacks copied (a miss), for tests and benchmarks

    def get(self, layer: int, group: int, key: tuple, build) -> StackedWeights:
        entry = self._entries.get((layer, group))
        if entry is not None and entry[0] == key:
            return entry[1]
        weights = build()
        self._entries[(layer, group)] = (key, weights)
        self.builds += 1
        return weights

    @property
    def nbytes(self) -> int:
        return sum(weights.nbytes for _, weights in self._entries.values())


@dataclass(frozen=True)
class _GroupPlan:
    """One projection group's share of a step."""

    long: list[SegmentRows]
    tokens: StackedTokens | None  # the short segments' tokens per stacked adapter
    first_rows: tuple[int, ...]  # per stacked adapter, in stack order (by pool row)
    ranks: tuple[tuple[int, ...], ...]  # [slice][stacked adapter]
    scales: tuple[tuple[float, ...], ...]


class TorchStepLoRA:
    """A step's adapters for the torch ops (a ``StepLoRA``); group plans built on first use."""

    def __init__(
        self, table: LoRATable, pools: LoRAWeightSource, cache: StackCache, device: torch.device
    ):
        self.table = table  # the pool's table of the step's adapters
        self._pools, self._cache, self._device = pools, cache, device
        self._first_rows = [_first_row(rows) for rows in table.adapter_rows]
        self._groups: dict[int, _GroupPlan] = {}

    def add(self, x, outs, layer: int, modules: tuple[str, ...]) -> None:
        first = LORA_TARGETS.index(modules[0])
        plan = self._groups.get(first)
        if plan is None:
            plan = self._groups[first] = self._plan(first, len(modules))
        a_pools = [self._pools.a_pool(layer, m) for m in modules]
        b_pools = [self._pools.b_pool(layer, m) for m in modules]
        if plan.long:
            lora_segments(x, outs, a_pools, b_pools, plan.long)
        if plan.tokens is not None:
            key = (id(self._pools), self._pools.weights_version, plan.first_rows, plan.ranks)
            key += (plan.scales,)
            weights = self._cache.get(
                layer,
                first,
                key,
                lambda: stack_weights(a_pools, b_pools, plan.first_rows, plan.ranks, plan.scales),
            )
            lora_stacked(x, outs, weights, plan.tokens)

    def _plan(self, first: int, count: int) -> _GroupPlan:
        table = self.table
        slices = range(first, first + count)
        ranks = [tuple(table.ranks[s][a] for s in slices) for a in range(len(table.adapter_rows))]
        scales = [tuple(table.scales[s][a] for s in slices) for a in range(len(ranks))]
        long: list[SegmentRows] = []
        short: dict[int, list[int]] = {}  # adapter index -> its short segments' token rows
        for start, end, adapter in table.spans:
            if adapter is None or end == start or not any(ranks[adapter]):
                continue
            if end - start > SHORT_SEGMENT_TOKENS:
                row = self._first_rows[adapter]
                long.append(SegmentRows(start, end, row, ranks[adapter], scales[adapter]))
            else:
                short.setdefault(adapter, []).extend(range(start, end))
        # Stack order by pool row: the same adapters give the same stacks in any batch order.
        members = sorted(short, key=lambda a: self._first_rows[a])
        tokens = None
        if members:
            token_rows = [short[a] for a in members]
            tokens = StackedTokens.build(token_rows, table.num_tokens, self._device)
        return _GroupPlan(
            long=long,
            tokens=tokens,
            first_rows=tuple(self._first_rows[a] for a in members),
            ranks=tuple(tuple(ranks[a][s] for a in members) for s in range(count)),
            scales=tuple(tuple(scales[a][s] for a in members) for s in range(count)),
        )


def _first_row(rows: list[int]) -> int:
    """An adapter's first pool row; its rows must be consecutive (the pool's are)."""
    first = rows[0] if rows else 0
    if rows != list(range(first, first + len(rows))):
        raise ValueError(f"the torch backend needs an adapter's rows consecutive, got {rows}")
    return first


class TorchBackend(KernelBackend):
    name = "torch"
    static_decode = False  # the torch attention sizes its work on the host

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stacks = StackCache()

    def plan_attention(self, block_tables, context_lens, query_lens, block_size, device):
        plan = plan_attention(block_tables, context_lens, query_lens, block_size, device)
        return BoundAttention(plan, attend_reference)

    def lora_step(self, table: LoRATable, pools: LoRAWeightSource) -> TorchStepLoRA:
        return TorchStepLoRA(table, pools, self.stacks, self.device)
