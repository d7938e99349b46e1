"""The memory plan: how the engine lays out the device memory KV blocks and resident
adapters share, worked out once from the config, the model and the backend before anything
is allocated.

From the budget (``budget.py``: set, or sized to the machine) the plan takes the draft
model's KV cache (``draft_kv_cache_bytes``, or ``1 / DRAFT_BUDGET_SHARE`` of the budget) and
a scratch block for the static decode path's padding rows; the rest is KV blocks, which
the arena (``arena.py``) also cuts into adapter rank-rows. KV's floor is the blocks one
request of ``max_model_len`` needs: adapters never take them, so a request always fits
once the others are preempted. The context is capped so that the floor leaves room for one
adapter of ``max_lora_rank`` (half the rows at most, on a budget too small for that; never
more than the ``adapter_device_bytes`` cap).

The same object is what the engine builds from, what it logs at start, and what
``stats()``, the admin API and the engine panel show.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from loramux.engine.config import EngineConfig
from loramux.engine.memory.arena import RowLayout, quantized_block_elems, row_bytes
from loramux.engine.memory.budget import Budget, budget_for, format_bytes, kv_block_bytes
from loramux.engine.model.config import ModelConfig

# "A full batch", for the start-up log: max_num_seqs requests of this many tokens each
# (prompt and output; a chat turn), capped at the context limit.
FULL_BATCH_CONTEXT = 512
PLAN_RANK = 16  # the start-up log counts adapters of this rank
# The draft model's KV cache takes this fraction (1/N) of the KV + adapter budget unless
# EngineConfig.draft_kv_cache_bytes says otherwise.
DRAFT_BUDGET_SHARE = 8


@dataclass(frozen=True)
class MemoryPlan:
    """How the engine lays out its device memory, and what that holds: computed once by
    :func:`plan_memory`, built from by the engine (``Engine.memory_plan``), logged at start
    and reported by ``stats()`` and the admin API as it is."""

    budget_bytes: int  # for KV and adapters (the draft model's KV taken out)
    source: str  # "set" or "machine"
    detail: str  # where the figure came from, in words
    device: str
    block_size: int  # tokens per KV block
    kv_block_bytes: int  # one block across all layers, keys and values
    kv_blocks: int  # blocks the budget holds with no adapter resident
    kv_tokens: int  # kv_blocks * block_size
    adapter_row_bytes: int  # one rank-row of an adapter across all layers and targets
    rank: int  # the adapter rank the counts below are for (PLAN_RANK)
    full_batch_requests: int  # "a full batch": max_num_seqs requests...
    full_batch_context: int  # ...of this many tokens each
    full_batch_blocks: int  # the KV blocks a full batch takes
    adapters_beside_full_batch: int  # adapters of ``rank`` that fit beside it (0: no room)
    adapters_max: int  # adapters of ``rank`` that fit with KV at its floor
    kv_cache_dtype: str = "auto"  # the KV cache's form (kernels/kv_quant.py)
    # How the engine is built from it (defaults: an engine from before they were reported).
    scratch_blocks: int = 0  # KV blocks past kv_blocks for the static decode path's padding
    adapter_max_rows: int | None = None  # adapter_device_bytes in rows (None: no cap)
    adapter_reserve_rows: int = 0  # rows the context cap leaves for one adapter
    adapter_capacity_rows: int = 0  # the most rows adapters can hold (cap, or above KV's floor)
    kv_floor_blocks: int = 0  # blocks adapters never take: one request of max_model_len
    max_model_len: int = 0  # the context limit, capped so the floor leaves the reserve
    draft_kv_bytes: int = 0  # the draft model's KV cache, out of the budget

    @property
    def rank_adapter_bytes(self) -> int:
        return self.rank * self.adapter_row_bytes

    @property
    def full_batch_fits(self) -> bool:
        return self.full_batch_blocks <= self.kv_blocks

    def advice(self) -> str:
        """What to do when memory is the limit (the thrash warning ends with it)."""
        return (
            f"raise kv_cache_bytes (LORAMUX_ENGINE_KV_CACHE_BYTES; now {format_bytes(self.budget_bytes)}, "
            f"{self.detail}), or lower max_num_seqs ({self.full_batch_requests})"
        )

    def describe(self) -> list[str]:
        """The start-up log's lines."""
        budget = f"KV + adapter budget {format_bytes(self.budget_bytes)} on {self.device}, "
        if self.source == "set":
            budget += "set by kv_cache_bytes (LORAMUX_ENGINE_KV_CACHE_BYTES)"
        else:
            budget += f"{self.detail} (kv_cache_bytes / LORAMUX_ENGINE_KV_CACHE_BYTES overrides it)"
        form = "" if self.kv_cache_dtype == "auto" else f", {self.kv_cache_dtype} keys and values"
        holds = (
            f"it holds {self.kv_blocks:,} KV blocks of {self.block_size} tokens = "
            f"{self.kv_tokens:,} tokens ({format_bytes(self.kv_block_bytes)} a block{form}); "
            f"a rank-{self.rank} adapter takes {format_bytes(self.rank_adapter_bytes)}: "
        )
        batch = (
            f"a full batch ({self.full_batch_requests} requests x {self.full_batch_context} "
            f"tokens = {self.full_batch_blocks:,} blocks)"
        )
        if self.full_batch_fits:
            holds += f"{self.adapters_beside_full_batch:,} fit beside {batch}"
        else:
            per_request = self.full_batch_blocks // self.full_batch_requests
            holds += (
                f"none beside {batch}, which does not fit (the KV cache holds "
                f"{self.kv_blocks // per_request:,} such requests with no adapter)"
            )
        holds += f", {self.adapters_max:,} at most (KV at its floor)"
        return [budget, holds]


def requested_context(config: EngineConfig, model: ModelConfig) -> int:
    """The context limit asked for (``max_model_len``, else the model's), never above the
    model's positions (``ModelConfig.max_context``); the plan caps
    it further so that KV's floor leaves room."""
    positions = model.max_context
    return min(config.max_model_len or positions, positions)


def plan_memory(
    config: EngineConfig,
    model: ModelConfig,
    *,
    device: torch.device,
    static_decode: bool,
    has_draft: bool,
    budget: Budget | None = None,
) -> MemoryPlan:
    """The plan for an engine of ``config`` over ``model`` (this device's share of it) on
    ``device``: ``static_decode`` when the backend runs decode steps over fixed buffers
    (they need a scratch block), ``has_draft`` with a draft model (its KV comes out of the
    budget). ``budget`` is read from the machine when not given. ``ValueError`` naming the
    setting to change when the budget cannot hold an engine."""
    budget, draft_kv_bytes = _less_draft(config, budget or budget_for(config, model), has_draft)
    block_size, dtype = config.block_size, config.torch_dtype
    scratch_blocks = 1 if static_decode else 0
    block_bytes = kv_block_bytes(model, block_size, dtype, config.kv_cache_dtype)
    num_blocks = budget.bytes // block_bytes - scratch_blocks
    if num_blocks < 2:
        raise ValueError(
            f"kv_cache_bytes={budget.bytes} ({budget.detail}) holds {num_blocks} KV blocks; "
            f"raise it (one block needs {block_bytes} bytes)"
        )
    layout = RowLayout.for_model(
        model,
        num_blocks,
        block_size,
        block_elems=quantized_block_elems(model, block_size, dtype, config.kv_cache_dtype),
    )
    adapter_row_bytes = row_bytes(layout, model.num_layers, dtype)
    rows = layout.total_rows
    max_rows = None
    if config.adapter_device_bytes is not None:
        max_rows = config.adapter_device_bytes // adapter_row_bytes
        if max_rows < 1:
            raise ValueError(
                f"adapter_device_bytes={config.adapter_device_bytes} holds no adapter row; "
                f"one rank-row of this model needs {adapter_row_bytes} bytes"
            )
    reserve = min(config.max_lora_rank, rows // 2, rows if max_rows is None else max_rows)
    kv_room = max(1, layout.kv_limit_for(rows - reserve))
    max_model_len = min(requested_context(config, model), kv_room * block_size)
    kv_floor = -(-max_model_len // block_size)
    capacity = rows - layout.first_row_for(kv_floor)
    if max_rows is not None:
        capacity = min(capacity, max_rows)
    context, batch_blocks, beside = _full_batch(config, layout, max_model_len, capacity)
    return MemoryPlan(
        budget_bytes=budget.bytes,
        source=budget.source,
        detail=budget.detail,
        device=str(device),
        block_size=block_size,
        kv_block_bytes=block_bytes,
        kv_blocks=num_blocks,
        kv_tokens=num_blocks * block_size,
        adapter_row_bytes=adapter_row_bytes,
        rank=PLAN_RANK,
        full_batch_requests=config.max_num_seqs,
        full_batch_context=context,
        full_batch_blocks=batch_blocks,
        adapters_beside_full_batch=beside,
        adapters_max=capacity // PLAN_RANK,
        kv_cache_dtype=config.kv_cache_dtype,
        scratch_blocks=scratch_blocks,
        adapter_max_rows=max_rows,
        adapter_reserve_rows=reserve,
        adapter_capacity_rows=capacity,
        kv_floor_blocks=kv_floor,
        max_model_len=max_model_len,
        draft_kv_bytes=draft_kv_bytes,
    )


def _less_draft(config: EngineConfig, budget: Budget, has_draft: bool) -> tuple[Budget, int]:
    """The budget less the draft model's KV cache, and that cache's bytes (0 without one)."""
    if not has_draft:
        return budget, 0
    draft_kv_bytes = config.draft_kv_cache_bytes or budget.bytes // DRAFT_BUDGET_SHARE
    less = dataclasses.replace(
        budget,
        bytes=budget.bytes - draft_kv_bytes,
        detail=f"{budget.detail}, less {draft_kv_bytes} bytes for the draft model's KV",
    )
    return less, draft_kv_bytes


def _full_batch(
    config: EngineConfig, layout: RowLayout, max_model_len: int, capacity: int
) -> tuple[int, int, int]:
    """ "A full batch" for the start-up log: its context, its KV blocks, and how many
    adapters of ``PLAN_RANK`` fit beside it (0 when it does not fit)."""
    context = min(FULL_BATCH_CONTEXT, max_model_len)
    batch_blocks = config.max_num_seqs * math.ceil(context / config.block_size)
    beside = 0
    if batch_blocks <= layout.num_blocks:
        rows = layout.total_rows - layout.first_row_for(batch_blocks)
        beside = min(rows, capacity) // PLAN_RANK
    return context, batch_blocks, beside
