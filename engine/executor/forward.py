"""A step's forward and KV block copies over a model and its paged KV cache: what every
executor that runs the model does, on one device or on each rank of a sharded one."""

from __future__ import annotations

from collections.abc import Callable

import torch

from loramux.engine.lora.backend import KernelBackend
from loramux.engine.lora.mix import SummedStepLoRA
from loramux.engine.lora.output_terms import StepOutputTerms
from loramux.engine.lora.tokens import StepTokens
from loramux.engine.model.llama import LlamaForCausalLM, LoRAWeightSource
from loramux.engine.static_decode import DecodeStep
from loramux.engine.step_batch import ForwardInputs
from loramux.kernels.kv_quant import QuantizedKV


def copy_kv_blocks(kv_caches, moves: list[tuple[int, int]], device: torch.device) -> None:
    """Copy KV blocks ``src -> dst`` (keys and values of every layer); the destinations
    were free, so no pair overlaps another."""
    if not moves:
        return
    src = torch.tensor([s for s, _ in moves], dtype=torch.long, device=device)
    dst = torch.tensor([d for _, d in moves], dtype=torch.long, device=device)
    for caches in kv_caches:  # [num_blocks, block_size, kv_heads, head_dim] each
        for cache in caches:
            # A quantized cache's blocks as raw bytes: data and scales in one copy.
            blocks = cache.raw if isinstance(cache, QuantizedKV) else cache
            blocks.index_copy_(0, dst, blocks.index_select(0, src))


def forward_step(
    model: LlamaForCausalLM,
    backend: KernelBackend,
    kv_caches,
    pools: LoRAWeightSource,
    block_size: int,
    device: torch.device,
    inputs: ForwardInputs,
    interrupt: Callable[[], None] | None = None,
    tokens: StepTokens | None = None,
) -> torch.Tensor:
    """Hidden states ``[rows, hidden]`` of one step over tensors built for it: its attention
    plan and LoRA metadata from ``backend``, adapters read from ``pools`` (their own
    embedding rows from ``tokens``, ``step_tokens``)."""
    attention = backend.plan_attention(
        inputs.block_tables, inputs.context_lens, inputs.query_lens, block_size, device
    )
    lora = None
    if inputs.lora is not None:
        lora = backend.lora_step(inputs.lora, pools)
        lora.terms = StepOutputTerms.for_step(inputs.lora, pools, device)
        lora.experts = backend.expert_lora_step(inputs.lora, lora, pools, device)
        if inputs.lora.more_passes:  # mixes' further parts (lora/mix.py)
            more = [backend.lora_step(table, pools) for table in inputs.lora.more_passes]
            lora = SummedStepLoRA(lora, more)
    input_tensor = torch.tensor(inputs.input_ids, dtype=torch.long, device=device)
    return model(input_tensor, attention, kv_caches, lora, interrupt, tokens)


def step_tokens(
    model: LlamaForCausalLM, pools: LoRAWeightSource, inputs: ForwardInputs, device
) -> StepTokens | None:
    """The step's adapters' own embedding and head rows over this device's vocabulary
    range; None when none of its adapters has any."""
    vocab = range(model.vocab_start, model.vocab_start + model.config.vocab_size)
    return StepTokens.for_step(inputs, pools, vocab, device)


def decode_step(inputs: ForwardInputs) -> DecodeStep:
    """A decode-only step's inputs as the static decode path takes them."""
    return DecodeStep(inputs.input_ids, inputs.context_lens, inputs.block_tables, inputs.lora)
