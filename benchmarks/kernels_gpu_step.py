"""One full decode step of the engine's model, with LoRA on all seven modules and without.

The path measured is the engine's: ``LlamaForCausalLM.forward`` over the paged KV cache,
with the step's LoRA and attention plan from the engine's kernel backend (chosen as the
engine chooses it: Triton on CUDA) over ``LoRAPool.step_table``, as the runner builds them
(one ``LoRABatch`` per step, fused q/k/v and gate/up shrinks). Weights are random (no model hub; the cost is the same): allocated on the
device in the benchmark's dtype, never initialised on the host. Every sequence has
``context`` tokens cached (random keys and values) and decodes one more.

The memory is the engine's: one ``DeviceArena`` per layer holds the contexts' KV blocks
at the bottom and the adapters' rank-rows at the top (``LoRAPool`` over a
``KVCacheManager``), so the LoRA ops read strided row views of the KV tensors, as in the
engine.

Variants: the base step (``lora=None``), then LoRA steps with 1, ..., ``batch`` distinct
adapters of rank ``rank`` (sequence i uses adapter ``i * n // batch``). Overhead =
(LoRA step − base step) / base step; the target: ≤ 15% with rank 16 and 64
distinct adapters at batch 64. ``build_step_ms`` is the host time of the step's LoRA
metadata (the pool's table and the backend's step, once per step, outside the forward).

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

import math
import time
import traceback
from dataclasses import dataclass
from functools import partial

import torch

from loramux.benchmarks.bench_gpu_model import LLAMA_7B
from loramux.benchmarks.kernels_gpu_attention import shuffled_block_tables
from loramux.benchmarks.kernels_gpu_lora import grouped_spans
from loramux.benchmarks.kernels_gpu_timing import (
    BenchContext,
    free_device_memory,
    relative_error,
    run_case,
)
from loramux.engine.kv_cache import KVCacheManager
from loramux.engine.lora.adapter import LoRAWeights, ModuleWeights
from loramux.engine.lora.backend import KernelBackend, select_backend
from loramux.engine.lora.device_arena import DeviceArena, RowLayout
from loramux.engine.lora.pool import LoRAPool
from loramux.engine.lora.torch_backend import TorchBackend
from loramux.engine.model.config import ModelConfig
from loramux.engine.model.llama import LORA_TARGETS, LlamaForCausalLM, RMSNorm, StepAttention
from loramux.engine.static_decode import DecodeStep, StaticDecode

WEIGHT_STD = 0.02
LORA_SCALE = 0.5
TARGET_OVERHEAD = 0.15
# The Triton and reference steps round differently in every layer, and in bf16 the
# difference compounds with depth: on the CPU, bf16 against float32 moved these random
# models' output by 1.1e-2 after 2 layers, 2.0e-2 after 8 and 3.9e-2 after 32 (hidden
# 1024), 2.8e-2 after 8 at hidden 4096. The adapters move it by ~1 (``lora_effect``), so
# a wiring bug (a module without its delta, a wrong adapter) lands far above 0.15.
STEP_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.15, torch.float16: 0.15}
MEMORY_SLACK_BYTES = 4 << 30  # allocator fragmentation, the timer's flush buffer, cuBLAS


@dataclass(frozen=True)
class StepCase:
    config: ModelConfig
    batch: int
    context: int  # tokens cached per sequence before the step
    rank: int
    adapter_counts: tuple[int, ...]
    target_adapters: int | None  # the LoRA variant the target judges (None: no target)
    block_size: int


@dataclass
class _Backend:
    """A kernel backend and the step's attention plan built by it."""

    backend: KernelBackend
    attention: StepAttention


@dataclass
class _Setup:
    model: LlamaForCausalLM
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    input_ids: torch.Tensor
    block_tables: list[list[int]]
    context_lens: list[int]
    measured: _Backend  # the engine's choice for the device (Triton on CUDA)
    reference: _Backend  # the torch backend, for the correctness check
    pool: LoRAPool
    static: StaticDecode  # the engine's fixed-buffer decode path over the same memory


def llama_config(*, num_layers: int, kv_heads: int, **shape) -> ModelConfig:
    """Llama-7B's shape (``bench_gpu_model.LLAMA_7B``) with ``num_layers`` layers and
    ``kv_heads`` KV heads (32, or 8 for a GQA variant); ``shape`` overrides HF fields."""
    hf_config = {**LLAMA_7B, "num_hidden_layers": num_layers, "num_key_value_heads": kv_heads}
    return ModelConfig.from_hf_dict({**hf_config, **shape})


def _lora_row_width(config: ModelConfig) -> int:
    """Σ(in + out) over the seven target modules: what one rank-row's A and B hold."""
    return sum(sum(config.module_shape(m)) for m in LORA_TARGETS)


def _layer_params(config: ModelConfig) -> int:
    return sum(math.prod(config.module_shape(m)) for m in LORA_TARGETS)


def fit_layers(
    config: ModelConfig, requested: int, batch: int, context: int, adapter_rows: int, block: int
) -> int:
    """The most layers (≤ ``requested``) whose weights and arena fit the free memory."""
    if not torch.cuda.is_available():
        return requested
    e = 2  # the GPU run is bf16
    kv_blocks = batch * math.ceil((context + 1) / block)
    arena_blocks = _arena_blocks(config, block, kv_blocks, adapter_rows)
    arena_layer = 2 * arena_blocks * block * config.kv_size * e  # keys and values
    per_layer = _layer_params(config) * e + arena_layer
    # Embedding + LM head, and the reference check's gathered contexts of one layer.
    gathered = 2 * kv_blocks * block * config.kv_size * e
    fixed = 2 * config.vocab_size * config.hidden_size * e + gathered + MEMORY_SLACK_BYTES
    free, _ = torch.cuda.mem_get_info()
    return max(0, min(requested, int((free - fixed) // per_layer)))


def build_random_model(
    config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> LlamaForCausalLM:
    """The engine's model with N(0, WEIGHT_STD²) projections, allocated on ``device``."""
    with torch.device("meta"):  # no host allocation, no host init: 13 GB at Llama-7B
        model = LlamaForCausalLM(config)
    model = model.to(dtype=dtype).to_empty(device=device)
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
    model = build_random_model(config, ctx.device, ctx.dtype)
    context_lens = [case.context + 1] * case.batch  # the cached tokens and the new one
    tables = shuffled_block_tables(context_lens, case.block_size)
    kv_blocks = sum(map(len, tables))
    num_adapters = max(case.adapter_counts, default=0)
    arena, pool = _adapter_pool(config, case, kv_blocks, num_adapters * case.rank, ctx)
    for adapter_id in range(num_adapters):  # one at a time: only the pool keeps them
        pool.load(adapter_id, random_adapter(config, case.rank, f"bench-{adapter_id}", ctx))
    for k_cache, v_cache in arena.kv_caches:  # the contexts: blocks below the adapters' rows
        k_cache[:kv_blocks].normal_()
        v_cache[:kv_blocks].normal_()
    backends = []
    for backend in (select_backend(ctx.device, ctx.dtype), TorchBackend(ctx.device)):
        attention = backend.plan_attention(
            tables, context_lens, [1] * case.batch, case.block_size, ctx.device
        )
        backends.append(_Backend(backend, attention))
    measured, reference = backends
    if measured.backend.name != "triton":
        raise RuntimeError(
            "the step benchmark measures the Triton kernels: CUDA or the interpreter"
        )
    input_ids = torch.randint(0, config.vocab_size, (case.batch,), device=ctx.device)
    static = StaticDecode(
        model,
        arena.kv_caches,
        pool,
        measured.backend,
        block_size=case.block_size,
        max_context_len=case.context + 1,
        buckets=[case.batch],
        max_rank=max(case.rank, 1),
        scratch_slot=arena.scratch_slot,
        capture=ctx.device.type == "cuda",
    )
    return _Setup(
        model, arena.kv_caches, input_ids, tables, context_lens, measured, reference, pool, static
    )


def _arena_blocks(config: ModelConfig, block_size: int, kv_blocks: int, adapter_rows: int) -> int:
    """Blocks of a shared KV + adapter arena holding ``kv_blocks`` and ``adapter_rows``."""
    layout = RowLayout.for_model(config, 1, block_size)
    # Rows are cut from element 0 of each layer's tensor; one block more covers the
    # rounding at the boundary between the two regions.
    return kv_blocks + math.ceil(adapter_rows * layout.row_width / layout.block_elems) + 1


def _adapter_pool(
    config: ModelConfig, case: StepCase, kv_blocks: int, adapter_rows: int, ctx: BenchContext
) -> tuple[DeviceArena, LoRAPool]:
    """The engine's memory: one arena for KV blocks (bottom) and adapter rows (top), a KV
    manager whose floor keeps the contexts' blocks, and the pool over both."""
    num_blocks = _arena_blocks(config, case.block_size, kv_blocks, adapter_rows)
    arena = DeviceArena(
        config, num_blocks, case.block_size, ctx.dtype, ctx.device, scratch_blocks=1
    )
    kv = KVCacheManager(num_blocks, case.block_size, False, min_limit=kv_blocks)
    return arena, LoRAPool(config, arena, kv)


def _forward(setup: _Setup, kernels: _Backend, spans: list) -> torch.Tensor:
    """The step's forward on ``kernels``, its LoRA built from the pool's table of ``spans``."""
    table = setup.pool.step_table(spans) if spans else None
    lora = None if table is None else kernels.backend.lora_step(table, setup.pool)
    return setup.model(setup.input_ids, kernels.attention, setup.kv_caches, lora)


def _lora_metadata(setup: _Setup, spans: list):
    return setup.measured.backend.lora_step(setup.pool.step_table(spans), setup.pool)


def _step_traffic(case: StepCase, adapters: int, element_size: int) -> tuple[int, int]:
    """(bytes, flops) of the whole step by the module docstring's formulas."""
    c, length = case.config, case.context + 1
    kv_bytes = 2 * case.batch * length * c.kv_size * element_size
    num_bytes = _layer_params(c) * element_size + kv_bytes
    flops = 2 * case.batch * _layer_params(c) + 4 * case.batch * length * c.q_size
    if adapters:
        num_bytes += adapters * case.rank * _lora_row_width(c) * element_size
        flops += 2 * case.batch * case.rank * _lora_row_width(c)
    return num_bytes * c.num_layers, flops * c.num_layers


def _graph_step(setup: _Setup, spans: list) -> DecodeStep:
    """The step as the runner hands it to the static path (host lists)."""
    return DecodeStep(
        token_ids=setup.input_ids.tolist(),
        context_lens=setup.context_lens,
        block_tables=setup.block_tables,
        lora=setup.pool.step_table(spans) if spans else None,
    )


def _measure_graph(setup: _Setup, spans: list, output: torch.Tensor, ctx: BenchContext) -> dict:
    step = _graph_step(setup, spans)
    graph_output = setup.static.run(step).clone()
    return {
        "graph_ms": ctx.timer.median_s(partial(setup.static.run, step), flush_l2=False) * 1e3,
        "graph_captured": setup.static.captured,
        "graph_err": relative_error(graph_output, output),
    }


def _measure(case: StepCase, setup: _Setup, adapters: int, base: dict, ctx: BenchContext) -> dict:
    result: dict = {}
    spans: list = []
    if adapters:
        spans = grouped_spans(case.batch, 1, list(range(adapters)))
        lora = _lora_metadata(setup, spans)
        result["kernel"] = "bgmv" if lora.batch.is_decode else "sgmv"
        result["build_step_ms"] = _host_median_s(partial(_lora_metadata, setup, spans)) * 1e3
    output = _forward(setup, setup.measured, spans)
    expected = _forward(setup, setup.reference, spans)
    step_s = ctx.timer.median_s(partial(_forward, setup, setup.measured, spans), flush_l2=False)
    num_bytes, flops = _step_traffic(case, adapters, ctx.element_size)
    floor_s = ctx.rates.floor_s(num_bytes, flops)
    result |= {
        "step_ms": step_s * 1e3,
        "floor_ms": floor_s * 1e3,
        "step_vs_floor": step_s / floor_s,
        "rel_err": relative_error(output, expected),
        **_measure_graph(setup, spans, output, ctx),
    }
    if adapters:
        overhead = step_s * 1e3 / base["step_ms"] - 1
        graph_overhead = result["graph_ms"] / base["graph_ms"] - 1
        # The engine replays graphs for decode steps: judge that path where it exists.
        judged = graph_overhead if result["graph_captured"] else overhead
        is_target = adapters == case.target_adapters
        result |= {
            "base_ms": base["step_ms"],
            "overhead_pct": 100 * overhead,
            "graph_overhead_pct": 100 * graph_overhead,
            "lora_effect": relative_error(output, base["output"]),
            "target": is_target,
            "target_pass": judged <= TARGET_OVERHEAD if is_target else None,
        }
    else:
        result["output"] = output  # for the LoRA variants' effect; dropped from the row
    # The static path computes the same step; it may round differently (padded shapes).
    result["matches"] = max(result["rel_err"], result["graph_err"]) < STEP_TOLERANCE[ctx.dtype]
    return result


def _host_median_s(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
    return sorted(times)[len(times) // 2]


def run_step_case(case: StepCase, ctx: BenchContext) -> list[dict]:
    common = {
        "layers": case.config.num_layers,
        "kv_heads": case.config.num_kv_heads,
        "batch": case.batch,
        "context": case.context,
    }
    try:
        setup = _setup(case, ctx)
    except Exception as exc:  # recorded in the row; the exit code reports it
        traceback.print_exc()
        free_device_memory()
        return [{**common, "variant": "setup", "matches": False, "error": repr(exc)}]
    return _run_variants(case, setup, common, ctx)


def _run_variants(case: StepCase, setup: _Setup, common: dict, ctx: BenchContext) -> list[dict]:
    """The base step, then each LoRA variant against it."""
    with torch.inference_mode():
        base_fields = {**common, "variant": "base", "adapters": 0, "rank": 0}
        base = run_case(base_fields, lambda: _measure(case, setup, 0, {}, ctx))
        rows = [{k: v for k, v in base.items() if k != "output"}]
        lora_counts = case.adapter_counts if "step_ms" in base else ()  # no base, no overhead
        for adapters in lora_counts:
            fields = {**common, "variant": "lora", "adapters": adapters, "rank": case.rank}
            rows.append(run_case(fields, lambda n=adapters: _measure(case, setup, n, base, ctx)))
    return rows
