"""The Triton backend: SGMV/BGMV LoRA and paged-attention kernels (CUDA; Triton's
interpreter in tests).

A step's adapters become one ``LoRABatch`` shared by every layer and module. A projection
group's LoRA (q/k/v, o, gate/up, down) is one launch over all its slices for a
decode-sized step (``lora_triton_fused``: per token when every segment is one token, per
segment tile otherwise), and a shrink plus an expand over all its slices for a larger one
(``lora_triton``'s SGMV); the tiles of each come from ``lora_tiles.json``. The static
decode path (``loramux.engine.static_decode``) binds its fixed buffers through
:meth:`TritonBackend.bind_lora` and :meth:`TritonBackend.bind_attention`.
"""

from __future__ import annotations

import torch

from loramux.engine.lora.backend import BoundAttention, KernelBackend, LaunchCount
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
        launches = self._run_group(x, outs, a_pools, b_pools, LORA_TARGETS.index(modules[0]))
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


def _device_name(device: torch.device) -> str | None:
    """The GPU's name (the tile table's key); None off CUDA (the interpreter)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def _paged_attention(query, k_cache, v_cache, plan, scale, window=None):
    return attention_triton.paged_attention_triton(
        query, k_cache, v_cache, plan, scale, window=window
    )
