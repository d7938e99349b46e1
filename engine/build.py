"""What an engine is made of, built once from its config (``build_parts``).

The order matters where one part sizes another: the model and the draft model load first
(their weights are in the machine's memory when the budget is sized to it); the memory plan
(``memory/plan.py``) is worked out before anything is allocated; the arena, the KV manager
and the adapter pool are built from it; adapter residency before the scheduler, which asks
it; the executor last, over all of them. ``devices`` (one device, or the ranks of a
sharded model) builds the device side, so nothing here asks which it is.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from transformers import AutoTokenizer

from loramux.engine.clock import Clock
from loramux.engine.compute_threads import ThreadChoice, ThreadGovernor, apply_compute_threads
from loramux.engine.config import EngineConfig
from loramux.engine.errors import EngineError
from loramux.engine.executor import Devices, Executor, LocalExecutor
from loramux.engine.lora.backend import KernelBackend, select_backend
from loramux.engine.lora.dora import DoRAFold
from loramux.engine.lora.pool import LoRAPool
from loramux.engine.lora.residency import AdapterResidency
from loramux.engine.memory.arena import DeviceArena
from loramux.engine.memory.budget import kv_block_bytes
from loramux.engine.memory.kv_cache import KVCacheManager
from loramux.engine.memory.plan import MemoryPlan, plan_memory, requested_context
from loramux.engine.metrics import EngineMetrics
from loramux.engine.model.config import ModelConfig
from loramux.engine.model.llama import LlamaForCausalLM, install_native_rows
from loramux.engine.model.loader import load_model
from loramux.engine.model.quantized import describe_weights
from loramux.engine.native_decode import native_decode_for
from loramux.engine.observer import StepObserver
from loramux.engine.parallel.ranks import start_devices
from loramux.engine.prefill_budget import PrefillBudget
from loramux.engine.requests import RequestFactory
from loramux.engine.sampler import Sampler
from loramux.engine.scheduler import Scheduler, SchedulerLimits
from loramux.engine.speculative.draft_model import (
    DraftModelError,
    DraftModelProposer,
    check_draft_model,
)
from loramux.engine.speculative.speculator import Speculator
from loramux.engine.static_decode import STATIC_DTYPES, decode_buckets
from loramux.engine.step_execution import StepExecution
from loramux.engine.step_interrupt import StepInterrupt
from loramux.engine.structured_outputs import Grammars

logger = logging.getLogger("loramux.engine.engine")  # the start lines are the engine's


@dataclass
class EngineParts:
    """The engine's owners and what they share; ``Engine`` holds each as an attribute."""

    devices: Devices  # one device, the ranks of a sharded model, or a simulated device
    clock: Clock  # the wall clock, or in simulation the simulated one
    threads: ThreadChoice
    governor: ThreadGovernor | None  # one CPU process: threads follow the free cores
    backend: KernelBackend  # the kernels (Triton or torch), chosen once
    model: LlamaForCausalLM  # this device's share of it
    model_config: ModelConfig  # the whole model's
    tokenizer: object
    eos_token_ids: frozenset[int]
    grammars: Grammars
    draft_model: LlamaForCausalLM | None
    memory_plan: MemoryPlan  # the context limit too (Engine.max_model_len)
    arena: DeviceArena
    kv: KVCacheManager
    lora_pool: LoRAPool
    residency: AdapterResidency
    prefill_budget: PrefillBudget
    scheduler: Scheduler
    executor: Executor
    step_interrupt: StepInterrupt  # a higher-priority arrival cuts a step short
    speculator: Speculator | None
    metrics: EngineMetrics
    observer: StepObserver
    requests: RequestFactory
    execution: StepExecution


@dataclass
class _Model:
    model: LlamaForCausalLM
    config: ModelConfig  # the whole model's
    tokenizer: object
    eos_token_ids: frozenset[int]
    draft: LlamaForCausalLM | None


def build_parts(
    config: EngineConfig, metrics: EngineMetrics | None, devices: Devices | None = None
) -> EngineParts:
    """Every part of an engine of ``config`` (see the module doc). Where it runs is chosen
    here, once: one device, or the ranks of a sharded model (``engine/parallel``), whose
    other ranks start now and load their shards meanwhile; or the ``devices`` given (a
    simulated device, ``engine/simulation``)."""
    devices = start_devices(config) if devices is None else devices
    try:
        return _build_parts(config, devices, metrics)
    except BaseException:  # a refused setting, a budget too small: no ranks left behind
        devices.close()
        raise


def _build_parts(
    config: EngineConfig, devices: Devices, metrics: EngineMetrics | None
) -> EngineParts:
    # Over several CPU ranks, rank 0 takes its part of the threads like the others.
    threads = apply_compute_threads(devices.compute_threads)
    backend = select_backend(devices.device, config.torch_dtype, config.kernels)
    loaded = _load_models(config, devices, backend)
    plan, arena, kv, pool = _memory(config, devices, loaded.model, backend, loaded.draft)
    metrics = metrics or EngineMetrics()
    residency = AdapterResidency(
        loaded.config,
        pool,
        kv,
        metrics,
        config.lora,
        dtype=config.torch_dtype,
        pin_memory=devices.device.type == "cuda",
        advice=plan.advice(),
        clock=devices.clock,
    )
    executor = _executor(config, devices, loaded.model, arena, pool, backend, plan)
    prefill_budget, scheduler = _scheduler(config, kv, residency, executor.interruptible)
    speculator = _speculator(config, loaded, backend, plan)
    grammars = _grammars(config, loaded)
    observer = StepObserver(
        metrics,
        scheduler,
        kv,
        residency,
        plan,
        grammars,
        speculator,
        speculative_method=config.speculative_method,
        num_speculative_tokens=config.num_speculative_tokens,
        num_layers=loaded.config.num_layers,
        clock=devices.clock,
    )
    requests = RequestFactory(
        tokenizer=loaded.tokenizer,
        vocab_size=loaded.config.vocab_size,
        eos_token_ids=loaded.eos_token_ids,
        max_model_len=plan.max_model_len,
        device=config.torch_device,
        grammars=grammars,
        speculator=speculator,
        clock=devices.clock,
    )
    threads, governor = _governed(threads, devices, metrics)
    _log_start(config, loaded.model, threads, plan, grammars)
    step_interrupt = StepInterrupt()
    return EngineParts(
        devices=devices,
        clock=devices.clock,
        threads=threads,
        governor=governor,
        backend=backend,
        model=loaded.model,
        model_config=loaded.config,
        tokenizer=loaded.tokenizer,
        eos_token_ids=loaded.eos_token_ids,
        grammars=grammars,
        draft_model=loaded.draft,
        memory_plan=plan,
        arena=arena,
        kv=kv,
        lora_pool=pool,
        residency=residency,
        prefill_budget=prefill_budget,
        scheduler=scheduler,
        executor=executor,
        step_interrupt=step_interrupt,
        speculator=speculator,
        metrics=metrics,
        observer=observer,
        requests=requests,
        execution=StepExecution(
            executor, kv, pool, step_interrupt, prefill_budget, speculator, metrics, devices.clock
        ),
    )


def _grammars(config: EngineConfig, loaded: _Model) -> Grammars:
    """Structured outputs' compiler (built at the first request with a spec) and cache."""
    return Grammars(
        loaded.tokenizer,
        vocab_size=loaded.config.vocab_size,
        eos_token_ids=loaded.eos_token_ids,
        cache_bytes=config.grammar_cache_bytes,
        tenant_cache_bytes=config.grammar_cache_tenant_bytes,
    )


def _governed(threads: ThreadChoice, devices: Devices, metrics: EngineMetrics):
    """On one CPU process, the threads follow the cores other processes leave free."""
    governor = ThreadGovernor(threads.threads) if devices.governs_threads else None
    if governor is not None and governor.enabled:
        threads = dataclasses.replace(threads, governed=True)
    metrics.compute_threads.set(threads.threads)
    return threads, governor


def _memory(config: EngineConfig, devices: Devices, model, backend, draft):
    """The memory plan (worked out before anything is allocated), and built from it the
    arena (KV blocks and adapter rows), the KV block manager and the adapter pool."""
    plan = plan_memory(
        config,
        model.config,
        device=devices.device,
        static_decode=_runs_static_decode(config, backend, model.config),
        has_draft=draft is not None,
    )
    arena = devices.arena(
        model.config,
        plan.kv_blocks,
        config.block_size,
        config.torch_dtype,
        devices.device,
        scratch_blocks=plan.scratch_blocks,
        kv_cache_dtype=config.kv_cache_dtype,
        fold=DoRAFold(model),
    )
    kv = KVCacheManager(
        plan.kv_blocks,
        config.block_size,
        config.enable_prefix_caching,
        min_limit=plan.kv_floor_blocks,
        # Blocks out of every layer's window are released (not with a draft model, which
        # reads the same tables over all its keys).
        window=None if draft is not None else model.config.kv_window,
    )
    pool = LoRAPool(model.config, devices.adapter_rows(arena), kv, max_rows=plan.adapter_max_rows)
    return plan, arena, kv, pool


def _scheduler(
    config: EngineConfig, kv: KVCacheManager, residency: AdapterResidency, interruptible: bool
) -> tuple[PrefillBudget, Scheduler]:
    """The scheduler, asking residency about adapters and the prefill budget (prompt tokens
    per step, sized to the step's target time) about prompt tokens."""
    prefill_budget = PrefillBudget(
        config.step_target_s,
        max_tokens=config.max_num_batched_tokens,
        min_tokens=min(config.block_size, config.max_num_batched_tokens),
    )
    scheduler = Scheduler(
        SchedulerLimits(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_prefill_chunk=config.max_prefill_chunk,
            max_adapters_per_step=config.max_adapters_per_step,
            adapter_wait_steps=config.adapter_wait_steps,
        ),
        kv,
        adapters=residency,
        prompt_budget=prefill_budget.tokens,
        solo_steps=interruptible,
    )
    return prefill_budget, scheduler


def _load_models(config: EngineConfig, devices: Devices, backend: KernelBackend) -> _Model:
    """The model (this device's share, joined to the others'), its tokenizer and end
    tokens, and the draft model, checked against it."""
    # The backend's kernels run the quantized matmuls.
    model = devices.load_model(config, quant_op=backend.quant_linear)
    if backend.native_rows is not None:
        install_native_rows(model, backend.native_rows)
    whole = model.config if devices.shard is None else devices.shard.config
    tokenizer = AutoTokenizer.from_pretrained(config.model)
    eos = frozenset(whole.eos_token_ids) | (
        {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    )
    draft = None
    if config.speculative_method == "draft":
        draft = load_model(
            config.draft_model,
            dtype=config.torch_dtype,
            device=config.torch_device,
            load_format=config.load_format,
            seed=config.seed + 1,
        )
        try:  # the draft must cover the context asked for, before the plan caps it
            check_draft_model(draft, model, requested_context(config, whole))
        except DraftModelError as exc:
            raise EngineError(f"draft model {config.draft_model}: {exc}") from None
    return _Model(model, whole, tokenizer, eos, draft)


def _runs_static_decode(
    config: EngineConfig, backend: KernelBackend, model_config: ModelConfig
) -> bool:
    """Whether decode steps run over fixed buffers (CUDA graphs on CUDA): not for a
    mixture of experts, whose experts are chosen on the host from the routing."""
    return (
        config.cuda_graph_max_batch > 0
        and backend.static_decode
        and config.torch_dtype in STATIC_DTYPES
        and not any(model_config.moe_layers)
    )


def _executor(config, devices, model, arena, pool, backend, plan: MemoryPlan) -> Executor:
    """The executor over this device's model, arena and pool (over the ranks, theirs too)."""

    def local() -> LocalExecutor:  # built only where the model runs (not in simulation)
        return LocalExecutor(
            model,
            kv_caches=arena.kv_caches,
            block_size=config.block_size,
            lora_weights=pool,
            backend=backend,
            sampler=Sampler(config.seed),
            static_decode=_static_decode(config, devices, model, arena, pool, backend, plan),
            native_decode=native_decode_for(
                model, arena.kv_caches, config.block_size, backend.native_decode, pool
            ),
        )

    return devices.executor(local, pool)


def _static_decode(config, devices, model, arena, pool, backend, plan: MemoryPlan):
    """Fixed buffers for decode-only steps (their graphs captured now on CUDA), or None."""
    if not plan.scratch_blocks:  # the plan keeps a scratch block only for them
        return None
    return devices.static_decode(
        model,
        arena.kv_caches,
        pool,
        backend,
        block_size=config.block_size,
        max_context_len=plan.max_model_len,
        buckets=decode_buckets(min(config.cuda_graph_max_batch, config.max_num_seqs)),
        max_rank=config.max_lora_rank,
        scratch_slot=arena.scratch_slot,
        capture=config.torch_device.type == "cuda",
    )


def _speculator(config, loaded: _Model, backend, plan: MemoryPlan) -> Speculator | None:
    if config.speculative_method == "off":
        return None
    return Speculator(
        max_k=config.num_speculative_tokens,
        ngram_max_n=config.ngram_max_n,
        ngram_min_n=config.ngram_min_n,
        max_model_len=plan.max_model_len,
        draft=_draft_proposer(config, loaded, backend, plan),
    )


def _draft_proposer(config, loaded: _Model, backend, plan: MemoryPlan):
    """The draft model's proposer over its share of the budget (None without one)."""
    if loaded.draft is None:
        return None
    cache_bytes = plan.draft_kv_bytes
    block_bytes = kv_block_bytes(loaded.draft.config, config.block_size, config.torch_dtype)
    num_blocks = cache_bytes // block_bytes
    # A request whose context does not fit beside the others' just proposes nothing.
    tokens = num_blocks * config.block_size
    if tokens <= config.num_speculative_tokens:
        raise EngineError(
            f"the draft model's KV cache ({cache_bytes} bytes) holds {tokens} tokens: "
            "raise draft_kv_cache_bytes or kv_cache_bytes"
        )
    if tokens < plan.max_model_len:
        logger.warning(
            "the draft model's KV cache holds %d tokens, less than max_model_len %d: "
            "longer requests do not speculate (raise draft_kv_cache_bytes)",
            tokens,
            plan.max_model_len,
        )
    logger.info("draft model %s: KV cache of %d tokens", config.draft_model, tokens)
    proposer = DraftModelProposer(
        loaded.draft,
        backend,
        num_blocks=num_blocks,
        block_size=config.block_size,
        seed=config.seed,
    )
    proposer.cost_relative_to(loaded.model)
    return proposer


def _log_start(config, model, threads: ThreadChoice, plan: MemoryPlan, grammars) -> None:
    """What the engine holds, logged at start (defaults are part of the product)."""
    logger.info(describe_weights(model, config))
    logger.info(threads.describe())
    for line in plan.describe():
        logger.info(line)
    logger.info(grammars.describe())
