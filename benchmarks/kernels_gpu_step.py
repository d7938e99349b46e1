"""One full decode step of the engine's model, with LoRA on all seven modules and without.

The path measured is the engine's: ``LlamaForCausalLM.forward`` over the paged KV cache,
with the step's LoRA and attention plan from the engine's kernel backend (chosen as the
engine chooses it: Triton on CUDA) over ``LoRAPool.step_table``, as the runner builds them
(one ``LoRABatch`` per step, fused q/k/v and gate/up shrinks). Weights are random (the
cost does not depend on them), allocated on the device in the benchmark's dtype. Every
sequence has ``context`` tokens cached (random keys and values) and decodes one more. The
memory is the engine's: one ``DeviceArena`` per layer holds the contexts' KV blocks at the
bottom and the adapters' rank-rows at the top (``LoRAPool`` over a ``KVCacheManager``), so
the LoRA ops read strided row views of the KV tensors.

Variants: the base step (``lora=None``), then LoRA steps with 1, ..., ``batch`` distinct
adapters of rank ``rank`` (sequence i uses adapter ``i * n // batch``). Overhead =
(LoRA step − base step) / base step. The targets (``DECODE_TARGETS``): with rank 16 on
all seven modules at batch 64, a step with 64 distinct adapters at most 1.25× the base
step and one with a single adapter at most 1.10×, on the CUDA-graph path; eagerly, at
most 1.5× for both. ``build_step_ms`` is the host time of the step's LoRA metadata (the
pool's table and the backend's step, once per step, outside the forward);
``launches_per_layer`` the LoRA kernel launches the step made per layer, eagerly and
replayed (the backend's count).

Floor of a step, per layer (e element size, P the layer's projection weights, B tokens,
L = context + 1, r the rank, n distinct adapters, Σ(in + out) over the seven modules):

    base bytes  = e (P + 2 B L Hkv D)          weights once, each context's K and V once
    base flops  = 2 B P + 4 B L Hq D
    LoRA adds     e n r Σ(in + out) bytes      each distinct adapter's A and B rows once
                  2 B r Σ(in + out) flops

Correctness: each variant's output (final hidden states) against the same forward on the
torch backend (``LORAMUX_KERNELS=torch``'s ops, same dtype).

The engine runs decode-only steps on its static path (``loramux.engine.static_decode``):
the same forward over fixed buffers, replayed from a CUDA graph captured for the batch
size. ``graph_ms`` times that path as the engine takes it (filling the buffers from the
step's host lists, then the replay), ``graph_overhead_pct`` is its LoRA overhead, and
``graph_err`` its output against the eager step's. The target is judged on the graph
path where it was captured (on CUDA), else on the eager step. Without CUDA (``--smoke``)
the static path runs eagerly over its buffers.
"""

from __future__ import annotations

import dataclasses
import math
import traceback
from functools import partial

import torch

from loramux.benchmarks.kernels_gpu_attention import shuffled_block_tables
from loramux.benchmarks.kernels_gpu_lora import LORA_SCALE, grouped_spans
from loramux.benchmarks.kernels_gpu_timing import (
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
from loramux.engine.model.llama import LORA_TARGETS, LlamaForCausalLM, RMSNorm, StepAttention
from loramux.engine.static_decode import DecodeStep, StaticDecode

WEIGHT_STD = 0.02
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


def decode_targets(batch: int) -> tuple[StepTarget, ...]:
    """The decode step's targets at ``batch`` sequences: each its own adapter, or one."""
    return (
        StepTarget("decode_step_distinct_adapters", batch, 1.25, 1.5),
        StepTarget("decode_step_one_adapter", 1, 1.10, 1.5),
    )


@dataclasses.dataclass(frozen=True)
class StepCase:
    config: ModelConfig
    batch: int
    context: int  # tokens cached per sequence before the step
    rank: int
    adapter_counts: tuple[int, ...]
    targets: tuple[StepTarget, ...]
    block_size: int

    @property
    def kv_blocks(self) -> int:
        """The contexts' blocks: each sequence's cached tokens and its new one."""
        return self.batch * math.ceil((self.context + 1) / self.block_size)

    @property
    def arena_blocks(self) -> int:
        """Blocks of the shared KV + adapter arena: the contexts and every adapter's rows."""
        adapter_rows = max(self.adapter_counts, default=0) * self.rank
        return arena_blocks(self.config, self.kv_blocks, adapter_rows, self.block_size)


def arena_blocks(config: ModelConfig, kv_blocks: int, adapter_rows: int, block_size: int) -> int:
    """Blocks of an arena holding ``kv_blocks`` of KV and ``adapter_rows`` rank-rows."""
    layout = RowLayout.for_model(config, 1, block_size)
    # Rows are cut from element 0 of each layer's tensor; one block more covers the
    # rounding at the boundary between the two regions.
    return kv_blocks + math.ceil(adapter_rows * layout.row_width / layout.block_elems) + 1


@dataclasses.dataclass
class _Setup:
    model: LlamaForCausalLM
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    input_ids: torch.Tensor
    step: DecodeStep  # the step's host lists, as the runner hands them to the static path
    # (backend, its attention plan of the step): the engine's choice for the device (Triton
    # on CUDA), and the torch backend for the correctness check
    measured: tuple[KernelBackend, StepAttention]
    reference: tuple[KernelBackend, StepAttention]
    pool: LoRAPool
    static: StaticDecode  # the engine's fixed-buffer decode path over the same memory


def layer_params(config: ModelConfig) -> int:
    return sum(math.prod(config.module_shape(m)) for m in LORA_TARGETS)


def lora_row_width(config: ModelConfig) -> int:
    """Σ(in + out) over the seven modules: what one rank-row's A and B hold, per layer."""
    return sum(sum(config.module_shape(m)) for m in LORA_TARGETS)


def fit_layers(case) -> int:
    """The most layers (≤ the case's) whose weights and arena fit the free memory (a
    ``StepCase`` or a prefill step's case: ``config``, ``block_size``, ``arena_blocks``
    and ``kv_blocks``)."""
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


def build_random_model(config: ModelConfig, ctx: BenchContext) -> LlamaForCausalLM:
    """The engine's model with N(0, WEIGHT_STD²) projections, allocated on the device."""
    with torch.device("meta"):  # no host allocation, no host init: 13 GB at Llama-7B
        model = LlamaForCausalLM(config)
    model = model.to(dtype=ctx.dtype).to_empty(device=ctx.device)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, torch.nn.Linear | torch.nn.Embedding):
                module.weight.normal_(0.0, WEIGHT_STD)
    return model.eval()


def random_adapter(config: ModelConfig, rank: int, name: str, ctx: BenchContext) -> LoRAWeights:
    """Rank-``rank`` LoRA on all seven modules of every layer, made on the device.

    A ~ N(0, 1/in) and B ~ N(0, 1/r) give a delta as large as the base projection's
    output, so a wrong delta shows in the step's output check.
    """
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
    model = build_random_model(config, ctx)
    context_lens = [case.context + 1] * case.batch  # the cached tokens and the new one
    tables = shuffled_block_tables(context_lens, case.block_size)
    # The engine's memory: one arena for KV blocks (bottom) and adapter rows (top), a KV
    # manager whose floor keeps the contexts' blocks, and the pool over both.
    num_blocks = case.arena_blocks
    arena = DeviceArena(
        config, num_blocks, case.block_size, ctx.dtype, ctx.device, scratch_blocks=1
    )
    kv = KVCacheManager(num_blocks, case.block_size, False, min_limit=case.kv_blocks)
    pool = LoRAPool(config, arena, kv)
    for adapter_id in range(max(case.adapter_counts, default=0)):  # only the pool keeps them
        pool.load(adapter_id, random_adapter(config, case.rank, f"bench-{adapter_id}", ctx))
    for k_cache, v_cache in arena.kv_caches:  # the contexts: blocks below the adapters' rows
        k_cache[: case.kv_blocks].normal_()
        v_cache[: case.kv_blocks].normal_()
    backends = (select_backend(ctx.device, ctx.dtype), TorchBackend(ctx.device))
    plan = (tables, context_lens, [1] * case.batch, case.block_size, ctx.device)
    measured, reference = ((backend, backend.plan_attention(*plan)) for backend in backends)
    if measured[0].name != "triton":
        raise RuntimeError("the step benchmark measures the Triton kernels (CUDA or interpreter)")
    input_ids = torch.randint(0, config.vocab_size, (case.batch,), device=ctx.device)
    static = StaticDecode(
        model,
        arena.kv_caches,
        pool,
        measured[0],
        block_size=case.block_size,
        max_context_len=case.context + 1,
        buckets=[case.batch],
        max_rank=max(case.rank, 1),
        scratch_slot=arena.scratch_slot,
        capture=ctx.device.type == "cuda",
    )
    step = DecodeStep(input_ids.tolist(), context_lens, tables, lora=None)
    return _Setup(model, arena.kv_caches, input_ids, step, measured, reference, pool, static)


def _lora_step(setup: _Setup, backend: KernelBackend, spans: list):
    """The step's LoRA as the runner builds it: the pool's table of ``spans`` (None
    without any), then the backend's metadata."""
    table = setup.pool.step_table(spans)
    return None if table is None else backend.lora_step(table, setup.pool)


def _forward(
    setup: _Setup, kernels: tuple[KernelBackend, StepAttention], spans: list
) -> torch.Tensor:
    backend, attention = kernels
    lora = _lora_step(setup, backend, spans)
    return setup.model(setup.input_ids, attention, setup.kv_caches, lora)


def _step_traffic(case: StepCase, adapters: int, element_size: int) -> tuple[int, int]:
    """(bytes, flops) of the whole step by the module docstring's formulas."""
    c, length = case.config, case.context + 1
    kv_bytes = 2 * case.batch * length * c.kv_size * element_size
    num_bytes = layer_params(c) * element_size + kv_bytes
    flops = 2 * case.batch * layer_params(c) + 4 * case.batch * length * c.q_size
    if adapters:
        num_bytes += adapters * case.rank * lora_row_width(c) * element_size
        flops += 2 * case.batch * case.rank * lora_row_width(c)
    return num_bytes * c.num_layers, flops * c.num_layers


def _measure(case: StepCase, setup: _Setup, adapters: int, base: dict, ctx: BenchContext) -> dict:
    result: dict = {}
    spans = grouped_spans(case.batch, 1, list(range(adapters))) if adapters else []
    if adapters:
        build_step = partial(_lora_step, setup, setup.measured[0], spans)
        result["kernel"] = build_step().form  # the backend's form for the step
        result["build_step_ms"] = host_median_s(build_step, 5) * 1e3
    output = _forward(setup, setup.measured, spans)
    expected = _forward(setup, setup.reference, spans)
    step_s = ctx.timer.median_s(partial(_forward, setup, setup.measured, spans), flush_l2=False)
    step = dataclasses.replace(setup.step, lora=setup.pool.step_table(spans))
    graph_output = setup.static.run(step).clone()
    graph_s = ctx.timer.median_s(partial(setup.static.run, step), flush_l2=False)
    floor_s = ctx.rates.floor_s(*_step_traffic(case, adapters, ctx.dtype.itemsize))
    result |= {
        "step_ms": step_s * 1e3,
        "floor_ms": floor_s * 1e3,
        "step_vs_floor": step_s / floor_s,
        "rel_err": relative_error(output, expected),
        "graph_ms": graph_s * 1e3,
        "graph_captured": setup.static.captured,
        "graph_err": relative_error(graph_output, output),
    }
    if adapters:
        overhead = step_s * 1e3 / base["step_ms"] - 1
        graph_overhead = result["graph_ms"] / base["graph_ms"] - 1
        result |= {
            "base_ms": base["step_ms"],
            "base_floor_ms": base["floor_ms"],
            "overhead_pct": 100 * overhead,
            "graph_overhead_pct": 100 * graph_overhead,
            "lora_effect": relative_error(output, base["output"]),
            **_launches(case, setup, spans, step),
            **_judged(case, adapters, 1 + overhead, 1 + graph_overhead, result["graph_captured"]),
        }
    else:
        result["output"] = output  # for the LoRA variants' effect; dropped from the row
    # The static path computes the same step; it may round differently (padded shapes).
    result["matches"] = max(result["rel_err"], result["graph_err"]) < STEP_TOLERANCE[ctx.dtype]
    return result


def _launches(case: StepCase, setup: _Setup, spans: list, step: DecodeStep) -> dict:
    """LoRA kernel launches per layer of the eager step and of the static path's (what a
    replay makes: its capture's), as the backend counts them."""
    lora = _lora_step(setup, setup.measured[0], spans)
    setup.model(setup.input_ids, setup.measured[1], setup.kv_caches, lora)
    count = setup.static.backend.lora_launches
    before = count.total
    setup.static.run(step)
    layers = case.config.num_layers
    return {
        "launches_per_layer": lora.launches / layers,
        "graph_launches_per_layer": (count.total - before) / layers,
    }


def _judged(case: StepCase, adapters: int, ratio: float, graph_ratio: float, captured: bool):
    """The row's target (if a target judges this variant) and whether it passed."""
    target = next((t for t in case.targets if t.adapters == adapters), None)
    if target is None:
        return {"target": None, "target_pass": None}
    # The engine replays graphs for decode steps: judge that path where it exists.
    judged = graph_ratio if captured else ratio
    passed = judged <= target.graph_ratio and ratio <= target.eager_ratio
    return {"target": target.key, "target_pass": passed}


def run_step_case(case: StepCase, ctx: BenchContext) -> list[dict]:
    """The base step, then each LoRA variant against it."""
    common = {
        "layers": case.config.num_layers,
        "kv_heads": case.config.num_kv_heads,
        "batch": case.batch,
        "context": case.context,
    }
    return run_variants(case, ctx, common, _setup, _measure)


def run_variants(case, ctx: BenchContext, common: dict, setup, measure) -> list[dict]:
    """A step case's rows: the base step (``measure(case, built, 0, {}, ctx)``), then each
    of ``case.adapter_counts`` against it; a set-up that fails is one row with its error.
    ``setup(case, ctx)`` builds what ``measure`` reads."""
    try:
        built = setup(case, ctx)
    except Exception as exc:  # recorded in the row; the exit code reports it
        traceback.print_exc()
        free_device_memory()
        return [{**common, "variant": "setup", "matches": False, "error": repr(exc)}]
    with torch.inference_mode():
        base_fields = {**common, "variant": "base", "adapters": 0, "rank": 0}
        base = run_case(base_fields, lambda: measure(case, built, 0, {}, ctx))
        rows = [{k: v for k, v in base.items() if k != "output"}]
        for adapters in case.adapter_counts if "step_ms" in base else ():  # no base: no overhead
            fields = {**common, "variant": "lora", "adapters": adapters, "rank": case.rank}
            rows.append(run_case(fields, lambda n=adapters: measure(case, built, n, base, ctx)))
    return rows
