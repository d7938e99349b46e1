"""A step's LoRA through the CPU's native op (``loramux.kernels.lora_native``).

The torch backend's LoRA when the op builds on this machine and the engine runs float32 on
the CPU: per projection, one call over every segment of the step, reading each adapter's
rows straight from the pool (no stacks to copy or keep, no padding to the widest rank).
One call per projection group a layer: the group's slices share the input and sit side by
side in a pool row.
Without it the backend uses the stacked torch ops (``torch_backend.TorchStepLoRA``).
"""

from __future__ import annotations

import torch

from loramux.engine.lora.backend import LaunchCount
from loramux.engine.model.llama import LORA_TARGETS, LoRAWeightSource
from loramux.kernels.lora_batch import LoRATable
from loramux.kernels.lora_native import GroupCall, NativeLoRA


class NativeStepLoRA:
    """A step's adapters for the native op (a ``StepLoRA``); group plans built on first use."""

    terms = None  # the step's DoRA and LoRA-bias terms, set by forward_step (output_terms.py)
    experts = None  # its LoRA on a mixture's experts, set by forward_step (expert_lora.py)

    def __init__(
        self, table: LoRATable, pools: LoRAWeightSource, op: NativeLoRA, count: LaunchCount
    ):
        self.table = table
        self._pools, self._op = pools, op
        self.launches = 0  # native op calls
        self._count = count
        self._first_rows = table.first_rows()
        self._rank_width = max(table.max_rank, 1)
        # h = x @ A_s^T of every token, slice s's ranks at columns [s R, s R + r): one scratch
        # for the step's calls (a group has at most three slices).
        self._scratch = torch.empty(table.num_tokens, 3 * self._rank_width)
        self._groups: dict[tuple[str, ...], GroupCall | None] = {}

    def add(self, x, outs, layer: int, modules: tuple[str, ...]) -> None:
        if modules in self._groups:
            call = self._groups[modules]
        else:
            call = self._groups[modules] = self._prepare(x, outs, layer, modules)
        if call is None:
            return  # no adapter of the step targets this group
        pools = self._pools
        a_pools = [pools.a_pool(layer, m) for m in modules]
        b_pools = [pools.b_pool(layer, m) for m in modules]
        self._op.apply(x, outs, a_pools, b_pools, call)
        self.launches += 1
        self._count.add(1)

    def _prepare(self, x, outs, layer: int, modules: tuple[str, ...]) -> GroupCall | None:
        table = self.table
        slices = [LORA_TARGETS.index(m) for m in modules]
        segments, ranks, scales = [], [], []
        for start, end, adapter in table.spans:
            if adapter is None or end == start:
                continue
            adapter_ranks = [table.ranks[s][adapter] for s in slices]
            if any(adapter_ranks):
                segments.append((start, end, self._first_rows[adapter]))
                ranks.append(adapter_ranks)
                scales.append([table.scales[s][adapter] for s in slices])
        if not segments:
            return None
        pools = self._pools
        return self._op.prepare(
            x,
            outs,
            [pools.a_pool(layer, m) for m in modules],
            [pools.b_pool(layer, m) for m in modules],
            segments,
            ranks,
            scales,
            self._scratch,
            self._rank_width,
        )
