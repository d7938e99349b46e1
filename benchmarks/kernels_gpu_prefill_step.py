"""One full prefill step of the engine's model, with LoRA on all seven modules and without.

The step is ``seqs`` prompts of ``tokens`` new tokens each (no cached prefix), in one
forward as the engine runs a prefill (``LlamaForCausalLM.forward`` over the paged KV
cache, the backend's attention plan and LoRA step over ``LoRAPool.step_table``); its
memory is the engine's (``kernels_gpu_step``'s arena: KV blocks below, adapters' rows
above). Variants: the base step, then LoRA with 1, ..., ``seqs`` distinct adapters of
rank ``rank`` (sequence i uses adapter ``i * n // seqs``). The target
(``PREFILL_TARGET_RATIO``): with one adapter per sequence, at most 1.15× the base step.

Floor of the step, per layer (e element size, P the layer's projection weights, T = seqs ×
tokens, L = tokens, r the rank, n distinct adapters, Σ(in + out) over the seven modules):

    base bytes  = e (P + 2 T Hkv D)                  weights once, K and V written
    base flops  = 2 T P + 2 T L Hq D                 causal attention: L / 2 keys a query
    LoRA adds     e n r Σ(in + out) bytes,  2 T r Σ(in + out) flops

Correctness: each variant's output (final hidden states) against the same forward on the
torch backend (same dtype), within ``STEP_TOLERANCE``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from loramux.benchmarks.kernels_gpu_attention import shuffled_block_tables
from loramux.benchmarks.kernels_gpu_lora import grouped_spans
from loramux.benchmarks.kernels_gpu_step import (
    STEP_TOLERANCE,
    arena_blocks,
    build_random_model,
    layer_params,
    lora_row_width,
    random_adapter,
    run_variants,
)
from loramux.benchmarks.kernels_gpu_timing import (
    BenchContext,
    relative_error,
)
from loramux.engine.lora.backend import select_backend
from loramux.engine.lora.pool import LoRAPool
from loramux.engine.lora.torch_backend import TorchBackend
from loramux.engine.memory.arena import DeviceArena
from loramux.engine.memory.kv_cache import KVCacheManager
from loramux.engine.model.config import ModelConfig

PREFILL_TARGET_RATIO = 1.15


@dataclasses.dataclass(frozen=True)
class PrefillStepCase:
    config: ModelConfig
    seqs: int
    tokens: int  # new tokens per sequence
    rank: int
    adapter_counts: tuple[int, ...]
    block_size: int

    @property
    def kv_blocks(self) -> int:
        return self.seqs * math.ceil(self.tokens / self.block_size)

    @property
    def arena_blocks(self) -> int:
        adapters = max(self.adapter_counts, default=0)
        return arena_blocks(self.config, self.kv_blocks, adapters * self.rank, self.block_size)


@dataclasses.dataclass
class _Setup:
    model: torch.nn.Module
    kv_caches: list
    input_ids: torch.Tensor
    backends: tuple  # (measured backend and its plan, torch backend and its plan)
    pool: LoRAPool


def _setup(case: PrefillStepCase, ctx: BenchContext) -> _Setup:
    config = case.config
    model = build_random_model(config, ctx)
    lengths = [case.tokens] * case.seqs
    tables = shuffled_block_tables(lengths, case.block_size)
    num_blocks = case.arena_blocks
    arena = DeviceArena(
        config, num_blocks, case.block_size, ctx.dtype, ctx.device, scratch_blocks=1
    )
    kv = KVCacheManager(num_blocks, case.block_size, False, min_limit=case.kv_blocks)
    pool = LoRAPool(config, arena, kv)
    for adapter_id in range(max(case.adapter_counts, default=0)):
        pool.load(adapter_id, random_adapter(config, case.rank, f"bench-{adapter_id}", ctx))
    backends = []
    for backend in (select_backend(ctx.device, ctx.dtype), TorchBackend(ctx.device)):
        plan = backend.plan_attention(tables, lengths, lengths, case.block_size, ctx.device)
        backends.append((backend, plan))
    if backends[0][0].name != "triton":
        raise RuntimeError("the step benchmark measures the Triton kernels (CUDA or interpreter)")
    total = case.seqs * case.tokens
    input_ids = torch.randint(0, config.vocab_size, (total,), device=ctx.device)
    return _Setup(model, arena.kv_caches, input_ids, tuple(backends), pool)


def _forward(setup: _Setup, which: int, spans: list):
    """The step's hidden states and its LoRA step (None without adapters)."""
    backend, attention = setup.backends[which]
    table = setup.pool.step_table(spans)
    lora = None if table is None else backend.lora_step(table, setup.pool)
    return setup.model(setup.input_ids, attention, setup.kv_caches, lora), lora


def _traffic(case: PrefillStepCase, adapters: int, element_size: int) -> tuple[int, int]:
    """(bytes, flops) of the whole step by the module docstring's formulas."""
    c, tokens = case.config, case.seqs * case.tokens
    num_bytes = (layer_params(c) + 2 * tokens * c.kv_size) * element_size
    flops = 2 * tokens * layer_params(c) + 2 * tokens * case.tokens * c.q_size
    if adapters:
        num_bytes += adapters * case.rank * lora_row_width(c) * element_size
        flops += 2 * tokens * case.rank * lora_row_width(c)
    return num_bytes * c.num_layers, flops * c.num_layers


def _measure(
    case: PrefillStepCase, setup: _Setup, adapters: int, base: dict, ctx: BenchContext
) -> dict:
    spans = grouped_spans(case.seqs, case.tokens, list(range(adapters))) if adapters else []
    output, lora = _forward(setup, 0, spans)
    expected, _ = _forward(setup, 1, spans)
    step_s = ctx.timer.median_s(lambda: _forward(setup, 0, spans)[0], flush_l2=False)
    floor_s = ctx.rates.floor_s(*_traffic(case, adapters, ctx.dtype.itemsize))
    result = {
        "step_ms": step_s * 1e3,
        "floor_ms": floor_s * 1e3,
        "step_vs_floor": step_s / floor_s,
        "rel_err": relative_error(output, expected),
        "matches": relative_error(output, expected) < STEP_TOLERANCE[ctx.dtype],
    }
    if not adapters:
        return result | {"output": output}
    ratio = step_s * 1e3 / base["step_ms"]
    is_target = adapters == case.seqs
    return result | {
        "base_ms": base["step_ms"],
        "base_floor_ms": base["floor_ms"],
        "overhead_pct": 100 * (ratio - 1),
        "kernel": lora.form,  # the backend's form for the step
        "launches_per_layer": lora.launches / case.config.num_layers,
        "lora_effect": relative_error(output, base["output"]),
        "target": "prefill_step_adapters" if is_target else None,
        "target_pass": ratio <= PREFILL_TARGET_RATIO if is_target else None,
    }


def run_prefill_step_case(case: PrefillStepCase, ctx: BenchContext) -> list[dict]:
    """The base step, then each LoRA variant against it."""
    common = {
        "layers": case.config.num_layers,
        "kv_heads": case.config.num_kv_heads,
        "seqs": case.seqs,
        "tokens": case.seqs * case.tokens,
    }
    return run_variants(case, ctx, common, _setup, _measure)
