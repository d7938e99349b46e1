"""One full step of the engine's model, decode or prefill, with LoRA on all seven modules
and without.

The path measured is the engine's: ``LlamaForCausalLM.forward`` over the paged KV cache,
with the step's attention plan and LoRA from the engine's kernel backend (Triton on CUDA)
over ``LoRAPool.step_table``, as the runner builds them. Weights are random
(``loader.random_model``: the cost does not depend on them), made on the device. The
memory is the engine's: one ``DeviceArena`` per layer holds the contexts' KV blocks at the
bottom and the adapters' rank-rows at the top (``LoRAPool`` over a ``KVCacheManager``), so
the LoRA ops read strided row views of the KV tensors.

A decode step is ``seqs`` sequences with ``prefix`` tokens cached (random keys and values)
decoding one more each; a prefill step ``seqs`` prompts of ``new_tokens`` tokens. Variants:
the base step (``lora=None``), then LoRA with 1, ..., ``seqs`` distinct adapters of rank
``rank`` (sequence i uses adapter ``i * n // seqs``). Overhead = (LoRA step − base step) /
base step; ``build_step_ms`` is the host time of the step's LoRA metadata (once per step,
outside the forward); ``launches_per_layer`` the LoRA kernel launches per layer (the
backend's count). The targets are ``StepCase.targets``.

Floor of a step, per layer (e element size, P the layer's projection weights, B sequences
of L = prefix + new tokens, T tokens in all, r the rank, n distinct adapters, Σ(in + out)
over the seven modules):

    base bytes  = e (P + 2 B L Hkv D)        weights once, each context's K and V once
    base flops  = 2 T P + 4 Hq D Σ_i (p_i + 1)   q·k and p·v for the keys each query sees
    LoRA adds     e n r Σ(in + out) bytes    each distinct adapter's A and B rows once
                  2 T r Σ(in + out) flops

Correctness: each variant's output (final hidden states) against the same forward on the
torch backend (same dtype), within ``STEP_TOLERANCE``.

The engine runs decode-only steps on its static path (``loramux.engine.static_decode``):
the same forward over fixed buffers, replayed from a CUDA graph captured for the batch
size. ``graph_ms`` times that path as the engine takes it (filling the buffers from the
step's host lists, then the replay), ``graph_overhead_pct`` is its LoRA overhead,
``graph_err`` its output against the eager step's, ``graph_launches_per_layer`` what a
replay launches. A decode target is judged on it where it was captured (on CUDA), else on
the eager step. Without CUDA (``--smoke``) the static path runs eagerly over its buffers.
"""

from __future__ import annotations

import dataclasses
import math
import traceback
from functools import partial

import torch

from loramux.benchmarks.kernels_gpu.attention import shuffled_block_tables
from loramux.benchmarks.kernels_gpu.lora import LORA_SCALE, grouped_spans
from loramux.benchmarks.kernels_gpu.timing import (
    BenchContext,
    free_device_memory,
    host_median_s,
    relative_error,
    run_case,
)
from loramux.engine.lora.adapter import LoRAWeights, ModuleWeights
from loramux.engine.lora.backend import KernelBackend, select_backend
from loramux.engine.lora.pool import LoRAPool
from loramux.engine.lora.torch_backend import TorchBackend
from loramux.engine.memory.arena import DeviceArena, RowLayout
from loramux.engine.memory.kv_cache import KVCacheManager
from loramux.engine.model.config import ModelConfig
from loramux.engine.model.llama import LORA_TARGETS, LlamaForCausalLM, StepAttention
from loramux.engine.model.loader import random_model
from loramux.engine.static_decode import DecodeStep, StaticDecode

# The Triton and reference steps round differently in every layer, and in bf16 the
# difference compounds with depth: on the CPU, bf16 against float32 moved these random
# models' output by 1.1e-2 after 2 layers, 2.0e-2 after 8 and 3.9e-2 after 32 (hidden
# 1024), 2.8e-2 after 8 at hidden 4096. The adapters move it by ~1 (``lora_effect``), so
# a wiring bug (a module without its delta, a wrong adapter) lands far above 0.15.
STEP_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.15, torch.float16: 0.15}
MEMORY_SLACK_BYTES = 4 << 30  # allocator fragmentation, the timer's flush buffer, cuBLAS


@dataclasses.dataclass(frozen=True)
class StepTarget:
    """A verdict on one LoRA variant: its step at most ``graph_ratio`` × the base step on
    the CUDA-graph path (eagerly where none was captured) and ``eager_ratio`` × eagerly."""

    key: str  # the verdict's key in the report
    adapters: int  # the variant it judges
    graph_ratio: float
    eager_ratio: float


@dataclasses.dataclass(frozen=True)
class StepCase:
    config: ModelConfig
    seqs: int
    new_tokens: int  # per sequence; 1: a decode step
    prefix: int  # tokens cached per sequence before the step
    rank: int
    adapter_counts: tuple[int, ...]
    block_size: int

    @property
    def decode(self) -> bool:
        return self.new_tokens == 1

    @property
    def length(self) -> int:
        return self.prefix + self.new_tokens

    @property
    def kv_blocks(self) -> int:
        return self.seqs * math.ceil(self.length / self.block_size)

    @property
    def arena_blocks(self) -> int:
        """Blocks of the shared KV + adapter arena: the contexts and every adapter's rows."""
        layout = RowLayout.for_model(self.config, 1, self.block_size)
        adapter_rows = max(self.adapter_counts, default=0) * self.rank
        # Rows are cut from element 0 of each layer's tensor; one block more covers the
        # rounding at the boundary between the two regions.
        return self.kv_blocks + math.ceil(adapter_rows * layout.row_width / layout.block_elems) + 1

    def targets(self) -> tuple[StepTarget, ...]:
        """Decode: each sequence its own adapter (≤ 1.25× the base step on the CUDA-graph
        path), or one for all (≤ 1.10×), both ≤ 1.5× eagerly; prefill: its own (≤ 1.15×)."""
        if not self.decode:
            return (StepTarget("prefill_step_adapters", self.seqs, 1.15, 1.15),)
        return (
            StepTarget("decode_step_distinct_adapters", self.seqs, 1.25, 1.5),
            StepTarget("decode_step_one_adapter", 1, 1.10, 1.5),
        )


@dataclasses.dataclass
class _Setup:
    model: LlamaForCausalLM
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    input_ids: torch.Tensor
    # (backend, its attention plan of the step): the engine's choice for the device (Triton
    # on CUDA), and the torch backend for the correctness check
    measured: tuple[KernelBackend, StepAttention]
    reference: tuple[KernelBackend, StepAttention]
    pool: LoRAPool
    static: StaticDecode | None = None  # decode: the engine's fixed-buffer path
    step: DecodeStep | None = None  # decode: the step's host lists, as the runner hands them


def layer_params(config: ModelConfig) -> int:
    return sum(math.prod(config.module_shape(m)) for m in LORA_TARGETS)


def lora_row_width(config: ModelConfig) -> int:
    """Σ(in + out) over the seven modules: what one rank-row's A and B hold, per layer."""
    return sum(sum(config.module_shape(m)) for m in LORA_TARGETS)


def fit_layers(case: StepCase) -> int:
    """The most layers (≤ the case's) whose weights and arena fit the free memory."""
    config = case.config
    if not torch.cuda.is_available():
        return config.num_layers
    block_bytes = 2 * case.block_size * config.kv_size * 2  # keys and values, bf16 on the GPU
    per_layer = layer_params(config) * 2 + case.arena_blocks * block_bytes
    # Embedding + LM head, and the reference check's gathered contexts of one layer.
    embeddings = 2 * config.vocab_size * config.hidden_size * 2
    fixed = embeddings + case.kv_blocks * block_bytes + MEMORY_SLACK_BYTES
    free, _ = torch.cuda.mem_get_info()
    return max(0, min(config.num_layers, int((free - fixed) // per_layer)))


def random_adapter(config: ModelConfig, rank: int, name: str, ctx: BenchContext) -> LoRAWeights:
    """Rank-``rank`` LoRA on all seven modules of every layer, made on the device. A ~
    N(0, 1/in) and B ~ N(0, 1/r) give a delta as large as the base projection's output, so
    a wrong delta shows in the step's output check."""
    modules = {}
    for module in LORA_TARGETS:
        in_features, out_features = config.module_shape(module)
        weights = ModuleWeights(rank=rank, scale=LORA_SCALE)
        for layer in range(config.num_layers):
            a = torch.randn(rank, in_features, dtype=ctx.dtype, device=ctx.device)
            b = torch.randn(out_features, rank, dtype=ctx.dtype, device=ctx.device)
            weights.a[layer] = a * in_features**-0.5
            weights.b[layer] = b * rank**-0.5
        modules[module] = weights
    return LoRAWeights(name=name, modules=modules)


def _setup(case: StepCase, ctx: BenchContext) -> _Setup:
    config = case.config
    model = random_model(config, dtype=ctx.dtype, device=ctx.device, seed=0)
    lengths = [case.length] * case.seqs
    tables = shuffled_block_tables(lengths, case.block_size)
    # The engine's memory: one arena for KV blocks (bottom) and adapter rows (top), a KV
    # manager whose floor keeps the contexts' blocks, and the pool over both.
    blocks, block_size = case.arena_blocks, case.block_size
    arena = DeviceArena(config, blocks, block_size, ctx.dtype, ctx.device, scratch_blocks=1)
    kv = KVCacheManager(blocks, block_size, False, min_limit=case.kv_blocks)
    pool = LoRAPool(config, arena, kv)
    for adapter_id in range(max(case.adapter_counts, default=0)):  # only the pool keeps them
        pool.load(adapter_id, random_adapter(config, case.rank, f"bench-{adapter_id}", ctx))
    for k_cache, v_cache in arena.kv_caches:  # the contexts: blocks below the adapters' rows
        k_cache[: case.kv_blocks].normal_()
        v_cache[: case.kv_blocks].normal_()
    backends = (select_backend(ctx.device, ctx.dtype), TorchBackend(ctx.device))
    plan = (tables, lengths, [case.new_tokens] * case.seqs, block_size, ctx.device)
    measured, reference = ((backend, backend.plan_attention(*plan)) for backend in backends)
    if measured[0].name != "triton":
        raise RuntimeError("the step benchmark measures the Triton kernels (CUDA or interpreter)")
    tokens = case.seqs * case.new_tokens
    input_ids = torch.randint(0, config.vocab_size, (tokens,), device=ctx.device)
    setup = _Setup(model, arena.kv_caches, input_ids, measured, reference, pool)
    if case.decode:
        setup.static = StaticDecode(
            model,
            arena.kv_caches,
            pool,
            measured[0],
            block_size=block_size,
            max_context_len=case.length,
            buckets=[case.seqs],
            max_rank=max(case.rank, 1),
            scratch_slot=arena.scratch_slot,
            capture=ctx.device.type == "cuda",
        )
        setup.step = DecodeStep(input_ids.tolist(), lengths, tables, lora=None)
    return setup


def _lora_step(setup: _Setup, backend: KernelBackend, spans: list):
    """The step's LoRA as the runner builds it: the pool's table of ``spans`` (None
    without any), then the backend's metadata."""
    table = setup.pool.step_table(spans)
    return None if table is None else backend.lora_step(table, setup.pool)


def _forward(setup: _Setup, kernels: tuple[KernelBackend, StepAttention], spans: list):
    """The step's hidden states, and its LoRA step (whose ``launches`` it counted)."""
    backend, attention = kernels
    lora = _lora_step(setup, backend, spans)
    return setup.model(setup.input_ids, attention, setup.kv_caches, lora), lora


def _traffic(case: StepCase, adapters: int, element_size: int) -> tuple[int, int]:
    """(bytes, flops) of the whole step by the module docstring's formulas."""
    c, n, tokens = case.config, case.new_tokens, case.seqs * case.new_tokens
    keys_seen = case.seqs * (n * case.prefix + n * (n + 1) // 2)  # query i at prefix + i
    num_bytes = (layer_params(c) + 2 * case.seqs * case.length * c.kv_size) * element_size
    flops = 2 * tokens * layer_params(c) + 4 * keys_seen * c.q_size
    if adapters:
        num_bytes += adapters * case.rank * lora_row_width(c) * element_size
        flops += 2 * tokens * case.rank * lora_row_width(c)
    return num_bytes * c.num_layers, flops * c.num_layers


def _measure(case: StepCase, setup: _Setup, adapters: int, base: dict, ctx: BenchContext) -> dict:
    spans = grouped_spans(case.seqs, case.new_tokens, list(range(adapters))) if adapters else []
    forward = partial(_forward, setup, setup.measured, spans)
    output, lora = forward()
    expected, _ = _forward(setup, setup.reference, spans)
    step_s = ctx.timer.median_s(forward, flush_l2=False)
    floor_s = ctx.rates.floor_s(*_traffic(case, adapters, ctx.dtype.itemsize))
    row = {
        "step_ms": step_s * 1e3,
        "floor_ms": floor_s * 1e3,
        "step_vs_floor": step_s / floor_s,
        "rel_err": relative_error(output, expected),
    }
    if case.decode:  # the static path computes the same step (it may round differently)
        step = dataclasses.replace(setup.step, lora=setup.pool.step_table(spans))
        graph_output = setup.static.run(step).clone()
        graph_s = ctx.timer.median_s(partial(setup.static.run, step), flush_l2=False)
        row |= {
            "graph_ms": graph_s * 1e3,
            "graph_captured": setup.static.captured,
            "graph_err": relative_error(graph_output, output),
        }
    row["matches"] = max(row["rel_err"], row.get("graph_err", 0)) < STEP_TOLERANCE[ctx.dtype]
    if not adapters:
        return row | {"output": output}  # for the LoRA variants' effect; not in the row
    layers, backend = case.config.num_layers, setup.measured[0]
    ratio = judged = step_s * 1e3 / base["step_ms"]
    row |= {
        "kernel": lora.form,  # the backend's form for the step
        "build_step_ms": host_median_s(partial(_lora_step, setup, backend, spans), 5) * 1e3,
        "base_ms": base["step_ms"],
        "base_floor_ms": base["floor_ms"],
        "overhead_pct": 100 * (ratio - 1),
        "lora_effect": relative_error(output, base["output"]),
        "launches_per_layer": lora.launches / layers,
    }
    if case.decode:
        count = setup.static.backend.lora_launches  # a replay adds its capture's launches
        before = count.total
        setup.static.run(step)
        graph_ratio = row["graph_ms"] / base["graph_ms"]
        row["graph_overhead_pct"] = 100 * (graph_ratio - 1)
        row["graph_launches_per_layer"] = (count.total - before) / layers
        if row["graph_captured"]:  # the engine replays graphs for decode steps
            judged = graph_ratio
    target = next((t for t in case.targets() if t.adapters == adapters), None)
    if target is None:
        return row | {"target": None, "target_pass": None}
    passed = judged <= target.graph_ratio and ratio <= target.eager_ratio
    return row | {"target": target.key, "target_pass": passed}


def run_step_case(case: StepCase, ctx: BenchContext) -> list[dict]:
    """The base step, then each LoRA variant against it; a set-up that fails is one row
    with its error."""
    layers, kv_heads = case.config.num_layers, case.config.num_kv_heads
    if case.decode:
        common = {"layers": layers, "kv_heads": kv_heads, "batch": case.seqs}
        common["context"] = case.prefix
    else:
        common = {"layers": layers, "kv_heads": kv_heads, "seqs": case.seqs}
        common["tokens"] = case.seqs * case.new_tokens
    try:
        setup = _setup(case, ctx)
    except Exception as exc:  # recorded in the row; the exit code reports it
        traceback.print_exc()
        free_device_memory()
        return [{**common, "variant": "setup", "matches": False, "error": repr(exc)}]
    with torch.inference_mode():
        base_fields = {**common, "variant": "base", "adapters": 0, "rank": 0}
        base = run_case(base_fields, lambda: _measure(case, setup, 0, {}, ctx))
        rows = [{k: v for k, v in base.items() if k != "output"}]
        for adapters in case.adapter_counts if "step_ms" in base else ():  # no base: no overhead
            fields = {**common, "variant": "lora", "adapters": adapters, "rank": case.rank}
            rows.append(run_case(fields, lambda n=adapters: _measure(case, setup, n, base, ctx)))
    return rows
