"""The engine loop and its public Python API.

    engine = Engine(EngineConfig(model="path/to/hf-dir"))
    engine.add_adapter("support-bot", "path/to/peft-dir")
    outs = engine.generate(["Hi", [1, 2, 3]], SamplingParams(max_tokens=32, temperature=0),
                           adapters=["support-bot", None])

Low level: ``add_request`` / ``step`` / ``abort``. One ``step()`` takes finished adapter
loads, makes the adapters of waiting requests device-resident where there is room, asks
the scheduler what to run, has the runner run it, and applies the results.

Adapters live in three tiers (``loramux.engine.lora.tiers``): registered ones in their
source (the object store), recently used ones in host RAM, the ones in use on the device,
in rows that share one budget with the KV cache. ``register_adapter(name, source)``
makes an adapter servable without loading it; a request for a cold adapter waits in the
queue while a background thread loads it, and the steps go on meanwhile.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import operator
import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from pathlib import Path

from transformers import AutoTokenizer

from loramux.engine.compute_threads import ThreadGovernor, apply_compute_threads
from loramux.engine.config import EngineConfig
from loramux.engine.detokenizer import IncrementalDetokenizer
from loramux.engine.errors import AdapterInUse, EngineError, UnknownAdapter
from loramux.engine.executor import LocalExecutor, NonFiniteOutput
from loramux.engine.isolation import IsolatedStep, run_isolated
from loramux.engine.lora.adapter import LoRARequest, load_adapter
from loramux.engine.lora.backend import select_backend
from loramux.engine.lora.host_cache import HostAdapterCache, HostCacheFull
from loramux.engine.lora.loader import AdapterLoader
from loramux.engine.lora.pool import LoRAPool
from loramux.engine.lora.source import (
    AdapterDiskCache,
    AdapterSource,
    DiskCachedSource,
    LocalDirectorySource,
)
from loramux.engine.lora.tiers import AdapterTiers
from loramux.engine.memory.budget import kv_block_bytes
from loramux.engine.memory.kv_cache import KVCacheManager
from loramux.engine.memory.plan import plan_memory
from loramux.engine.metrics import EngineMetrics
from loramux.engine.model.llama import LlamaForCausalLM
from loramux.engine.model.loader import load_model
from loramux.engine.model.quantized import describe_weights
from loramux.engine.outputs import RequestOutput
from loramux.engine.parallel.ranks import start_devices
from loramux.engine.prefill_budget import PrefillBudget
from loramux.engine.residency import ResidencyCounts, ResidencyWatch
from loramux.engine.sampler import Sampler, make_generator
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.scheduler import AdapterRoom, Scheduler, SchedulerLimits, SchedulerOutput
from loramux.engine.sequence import ErrorKind, FinishReason, Sequence
from loramux.engine.speculative.draft_model import (
    DraftModelError,
    DraftModelProposer,
    check_draft_model,
)
from loramux.engine.speculative.speculator import Speculator
from loramux.engine.static_decode import STATIC_DTYPES, StaticDecode, decode_buckets
from loramux.engine.stats import EngineStats, LatencyRecorder, SpeculationStats, tier_stats
from loramux.engine.step_batch import build_step_batch
from loramux.engine.step_interrupt import StepInterrupt, StepInterrupted
from loramux.engine.structured import CompiledGrammar, GrammarError, StructuredSpec
from loramux.engine.structured_outputs import Grammars
from loramux.engine.tenant_share import TenantShare, TenantShareStats

logger = logging.getLogger(__name__)

TENANT_GAUGES_EVERY_S = 1.0


def _adapter_label(seq: Sequence) -> str:
    """The metrics' adapter label: its name, or the empty string for the base model."""
    return "" if seq.lora is None else seq.lora.name


def _token_id(value) -> int:
    """An int token id; floats, bools and strings are refused, not coerced."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)  # int, numpy / 0-d torch integers
    except TypeError:
        raise EngineError(f"prompt token ids must be integers, got {value!r}") from None


class Engine:
    def __init__(self, config: EngineConfig, *, metrics: EngineMetrics | None = None):
        self.config = config
        # One device, or the ranks of a sharded model (engine/parallel/): chosen here, once;
        # it builds the device side.
        self.devices = start_devices(config)
        try:
            self._build(config, metrics)
        except BaseException:  # a refused setting, a budget too small: no ranks left behind
            self.devices.close()
            raise

    def _build(self, config: EngineConfig, metrics: EngineMetrics | None) -> None:
        devices = self.devices
        device, dtype, shard = devices.device, config.torch_dtype, devices.shard
        # Over several CPU ranks, rank 0 takes its part of the threads like the others.
        self.threads = apply_compute_threads(devices.compute_threads)
        # The kernels (Triton or torch) are chosen here, once, and handed to what runs ops:
        # the model's quantized matmul first.
        self.backend = select_backend(device, dtype)
        self.model = load_model(
            config.model,
            dtype=dtype,
            device=device,
            load_format=config.load_format,
            seed=config.seed,
            quantization=config.quantization,
            group_size=config.quantization_group_size,
            gguf_file=config.gguf_file,
            quant_op=self.backend.quant_linear,
            shard=shard,
        )
        # The whole model's config; ``self.model.config`` (what the arena and the adapter
        # pool are built from) is this rank's share of it.
        self.model_config = self.model.config if shard is None else shard.config
        devices.join(self.model)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        # Structured outputs' compiler: built at the first request that has a spec.
        self.grammars = Grammars(
            self.tokenizer,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=self.eos_token_ids,
            cache_bytes=config.grammar_cache_bytes,
            tenant_cache_bytes=config.grammar_cache_tenant_bytes,
        )
        # Before the budget is sized: its weights are in the machine's memory too.
        self.draft_model = (
            self._load_draft_model() if config.speculative_method == "draft" else None
        )
        # How the device memory is laid out (memory/plan.py): the budget (kv_cache_bytes, or
        # sized to the machine now the weights are in) is one for KV blocks and resident
        # adapters (S-LoRA's unified paging: the arena's k/v tensors, KV blocks from the
        # bottom, adapter rows from the top). The static decode path (CUDA graphs) pads its
        # batches with rows that write to a scratch block of the budget's.
        static_decode = (
            config.cuda_graph_max_batch > 0
            and self.backend.static_decode
            and dtype in STATIC_DTYPES
        )
        plan = plan_memory(
            config,
            self.model.config,
            device=device,
            static_decode=static_decode,
            has_draft=self.draft_model is not None,
        )
        self.memory_plan = plan
        self.max_model_len = plan.max_model_len
        self.arena = self.devices.arena(
            self.model.config,
            plan.kv_blocks,
            config.block_size,
            dtype,
            device,
            scratch_blocks=plan.scratch_blocks,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        self.kv = KVCacheManager(
            plan.kv_blocks,
            config.block_size,
            config.enable_prefix_caching,
            min_limit=plan.kv_floor_blocks,
        )
        self.lora_pool = LoRAPool(
            self.model.config,
            self.devices.adapter_rows(self.arena),
            self.kv,
            max_rows=plan.adapter_max_rows,
        )
        # Prompt tokens per step, sized to the step's target time (prefill_budget.py).
        self.prefill_budget = PrefillBudget(
            config.step_target_s,
            max_tokens=config.max_num_batched_tokens,
            min_tokens=min(config.block_size, config.max_num_batched_tokens),
        )
        self.scheduler = Scheduler(
            SchedulerLimits(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_prefill_chunk=config.max_prefill_chunk,
                max_adapters_per_step=config.max_adapters_per_step,
                adapter_wait_steps=config.adapter_wait_steps,
            ),
            self.kv,
            adapter_ready=self.lora_pool.is_resident,
            prompt_budget=self.prefill_budget.tokens,
        )
        self.executor = self.devices.executor(
            LocalExecutor(
                self.model,
                kv_caches=self.arena.kv_caches,
                block_size=config.block_size,
                lora_weights=self.lora_pool,
                backend=self.backend,
                sampler=Sampler(config.seed),
                static_decode=self._static_decode() if static_decode else None,
            )
        )
        self.step_interrupt = StepInterrupt()  # a higher-priority arrival cuts a step short
        self.speculator = (
            None
            if config.speculative_method == "off"
            else Speculator(
                max_k=config.num_speculative_tokens,
                ngram_max_n=config.ngram_max_n,
                ngram_min_n=config.ngram_min_n,
                max_model_len=self.max_model_len,
                draft=self._draft_proposer(plan.draft_kv_bytes),
            )
        )
        self.metrics = metrics or EngineMetrics()
        self.metrics.kv_blocks_total.set(plan.kv_blocks)
        self.metrics.watch_grammar_cache(self.grammars)  # read when scraped
        self.tiers = AdapterTiers(
            self.lora_pool,
            HostAdapterCache(config.adapter_host_bytes),
            AdapterLoader(
                self.model_config,
                dtype=dtype,
                max_rank=config.max_lora_rank,
                pin_memory=device.type == "cuda",
                workers=config.adapter_load_workers,
            ),
            self.metrics,
        )
        self._disk_cache = (
            None
            if config.adapter_disk_cache_dir is None
            else AdapterDiskCache(
                Path(config.adapter_disk_cache_dir), config.adapter_disk_cache_bytes
            )
        )
        self._adapter_ids = itertools.count(1)
        self._requests: dict[str, Sequence] = {}
        self._request_ids = itertools.count()
        self._prefix_stats = (0, 0)
        self._speculation: dict[str, SpeculationStats] = {}  # adapter label -> totals
        self.latencies = LatencyRecorder()  # recent TTFT / ITL for stats()
        self._tenant_priorities: dict[str | None, int] = {}  # as last set, for stats()
        self.tenant_share = TenantShare()  # tokens served per tenant, as steps serve them
        self._tenant_gauges_at = -math.inf  # when the per-tenant gauges were last set
        # On one CPU process, the threads follow the cores other processes leave free.
        self.governor = ThreadGovernor(self.threads.threads) if devices.governs_threads else None
        if self.governor is not None and self.governor.enabled:
            self.threads = dataclasses.replace(self.threads, governed=True)
        self.metrics.compute_threads.set(self.threads.threads)
        logger.info(describe_weights(self.model, config))
        logger.info(self.threads.describe())
        for line in self.memory_plan.describe():
            logger.info(line)
        logger.info(self.grammars.describe())
        self.residency_watch = ResidencyWatch(advice=self.memory_plan.advice(), log=logger)

    def _load_draft_model(self) -> LlamaForCausalLM:
        config = self.config
        draft = load_model(
            config.draft_model,
            dtype=config.torch_dtype,
            device=config.torch_device,
            load_format=config.load_format,
            seed=config.seed + 1,
        )
        try:
            check_draft_model(draft, self.model, self.max_model_len)
        except DraftModelError as exc:
            raise EngineError(f"draft model {config.draft_model}: {exc}") from None
        return draft

    def _draft_proposer(self, cache_bytes: int) -> DraftModelProposer | None:
        """The draft model's proposer over a KV cache of ``cache_bytes`` (None without one)."""
        if self.draft_model is None:
            return None
        config = self.config
        block_bytes = kv_block_bytes(self.draft_model.config, config.block_size, config.torch_dtype)
        num_blocks = cache_bytes // block_bytes
        # A request whose context does not fit beside the others' just proposes nothing.
        tokens = num_blocks * config.block_size
        if tokens <= config.num_speculative_tokens:
            raise EngineError(
                f"the draft model's KV cache ({cache_bytes} bytes) holds {tokens} tokens: "
                "raise draft_kv_cache_bytes or kv_cache_bytes"
            )
        if tokens < self.max_model_len:
            logger.warning(
                "the draft model's KV cache holds %d tokens, less than max_model_len %d: "
                "longer requests do not speculate (raise draft_kv_cache_bytes)",
                tokens,
                self.max_model_len,
            )
        logger.info("draft model %s: KV cache of %d tokens", config.draft_model, tokens)
        proposer = DraftModelProposer(
            self.draft_model,
            self.backend,
            num_blocks=num_blocks,
            block_size=config.block_size,
            seed=config.seed,
        )
        proposer.cost_relative_to(self.model)
        return proposer

    def _static_decode(self) -> StaticDecode:
        """Fixed buffers for decode-only steps; on CUDA their graphs are captured now."""
        config = self.config
        return self.devices.static_decode(
            self.model,
            self.arena.kv_caches,
            self.lora_pool,
            self.backend,
            block_size=config.block_size,
            max_context_len=self.max_model_len,
            buckets=decode_buckets(min(config.cuda_graph_max_batch, config.max_num_seqs)),
            max_rank=config.max_lora_rank,
            scratch_slot=self.arena.scratch_slot,
            capture=config.torch_device.type == "cuda",
        )

    # --- adapters ------------------------------------------------------------------
    def add_adapter(self, name: str, path: str | Path) -> LoRARequest:
        """Make the PEFT adapter in folder ``path`` servable under ``name``.

        It is parsed now, into the host tier (so a bad adapter is refused here, with the
        reason); it goes to the device when a request needs it.
        """
        self._check_new_adapter_name(name)
        weights = load_adapter(  # AdapterError (a ValueError) says what is wrong
            path,
            self.model_config,
            name=name,
            max_rank=self.config.max_lora_rank,
            dtype=self.config.torch_dtype,
            device="cpu",
        )
        self.tiers.check_fits_device(name, weights.rank)
        request = self._new_adapter(name, LocalDirectorySource(Path(path)))
        try:
            self.tiers.keep_in_host(request.adapter_id, weights)
        except (ValueError, HostCacheFull) as exc:
            self.tiers.unregister(name)
            raise EngineError(f"adapter {name!r} cannot be held in host memory: {exc}") from exc
        return request

    def register_adapter(self, name: str, source: AdapterSource) -> LoRARequest:
        """Make an adapter servable under ``name`` without loading it.

        Its first request queues it for the background loader; requests for it wait
        until it is on the device, without stalling the others. With a disk cache
        configured, sources with a content id are cached on local disk.
        """
        self._check_new_adapter_name(name)
        if self._disk_cache is not None and source.cache_key is not None:
            source = DiskCachedSource(source, self._disk_cache)
        return self._new_adapter(name, source)

    def _check_new_adapter_name(self, name: str) -> None:
        if self.tiers.get(name) is not None:
            raise EngineError(f"adapter {name!r} is already loaded; remove it first")

    def _new_adapter(self, name: str, source: AdapterSource) -> LoRARequest:
        request = LoRARequest(
            name=name, adapter_id=next(self._adapter_ids), source=source.description
        )
        self.tiers.register(request, source)
        return request

    def remove_adapter(self, name: str) -> None:
        """Unregister ``name``, freeing its device rows and host memory."""
        request = self.tiers.get(name)
        if request is None:
            raise UnknownAdapter(f"adapter {name!r} is not loaded")
        users = [s.request_id for s in self._requests.values() if s.lora == request]
        if users:
            raise AdapterInUse(
                f"adapter {name!r} is in use by {len(users)} request(s); abort or finish them first"
            )
        self.tiers.unregister(name)

    def close(self) -> None:
        """Stop the adapter loader threads (queued loads are dropped). The engine can still
        serve adapters already in RAM or on the device, but loads no more. The other
        tensor-parallel ranks stop: the engine serves nothing more then."""
        self.tiers.loader.close()
        self.devices.close()

    def list_adapters(self) -> list[str]:
        return self.tiers.names()

    def adapter_residency(self) -> dict[str, str]:
        """Adapter name -> the tier holding it: device, host, loading, store or failed."""
        return self.tiers.residency()

    def set_tenant_weight(self, tenant: str | None, weight: float) -> None:
        self.scheduler.fair.set_weight(tenant, weight)

    def set_tenant_priority(self, tenant: str | None, priority: int) -> int:
        """Move the tenant's queued and running requests to ``priority``; returns how many."""
        self._tenant_priorities[tenant] = priority
        changed = 0
        for seq in self._requests.values():
            if seq.tenant == tenant and seq.priority != priority:
                seq.priority = priority
                changed += 1
        return changed

    # --- requests ------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        adapter: str | None = None,
        priority: int = 0,
        tenant: str | None = None,
    ) -> None:
        """Queue a request. Everything is checked before anything changes."""
        if request_id in self._requests:
            raise EngineError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise EngineError("params must be a SamplingParams")
        lora = None
        if adapter is not None:
            lora = self.tiers.get(adapter)
            if lora is None:
                raise UnknownAdapter(f"unknown adapter {adapter!r}; add_adapter() it first")
        vocab = self.model_config.vocab_size
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:  # the sampler would fail on them mid-step (min_tokens suppression)
            raise EngineError(f"stop_token_ids must be in [0, {vocab}); got {bad_stop[:3]}")
        self._check_logit_bias(params)
        prompt_ids = self._tokenize(prompt)
        self._check_prompt_fits(len(prompt_ids), params)
        grammar = None
        if params.structured is not None:
            grammar = self.compile_structured(params.structured, tenant).matcher()
        generator = None
        if params.seed is not None:
            generator = make_generator(params.seed, self.config.torch_device)
        speculation = (
            None
            if self.speculator is None
            else self.speculator.start(params, (tenant, None if lora is None else lora.adapter_id))
        )
        seq = Sequence(
            request_id,
            prompt_ids,
            params,
            lora=lora,
            priority=priority,
            tenant=tenant,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer,
                prompt_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            ),
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            generator=generator,
            grammar=grammar,
            speculation=speculation,
        )
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        if lora is not None:
            self.tiers.note_request(lora.adapter_id)

    def compile_structured(
        self, spec: StructuredSpec, tenant: str | None = None
    ) -> CompiledGrammar:
        """``spec`` compiled for this engine's tokenizer (cached per spec and tenant, charged
        to the tenant's share of the cache); EngineError naming the problem if it cannot be
        enforced. Thread-safe: ``AsyncEngine`` calls it off the engine thread before it adds
        the request, so that a slow compile stalls no step."""
        try:
            return self.grammars.compile(spec, tenant)
        except GrammarError as exc:
            raise EngineError(str(exc)) from None

    def _check_logit_bias(self, params: SamplingParams) -> None:
        # SamplingParams does not know the vocab; the sampler would fail mid-step on these.
        vocab = self.model_config.vocab_size
        bad = [t for t in params.logit_bias or () if t >= vocab]
        if bad:
            raise EngineError(
                f"logit_bias token id {bad[0]} is out of range: the model's vocab size is "
                f"{vocab} (ids 0 to {vocab - 1})"
            )

    def _check_prompt_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        # A prompt-only request (max_tokens 0) may fill the context: it generates nothing.
        room = 0 if params.max_tokens == 0 else 1
        if num_prompt_tokens + room > self.max_model_len:
            raise EngineError(
                f"prompt has {num_prompt_tokens} tokens; the context limit is "
                f"{self.max_model_len}, leaving no room to generate"
            )

    def _tokenize(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt)["input_ids"]
        else:
            if isinstance(prompt, bytes | bytearray) or not isinstance(prompt, Iterable):
                raise EngineError(
                    f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}"
                )
            ids = [_token_id(t) for t in prompt]
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise EngineError(f"prompt token ids must be in [0, {vocab}); got {bad[:3]}")
        if not ids:
            raise EngineError("prompt is empty")
        return ids

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self._forget(request_id)
        if seq is None:
            return None
        self.scheduler.abort(seq)
        seq.finish_abort(FinishReason.ABORT)
        self._update_gauges()
        return self._output(seq, "", [])

    def _forget(self, request_id: str) -> Sequence | None:
        """Drop a request that ended (and its draft-model cache, if any)."""
        if self.speculator is not None:
            self.speculator.forget(request_id)
        return self._requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # --- the loop ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for every request that got tokens, and
        for every request ended by an adapter that failed to load."""
        if self.governor is not None:
            self.metrics.compute_threads.set(self.governor.adjust())
        failures = self._fail_waiting(
            self.tiers.poll(), "could not be loaded", ErrorKind.ADAPTER_LOAD_FAILED
        )
        waiting = self.scheduler.waiting_in_order()
        never = self.tiers.prepare(seq.adapter_id for seq in waiting if seq.adapter_id is not None)
        failures += self._fail_waiting(never, "cannot be served", ErrorKind.ADAPTER_TOO_LARGE)
        self._hold_room_for_adapter(waiting)
        self._give_kv_room()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        plan = self.scheduler.schedule()
        self.executor.copy_kv_blocks(plan.kv_moves)
        self.metrics.kv_blocks_moved.inc(len(plan.kv_moves))
        self.tiers.pin_running(
            seq.adapter_id for seq in self.scheduler.running if seq.adapter_id is not None
        )
        if plan.preempted:
            self.metrics.preemptions.inc(len(plan.preempted))
        self.residency_watch.observe(self._residency_counts())
        if plan.is_empty:
            self._update_gauges()
            if not failures and self.tiers.loader.pending():
                # Nothing can run until a load finishes: wait for it briefly instead of
                # spinning (short, so new requests and commands are not held up).
                self.tiers.loader.wait(timeout=0.01)
            return failures
        now = time.monotonic()
        for item in plan.scheduled:
            if item.seq.metrics.first_scheduled_time is None:
                item.seq.metrics.first_scheduled_time = now
                self.metrics.queue_time.observe(now - item.seq.metrics.arrival_time)
        prompt_logprobs: dict[str, list] = {}
        started = time.perf_counter()
        try:
            step = run_isolated(self._execute_interruptible(plan, prompt_logprobs), plan)
        except StepInterrupted:
            # A request of higher priority arrived: nothing of this step is applied; the
            # next plan runs it first (step_interrupt.py).
            self.metrics.steps_interrupted.inc()
            self._update_gauges()
            return failures
        finally:
            self.step_interrupt.end()
        if not step.reruns:
            self.prefill_budget.observe(
                plan.num_prompt_tokens,
                plan.num_batched_tokens - plan.num_prompt_tokens,
                time.perf_counter() - started,
            )
        if self.speculator is not None and not step.reruns:
            self.speculator.observe_step(plan, time.perf_counter() - started)
            self.metrics.spec_proposal_cost.set(self.speculator.proposal_cost)
        outputs = failures + self._fail_in_step(step)
        # Counted as served, before update() finishes some of them (tenant_share.py).
        emitted = {rid: len(tokens) for rid, tokens in step.sampled.items() if len(tokens) > 1}
        self.metrics.count_served(self.tenant_share.record_step(plan.scheduled, emitted))
        updates = self.scheduler.update(plan, step.sampled, time.monotonic(), prompt_logprobs)
        self._record_speculation(plan, step.sampled)
        for seq, text, new_ids in updates:
            # A prompt-only request finishes with no token: nothing generated to observe.
            if new_ids:
                self._observe_tokens(seq, len(new_ids))
            outputs.append(self._output(seq, text, new_ids))
            if seq.is_finished:
                self._forget(seq.request_id)
        # Finished requests no longer hold their adapters on the device.
        self.tiers.pin_running(
            seq.adapter_id for seq in self.scheduler.running if seq.adapter_id is not None
        )
        self._update_gauges()
        return outputs

    def _execute_interruptible(self, plan: SchedulerOutput, prompt_logprobs: dict[str, list]):
        """The executor's execute, interruptible by a higher-priority arrival on its first
        run only (a re-run that isolates a failure must finish: its parts sample).

        It returns the sampled tokens, as ``run_isolated`` takes them; the prompt logprobs
        of every run (or part) that got that far are collected into ``prompt_logprobs``
        (a part run again overwrites its requests' with the same values).
        """
        self.step_interrupt.begin(max(item.seq.priority for item in plan.scheduled))
        runs = 0

        def execute(part: SchedulerOutput):
            nonlocal runs
            interruptible = runs == 0 and self.executor.interruptible
            self.executor.interrupt = self.step_interrupt.check if interruptible else None
            runs += 1
            batch = build_step_batch(part, self.kv.block_table, self.lora_pool.step_table)
            try:
                result = self.executor.execute(batch)
            except NonFiniteOutput as exc:  # the others' results stand
                prompt_logprobs.update(exc.prompt_logprobs)
                raise
            prompt_logprobs.update(result.prompt_logprobs)
            return result.sampled

        return execute

    def note_arrival(self, priority: int) -> None:
        """A request of ``priority`` is being submitted from another thread: if it outranks
        the running step, the step is cut short for it (step_interrupt.py). Thread-safe."""
        self.step_interrupt.arrived(priority)

    def _fail_in_step(self, step: IsolatedStep) -> list[RequestOutput]:
        """End the requests found to make the step fail; the others' tokens stand."""
        if not step.failed:
            return []
        self.metrics.step_failures.inc()
        self.metrics.step_reruns.inc(step.reruns)
        self.metrics.requests_failed_in_step.inc(len(step.failed))
        outputs = []
        for request_id, (kind, reason) in step.failed.items():
            seq = self._forget(request_id)
            what = "the base model" if seq.lora is None else f"adapter {seq.lora.name!r}"
            self.scheduler.fail(seq, f"{what} failed in the engine step: {reason}", kind)
            outputs.append(self._output(seq, "", []))
        return outputs

    def _fail_waiting(
        self, errors: dict[int, str], what: str, kind: ErrorKind
    ) -> list[RequestOutput]:
        """End the waiting requests whose adapter is in ``errors`` (adapter id -> why). A
        failed load is retried by the next request for that adapter."""
        if not errors:
            return []
        outputs = []
        for seq in list(self.scheduler.waiting):
            error = errors.get(seq.adapter_id) if seq.adapter_id is not None else None
            if error is None:
                continue
            self.scheduler.fail(seq, f"adapter {seq.lora.name!r} {what}: {error}", kind)
            self._forget(seq.request_id)
            outputs.append(self._output(seq, "", []))
        return outputs

    def _hold_room_for_adapter(self, waiting: list[Sequence]) -> None:
        """Hold the KV blocks where the first adapter that found no device room must go,
        and tell the scheduler, which moves the ones in use below (and preempts for what
        cannot move, if the adapter waits too long)."""
        blocked = self.tiers.blocked_for_room
        limit = None if blocked is None else self.lora_pool.kv_limit_needed(blocked[1])
        first = None
        if limit is not None:
            first = next((s for s in waiting if s.adapter_id == blocked[0]), None)
        if first is None:
            self.kv.release_hold()
            self.scheduler.adapter_room = None
        else:
            previous = self.scheduler.adapter_room
            since = self.scheduler.step_count + 1  # schedule() counts the coming step
            if previous is not None and previous.adapter_id == blocked[0]:
                since = previous.since_step
            self.kv.hold_from(limit)
            self.scheduler.adapter_room = AdapterRoom(blocked[0], limit, first.priority, since)
        self.metrics.kv_blocks_held.set(self.kv.num_held_blocks)

    def _give_kv_room(self) -> None:
        """Let KV take rows back from idle adapters when the next step's blocks are short:
        the running requests' next tokens plus the first admissible waiting prompt."""
        size = self.kv.block_size
        needed = sum(1 for seq in self.scheduler.running if seq.num_computed_tokens % size == 0)
        for seq in self.scheduler.waiting_in_order():
            if seq.adapter_id is None or self.lora_pool.is_resident(seq.adapter_id):
                needed += -(-seq.num_tokens // size)
                break
        short = needed - self.kv.num_free_blocks
        if short > 0:
            self.lora_pool.release_for_kv(short)

    def _observe_tokens(self, seq: Sequence, count: int) -> None:
        """``seq`` got ``count`` tokens this step (several with speculation: the gaps after
        the first are 0, as the client sees them arrive together)."""
        m = seq.metrics
        adapter = _adapter_label(seq)
        self.metrics.generated_tokens.inc(count)
        self.metrics.adapter_generated_tokens.labels(adapter).inc(count)
        self.metrics.decode_steps.labels(adapter).inc()
        totals = self._speculation.setdefault(adapter, SpeculationStats())
        totals.generated_tokens += count
        totals.decode_steps += 1
        gaps = m.inter_token_times[-count:] if count <= len(m.inter_token_times) else []
        if m.completion_tokens == count and m.time_to_first_token is not None:
            self.metrics.time_to_first_token.observe(m.time_to_first_token)
            self.latencies.ttft.add(m.time_to_first_token)
            gaps = m.inter_token_times  # the step's tokens after the first one
        for gap in gaps:
            self.metrics.inter_token_latency.observe(gap)
            self.latencies.itl.add(gap)

    def _record_speculation(self, plan: SchedulerOutput, sampled: dict[str, list]) -> None:
        """What each speculating request proposed and had accepted this step."""
        for item in plan.scheduled:
            emitted = sampled.get(item.seq.request_id)
            if not item.draft_token_ids or emitted is None:
                continue  # none proposed, or the request failed in the step
            proposed, accepted = len(item.draft_token_ids), len(emitted) - 1
            self.speculator.record(item.seq, proposed, accepted)
            adapter = _adapter_label(item.seq)
            self.metrics.spec_proposed_tokens.labels(adapter).inc(proposed)
            self.metrics.spec_accepted_tokens.labels(adapter).inc(accepted)
            self.metrics.spec_verify_steps.labels(adapter).inc()
            totals = self._speculation.setdefault(adapter, SpeculationStats())
            totals.proposed_tokens += proposed
            totals.accepted_tokens += accepted
            totals.verify_steps += 1

    def _update_gauges(self) -> None:
        self.metrics.running_requests.set(len(self.scheduler.running))
        self.metrics.waiting_requests.set(len(self.scheduler.waiting))
        self.metrics.kv_blocks_used.set(self.kv.num_used_blocks)
        queries, hits = self.kv.prefix_cache_queries, self.kv.prefix_cache_hits
        old_q, old_h = self._prefix_stats
        self.metrics.prefix_cache_queries.inc(queries - old_q)
        self.metrics.prefix_cache_hits.inc(hits - old_h)
        self._prefix_stats = (queries, hits)
        # Per-tenant gauges walk every sequence and every tenant ever seen: at most once a
        # second while there is work (a scrape reads them far less often), and once more
        # when the engine goes idle, so they never stay at a busy value.
        now = time.monotonic()
        if now - self._tenant_gauges_at >= TENANT_GAUGES_EVERY_S or not self.scheduler.has_work():
            self._tenant_gauges_at = now
            self.metrics.set_tenants(self._tenant_stats())

    def _tenant_stats(self) -> dict[str | None, TenantShareStats]:
        scheduler = self.scheduler
        return self.tenant_share.snapshot(
            scheduler.waiting, scheduler.running, scheduler.fair.weights
        )

    def _residency_counts(self) -> ResidencyCounts:
        tiers = self.tiers
        return ResidencyCounts(
            preemptions=self.scheduler.num_preemptions,
            adapter_evictions=tiers.device_evictions,
            adapter_reloads=tiers.reloads,
            adapter_room_wait_steps=tiers.room_wait_steps,
        )

    def stats(self) -> EngineStats:
        """What the engine is doing now: load, KV cache, adapter tiers, recent latency."""
        device, host = tier_stats(self.tiers, self.arena.bytes_per_row)
        ttft, itl = self.latencies.snapshot()
        return EngineStats(
            running_requests=len(self.scheduler.running),
            waiting_requests=len(self.scheduler.waiting),
            kv_blocks_used=self.kv.num_used_blocks,
            kv_blocks_usable=self.kv.limit,
            kv_blocks_total=self.kv.num_blocks,
            kv_block_size=self.kv.block_size,
            device=device,
            host=host,
            adapter_residency=self.tiers.residency(),
            ttft=ttft,
            itl=itl,
            window_s=self.latencies.window_s,
            tenant_priorities=dict(self._tenant_priorities),
            tenant_weights=dict(self.scheduler.fair.weights),
            kv_blocks_held=self.kv.num_held_blocks,
            preemptions=self.scheduler.num_preemptions,
            residency=self.residency_watch.stats(self._residency_counts()),
            memory=self.memory_plan,
            tenants=self._tenant_stats(),
            share_window_s=self.tenant_share.window_s,
            speculative_method=self.config.speculative_method,
            num_speculative_tokens=(
                0 if self.speculator is None else self.config.num_speculative_tokens
            ),
            speculation={k: dataclasses.replace(v) for k, v in self._speculation.items()},
            grammar_cache=self.grammars.cache_stats(),
        )

    def _output(self, seq: Sequence, delta_text: str, delta_ids: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=seq.output_text,
            delta_token_ids=list(delta_ids),
            delta_text=delta_text,
            finished=seq.is_finished,
            finish_reason=None if seq.finish_reason is None else seq.finish_reason.value,
            stop_reason=seq.stop_reason,
            error=seq.error,
            error_kind=None if seq.error_kind is None else seq.error_kind.value,
            logprobs=list(seq.output_logprobs),
            prompt_logprobs=self._prompt_logprobs(seq, delta_ids),
            adapter=None if seq.lora is None else seq.lora.name,
            metrics=seq.metrics,
        )

    @staticmethod
    def _prompt_logprobs(seq: Sequence, delta_ids: list[int]):
        """The prompt logprobs for an output: on the request's first token and its final
        output, once all were computed (sent twice, not on every streamed delta)."""
        if seq.prompt_logprobs is None or seq.collects_prompt_logprobs:
            return None
        first_token = bool(delta_ids) and len(seq.output_token_ids) == len(delta_ids)
        return list(seq.prompt_logprobs) if first_token or seq.is_finished else None

    # --- convenience -------------------------------------------------------------
    def generate(
        self,
        prompts: Seq[str | Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        adapters: Seq[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion, batched together; one output per prompt, in order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        count = len(prompts)
        params_list = (
            [params or SamplingParams()] * count
            if params is None or isinstance(params, SamplingParams)
            else list(params)
        )
        adapter_list = [None] * count if adapters is None else list(adapters)
        if len(params_list) != count or len(adapter_list) != count:
            raise EngineError("prompts, params and adapters must have the same length")
        ids = [f"generate-{next(self._request_ids)}" for _ in range(count)]
        added = []
        try:
            for rid, prompt, p, adapter in zip(
                ids, prompts, params_list, adapter_list, strict=True
            ):
                self.add_request(rid, prompt, p, adapter=adapter)
                added.append(rid)
        except Exception:
            for rid in added:  # leave nothing behind
                self.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < count:
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]
