"""The Triton backend: SGMV/BGMV LoRA and paged-attention kernels (CUDA; Triton's
interpreter in tests).

A step's adapters become one ``LoRABatch`` shared by every layer and module. A projection
group's LoRA (q/k/v, o, gate/up, down) is one launch over all its slices for a
decode-sized step (``lora_triton_fused``: per token when every segment is one token, per
segment tile otherwise), and a shrink plus an expand over all its slices for a larger one
(``lora_triton``'s SGMV); the tiles of each come from ``lora_tiles.json``. The static
decode path (``loramux.engine.static_decode``) binds its fixed buffers through
:meth:`TritonBackend.bind_lora` and :meth:`TritonBackend.bind_attention`. LoRA on a mixture's
experts (``expert_lora.py``) runs the per-token kernels over each expert's rows
(:class:`TritonStepExpertLoRA`).
"""

from __future__ import annotations

import torch

from loramux.engine.lora.backend import BoundAttention, KernelBackend, LaunchCount
from loramux.engine.lora.expert_lora import (
    MLP_MODULES,
    expert_adapters,
    expert_pools,
    token_owners,
)
from loramux.engine.model.llama import LORA_TARGETS, LoRAWeightSource
from loramux.engine.model.quantized import QuantLinearOp
from loramux.kernels import attention_triton, lora_triton, lora_triton_fused
from loramux.kernels.lora_batch import LoRABatch, LoRATable
from loramux.kernels.lora_tiles import PhaseTiles, tiles_for
from loramux.kernels.paged_attention import TritonAttentionPlan, plan_attention_triton

# The two-launch path's launches per projection group: the intermediate's zeroing, the
# shrink and the expand.
TWO_LAUNCH_LAUNCHES = 3


class TritonStepLoRA:
    """A step's ``LoRABatch`` bound to the pools (a ``StepLoRA``), and the form its
    projection groups take (``PhaseTiles``): one fused launch per group for decode-sized
    steps, a shrink and an expand for larger ones. ``launches`` counts the kernel launches
    it has made (the engine reports them per decode step)."""

    terms = None  # the step's DoRA and LoRA-bias terms, set by forward_step (output_terms.py)
    experts = None  # its LoRA on a mixture's experts, set by forward_step (expert_lora.py)

    def __init__(
        self, batch: LoRABatch, pools: LoRAWeightSource, tiles: PhaseTiles, count: LaunchCount
    ):
        self.batch, self.pools, self.tiles = batch, pools, tiles
        self.launches = 0
        self._count = count  # the backend's running total
        # The form every group of the step takes, and its label (for reports).
        if batch.is_decode:
            self.form, self._run_group = "fused-bgmv", self._fused_per_token
        elif batch.num_tokens <= tiles.fused_max_tokens:
            self.form, self._run_group = "fused-sgmv", self._fused_per_segment
        else:
            self.form, self._run_group = "sgmv", self._shrink_then_expand

    def add(self, x, outs, layer: int, modules: tuple[str, ...]) -> None:
        pools = self.pools
        a_pools = [pools.a_pool(layer, m) for m in modules]
        b_pools = [pools.b_pool(layer, m) for m in modules]
        self.count(self._run_group(x, outs, a_pools, b_pools, LORA_TARGETS.index(modules[0])))

    def count(self, launches: int) -> None:
        self.launches += launches
        self._count.add(launches)

    def _fused_per_token(self, x, outs, a_pools, b_pools, first: int) -> int:
        fused = lora_triton_fused.lora_fused_bgmv
        return fused(x, outs, a_pools, b_pools, self.batch, self.tiles.decode, first_slice=first)

    def _fused_per_segment(self, x, outs, a_pools, b_pools, first: int) -> int:
        fused = lora_triton_fused.lora_fused_sgmv
        return fused(x, outs, a_pools, b_pools, self.batch, self.tiles.segments, first_slice=first)

    def _shrink_then_expand(self, x, outs, a_pools, b_pools, first: int) -> int:
        batch, block_m = self.batch, self.tiles.prefill_block_m
        y = lora_triton.lora_shrink_sgmv(x, a_pools, batch, first_slice=first, block_m=block_m)
        lora_triton.lora_expand_sgmv_outs(
            outs, y, b_pools, batch, first_slice=first, block_m=block_m
        )
        return TWO_LAUNCH_LAUNCHES


class TritonStepExpertLoRA:
    """``expert_lora.StepExpertLoRA`` through the per-token shrink and expand kernels: for
    an expert, every adapter's tokens in one launch pair per projection group, the batch
    (``expert_lora.expert_batch``'s) made on the device with no host sync."""

    def __init__(self, owners, row_base, rank_col, rank, scale, pools, step: TritonStepLoRA):
        self.owners = owners  # [T] int32, each token's position in the step's table, or -1
        self.row_base = row_base  # [A, max_rank] int32: expert 0's rows (first_row + i)
        self.rank_col = rank_col  # [A, 1] int32: each adapter's rank per expert
        self.rank, self.scale = rank, scale  # [3, A]: per slice (gate, up, down)
        self.pools, self.step = pools, step

    @classmethod
    def for_step(cls, table, pools, device, step: TritonStepLoRA) -> TritonStepExpertLoRA | None:
        adapters = expert_adapters(table)
        if not adapters:
            return None
        max_rank = max(a.rank for a in adapters)
        first = torch.tensor([a.first_row for a in adapters], dtype=torch.int32)
        ranks = torch.tensor([a.rank for a in adapters], dtype=torch.int32)
        row_base = first[:, None] + torch.arange(max_rank, dtype=torch.int32)[None, :]
        scale = torch.tensor([[a.scales[m] for a in adapters] for m in MLP_MODULES])
        owners = torch.tensor(token_owners(table, adapters), dtype=torch.int32)
        return cls(
            owners.to(device),
            row_base.to(device),
            ranks[:, None].to(device),
            ranks.expand(len(MLP_MODULES), -1).contiguous().to(device),
            scale.to(device),
            pools,
            step,
        )

    def add(self, x, outs, tokens, layer: int, expert: int, modules: tuple[str, ...]) -> None:
        batch = LoRABatch.per_token(
            self.owners.index_select(0, tokens),
            self.row_base + expert * self.rank_col,
            self.rank,
            self.scale,
        )
        a_pools, b_pools = expert_pools(self.pools, layer, modules, x, outs)
        first = MLP_MODULES.index(modules[0])
        y = lora_triton.lora_shrink_bgmv(x, a_pools, batch, first_slice=first)
        lora_triton.lora_expand_bgmv_outs(outs, y, b_pools, batch, first_slice=first)
        self.step.count(TWO_LAUNCH_LAUNCHES)


class TritonBackend(KernelBackend):
    name = "triton"
    static_decode = True

    def __init__(self, device: torch.device, tiles: PhaseTiles | None = None):
        self.device = torch.device(device)
        # The committed table's tiles for this GPU (lora_tiles.json), unless given.
        self.tiles = tiles or tiles_for(_device_name(self.device))
        self.lora_launches = LaunchCount()

    def plan_attention(self, block_tables, context_lens, query_lens, block_size, device):
        plan = plan_attention_triton(block_tables, context_lens, query_lens, block_size, device)
        return self.bind_attention(plan)

    def bind_attention(self, plan: TritonAttentionPlan) -> BoundAttention:
        # Through the module attribute, so a test's spy on the launcher sees the calls.
        return BoundAttention(plan, _paged_attention)

    @property
    def quant_linear(self) -> QuantLinearOp:
        from loramux.kernels.quant_triton import quant_linear_triton

        return quant_linear_triton

    def lora_step(self, table: LoRATable, pools: LoRAWeightSource) -> TritonStepLoRA:
        return self.bind_lora(table.to_batch(self.device), pools)

    def bind_lora(self, batch: LoRABatch, pools: LoRAWeightSource) -> TritonStepLoRA:
        return TritonStepLoRA(batch, pools, self.tiles, self.lora_launches)

    def expert_lora_step(self, table: LoRATable, step: TritonStepLoRA, pools, device):
        return TritonStepExpertLoRA.for_step(table, pools, device, step)


def _device_name(device: torch.device) -> str | None:
    """The GPU's name (the tile table's key); None off CUDA (the interpreter)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def _paged_attention(query, k_cache, v_cache, plan, scale, window=None):
    return attention_triton.paged_attention_triton(
        query, k_cache, v_cache, plan, scale, window=window
    )
