"""The torch backend: the CPU's LoRA and paged attention (and CUDA's, when forced).

LoRA per projection group, by one of two implementations chosen when the backend is made:

* the native op (``native_lora.NativeStepLoRA``) on a float32 CPU engine where it builds
  (``select_backend`` decides): each adapter's rows read straight from the pool;
* otherwise, and under an explicit ``LORAMUX_KERNELS=torch``, the stacked torch ops below.

The stacked ops, from ``loramux.kernels.lora_torch``: the step's
adapters' weights are stacked into dense tensors, then the short segments (decodes) take a
few batched matmuls over the stacks and the long ones (prefill chunks) a matmul per slice
each. Stacking copies the adapters' rows, so the stacks of each (layer, group) are kept in
a :class:`StackCache` and reused for as long as the same adapters run together, with the
same pool contents (the pool's ``weights_version``): in a run of steps the copy is made
once, and a decode step costs a fixed handful of ops per layer however many adapters it
serves. (Chunked prefills run beside the decodes in the same steps, so a new adapter
changes the set once, when it joins.)

Attention: ``loramux.kernels.paged_attention``'s torch implementation and plan.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from loramux.engine.lora.backend import BoundAttention, KernelBackend, LaunchCount
from loramux.engine.lora.native_lora import NativeStepLoRA
from loramux.engine.model.llama import LORA_TARGETS, LoRAWeightSource
from loramux.engine.model.quantized import QuantLinearOp
from loramux.kernels.attention_native import NativePrefillAttention
from loramux.kernels.decode_native import NativeDecodeLibrary
from loramux.kernels.kv_native import NativeKVGather
from loramux.kernels.lora_batch import LoRATable
from loramux.kernels.lora_native import NativeLoRA
from loramux.kernels.lora_torch import (
    StackedTokens,
    StackedWeights,
    lora_segments,
    lora_stacked,
    stack_weights,
)
from loramux.kernels.paged_attention import attend_reference, gather_kv, plan_attention
from loramux.kernels.quant_linear import quant_linear_torch
from loramux.kernels.quant_native import NativeQuantLinear
from loramux.kernels.rows_native import NativeRows

# A segment of at most this many tokens joins the batched matmuls over the stacks (padded
# to the adapter with most such tokens); a longer one (a prefill chunk) takes its own.
SHORT_SEGMENT_TOKENS = 8


class StackCache:
    """Per (layer, group): the last stacked weights built, and the key they were built for.

    Holds at most one set of adapters per (layer, group), so its memory is bounded by the
    weights of the adapters decoding together (padded to their widest rank).
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[int, int], tuple[tuple, StackedWeights]] = {}
        self.builds = 0  # stacks copied (a miss), for tests and benchmarks

    def get(self, layer: int, group: int, key: tuple) -> StackedWeights | None:
        entry = self._entries.get((layer, group))
        return entry[1] if entry is not None and entry[0] == key else None

    def put(self, layer: int, group: int, key: tuple, weights: StackedWeights) -> None:
        self._entries[(layer, group)] = (key, weights)
        self.builds += 1

    @property
    def nbytes(self) -> int:
        return sum(weights.nbytes for _, weights in self._entries.values())


@dataclass(frozen=True)
class _GroupPlan:
    """One projection group's share of a step."""

    first_slice: int  # the group's first module in LORA_TARGETS
    long: list[tuple[int, int, int]]  # (start, end, stack index) of the long segments
    tokens: StackedTokens | None  # the short segments' tokens per stacked adapter
    first_rows: tuple[int, ...]  # per stacked adapter, in stack order (batch order)
    ranks: tuple[tuple[int, ...], ...]  # [slice][stacked adapter]
    scales: tuple[tuple[float, ...], ...]
    key: tuple  # what the stacks hold (StackCache)


class TorchStepLoRA:
    """A step's adapters for the torch ops (a ``StepLoRA``); group plans built on first use."""

    terms = None  # the step's DoRA and LoRA-bias terms, set by forward_step (output_terms.py)
    experts = None  # its LoRA on a mixture's experts, set by forward_step (expert_lora.py)

    def __init__(
        self,
        table: LoRATable,
        pools: LoRAWeightSource,
        cache: StackCache,
        device: torch.device,
        count: LaunchCount,
    ):
        self.table = table  # the pool's table of the step's adapters
        self._pools, self._cache, self._device = pools, cache, device
        self.launches = 0  # calls of the stacked ops (each a few torch ops)
        self._count = count
        self._first_rows = table.first_rows()
        self._groups: dict[tuple[str, ...], _GroupPlan] = {}

    def add(self, x, outs, layer: int, modules: tuple[str, ...]) -> None:
        # Called 4 times a layer, every step: keep the hot path (stacks cached) to a dict
        # lookup or two before the ops.
        plan = self._groups.get(modules)
        if plan is None:
            plan = self._groups[modules] = self._plan(modules)
        if not plan.first_rows:
            return  # no adapter of the step targets this group
        weights = self._cache.get(layer, plan.first_slice, plan.key)
        if weights is None:
            pools = self._pools
            weights = stack_weights(
                [pools.a_pool(layer, m) for m in modules],
                [pools.b_pool(layer, m) for m in modules],
                plan.first_rows,
                plan.ranks,
                plan.scales,
            )
            self._cache.put(layer, plan.first_slice, plan.key, weights)
        launches = 0
        if plan.tokens is not None:
            lora_stacked(x, outs, weights, plan.tokens)
            launches += 1
        if plan.long:
            lora_segments(x, outs, weights, plan.long)
            launches += 1
        self.launches += launches
        self._count.add(launches)

    def _plan(self, modules: tuple[str, ...]) -> _GroupPlan:
        table = self.table
        first, count = LORA_TARGETS.index(modules[0]), len(modules)
        slices = range(first, first + count)
        ranks = [tuple(table.ranks[s][a] for s in slices) for a in range(len(table.adapter_rows))]
        scales = [tuple(table.scales[s][a] for s in slices) for a in range(len(ranks))]
        # Stack order = batch order (the scheduler's, by adapter id, stable from step to
        # step): a decode step's tokens then sit in stack order and X is a view of x.
        stack: dict[int, int] = {}  # adapter index -> its index in the stacks
        short: list[list[int]] = []  # per stacked adapter, its short segments' tokens
        long: list[tuple[int, int, int]] = []
        for start, end, adapter in table.spans:
            if adapter is None or end == start or not any(ranks[adapter]):
                continue
            i = stack.setdefault(adapter, len(stack))
            if i == len(short):
                short.append([])
            if end - start > SHORT_SEGMENT_TOKENS:
                long.append((start, end, i))
            else:
                short[i].extend(range(start, end))
        members = list(stack)
        tokens = None
        if any(short):
            tokens = StackedTokens.build(short, table.num_tokens, self._device)
        first_rows = tuple(self._first_rows[a] for a in members)
        member_ranks = tuple(tuple(ranks[a][s] for a in members) for s in range(count))
        member_scales = tuple(tuple(scales[a][s] for a in members) for s in range(count))
        # The stacks' contents: these adapters' rows, as the pool holds them now.
        key = (id(self._pools), self._pools.weights_version, first_rows, member_ranks)
        return _GroupPlan(
            first_slice=first,
            long=long,
            tokens=tokens,
            first_rows=first_rows,
            ranks=member_ranks,
            scales=member_scales,
            key=(*key, member_scales),
        )


class TorchBackend(KernelBackend):
    """Torch attention; LoRA by the native op where given one (``native_lora``), else by the
    stacked torch ops above."""

    name = "torch"
    static_decode = False  # the torch attention sizes its work on the host

    def __init__(
        self,
        device: torch.device,
        native: NativeLoRA | None = None,
        native_quant: NativeQuantLinear | None = None,
        native_kv: NativeKVGather | None = None,
        native_decode: NativeDecodeLibrary | None = None,
        native_rows: NativeRows | None = None,
        native_attention: NativePrefillAttention | None = None,
    ):
        self.device = torch.device(device)
        self.lora_launches = LaunchCount()
        self.native = native
        self.stacks = StackCache()
        self.native_quant = native_quant
        # Decode-only steps in one native call, plain LoRA inside (engine/native_decode.py).
        self.native_decode = native_decode
        self.native_rows = native_rows  # prefill chunks' norms and activations
        # An 8-bit KV cache read natively (one pass over a context's bytes), else by torch;
        # prefill chunks' causal attention natively where it takes them, else by SDPA.
        self.attend = functools.partial(
            attend_reference,
            gather=gather_kv if native_kv is None else native_kv.gather,
            prefill=native_attention,
        )

    @property
    def quant_linear(self) -> QuantLinearOp:
        """The native op on a float32 CPU engine where it builds, else the torch tiles."""
        return quant_linear_torch if self.native_quant is None else self.native_quant.linear

    @property
    def lora_op(self) -> str:
        """Which LoRA ops run: ``native`` or ``stacked`` (for logs and reports)."""
        return "native" if self.native is not None else "stacked"

    def plan_attention(self, block_tables, context_lens, query_lens, block_size, device):
        plan = plan_attention(block_tables, context_lens, query_lens, block_size, device)
        return BoundAttention(plan, self.attend)

    def lora_step(self, table: LoRATable, pools: LoRAWeightSource):
        if self.native is not None:
            return NativeStepLoRA(table, pools, self.native, self.lora_launches)
        return TorchStepLoRA(table, pools, self.stacks, self.device, self.lora_launches)
