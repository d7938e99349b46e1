"""The Triton backend: SGMV/BGMV LoRA and paged-attention kernels (CUDA; Triton's
interpreter in tests).

A step's adapters become one ``LoRABatch`` shared by every layer and module; a projection
group's LoRA is one shrink launch over all its slices (x read once) and one expand per
slice, BGMV when every segment is one token (decode) and SGMV otherwise. The static
decode path (``loramux.engine.static_decode``) binds its fixed buffers through
:meth:`TritonBackend.bind_lora` and :meth:`TritonBackend.bind_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loramux.engine.lora.backend import BoundAttention, KernelBackend
from loramux.engine.model.llama import LORA_TARGETS, LoRAWeightSource
from loramux.engine.model.quantized import QuantLinearOp
from loramux.kernels import attention_triton, lora_triton
from loramux.kernels.lora_batch import LoRABatch, LoRATable
from loramux.kernels.paged_attention import TritonAttentionPlan, plan_attention_triton


@dataclass(frozen=True)
class TritonStepLoRA:
    """A step's ``LoRABatch`` bound to the pools (a ``StepLoRA``)."""

    batch: LoRABatch
    pools: LoRAWeightSource

    def add(self, x, outs, layer: int, modules: tuple[str, ...]) -> None:
        first = LORA_TARGETS.index(modules[0])
        decode = self.batch.is_decode
        shrink = lora_triton.lora_shrink_bgmv if decode else lora_triton.lora_shrink_sgmv
        expand = lora_triton.lora_expand_bgmv if decode else lora_triton.lora_expand_sgmv
        a_pools = [self.pools.a_pool(layer, m) for m in modules]
        y = shrink(x, a_pools, self.batch, first_slice=first)  # [S, T, max_rank]
        for s, (out, module) in enumerate(zip(outs, modules, strict=True)):
            b_pool = self.pools.b_pool(layer, module)
            expand(out, y[s : s + 1], [b_pool], [0], self.batch, first_slice=first + s)


class TritonBackend(KernelBackend):
    name = "triton"
    static_decode = True

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

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
        return TritonStepLoRA(batch, pools)


def _paged_attention(query, k_cache, v_cache, plan, scale):
    return attention_triton.paged_attention_triton(query, k_cache, v_cache, plan, scale)
