"""The step observer: what the engine's steps did, as metrics and as ``Engine.stats()``.

It watches and never decides: each step it counts the plan (KV blocks moved, preemptions,
queue times, residency), the tokens each tenant was served, each request's new tokens
(TTFT and inter-token gaps, per adapter) and what speculation proposed and had accepted;
it keeps the gauges current and builds the one ``EngineStats`` that crosses the
engine-process seam, the fleet merge and the admin API.
"""

from __future__ import annotations

import dataclasses
import math

from loramux.engine.clock import Clock
from loramux.engine.executor import Sampled
from loramux.engine.lora.residency import AdapterResidency
from loramux.engine.memory.kv_cache import KVCacheManager
from loramux.engine.memory.plan import MemoryPlan
from loramux.engine.metrics import EngineMetrics
from loramux.engine.scheduler import Scheduler, SchedulerOutput
from loramux.engine.sequence import Sequence
from loramux.engine.speculative.speculator import Speculator
from loramux.engine.stats import EngineStats, LatencyRecorder, SpeculationStats, tier_stats
from loramux.engine.structured_outputs import Grammars
from loramux.engine.tenant_share import TenantShare, TenantShareStats

TENANT_GAUGES_EVERY_S = 1.0


def adapter_label(seq: Sequence) -> str:
    """The metrics' adapter label: its name (a mix's names, ``a+b``: weights would make
    labels without end), or the empty string for the base model."""
    return "+".join(lora.name for lora in seq.adapters)


class StepObserver:
    """Counts what each step did; ``stats()`` says what the engine is doing now."""

    def __init__(
        self,
        metrics: EngineMetrics,
        scheduler: Scheduler,
        kv: KVCacheManager,
        residency: AdapterResidency,
        memory_plan: MemoryPlan,
        grammars: Grammars,
        speculator: Speculator | None,
        *,
        speculative_method: str,
        num_speculative_tokens: int,
        num_layers: int,
        clock: Clock,
    ):
        self.metrics, self.scheduler, self.kv = metrics, scheduler, kv
        self.residency, self.memory_plan = residency, memory_plan
        self.grammars, self.speculator = grammars, speculator
        self._speculative = (speculative_method, num_speculative_tokens)
        self.clock = clock
        self.num_layers = num_layers
        self.decode_lora_launches: int | None = None  # the last decode step's, with adapters
        self.latencies = LatencyRecorder(clock=clock.now)  # recent TTFT / ITL for stats()
        # tokens served per tenant, as steps serve them (windows on the engine's clock)
        self.tenant_share = TenantShare(clock=clock.now)
        self.tenant_priorities: dict[str | None, int] = {}  # as last set, for stats()
        self._speculation: dict[str, SpeculationStats] = {}  # adapter label -> totals
        self._prefix_stats = (0, 0)
        self._tenant_gauges_at = -math.inf  # when the per-tenant gauges were last set
        metrics.kv_blocks_total.set(kv.num_blocks)
        metrics.watch_grammar_cache(grammars)  # read when scraped

    # --- each step -----------------------------------------------------------------------
    def observe_plan(self, plan: SchedulerOutput) -> None:
        """The scheduler's plan, once it is made: blocks moved, preemptions, residency, and
        the queue time of each request scheduled for the first time."""
        self.metrics.kv_blocks_moved.inc(len(plan.kv_moves))
        if plan.preempted:
            self.metrics.preemptions.inc(len(plan.preempted))
        self.residency.observe(self.scheduler.num_preemptions)
        now = self.clock.now()
        for item in plan.scheduled:
            if item.seq.metrics.first_scheduled_time is None:
                item.seq.metrics.first_scheduled_time = now
                self.metrics.queue_time.observe(now - item.seq.metrics.arrival_time)

    def observe_lora_launches(self, launches: int | None) -> None:
        """A step's LoRA launches, if it was a decode-only step with adapters."""
        if launches is not None:
            self.decode_lora_launches = launches
            self.metrics.lora_launches_per_decode_step.set(launches)

    def observe_served(self, plan: SchedulerOutput, sampled: Sampled) -> None:
        """Each tenant's tokens, counted as served before the scheduler's update finishes
        some of the requests (tenant_share.py), and what speculation did."""
        emitted = {rid: len(tokens) for rid, tokens in sampled.items() if len(tokens) > 1}
        self.metrics.count_served(self.tenant_share.record_step(plan.scheduled, emitted))
        self._record_speculation(plan, sampled)

    def observe_tokens(self, seq: Sequence, count: int) -> None:
        """``seq`` got ``count`` tokens this step (several with speculation: the gaps after
        the first are 0, as the client sees them arrive together)."""
        m = seq.metrics
        adapter = adapter_label(seq)
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

    def _record_speculation(self, plan: SchedulerOutput, sampled: Sampled) -> None:
        """What each speculating request proposed and had accepted this step."""
        for item in plan.scheduled:
            emitted = sampled.get(item.seq.request_id)
            if not item.draft_token_ids or emitted is None:
                continue  # none proposed, or the request failed in the step
            proposed, accepted = len(item.draft_token_ids), len(emitted) - 1
            self.speculator.record(item.seq, proposed, accepted)
            adapter = adapter_label(item.seq)
            self.metrics.spec_proposed_tokens.labels(adapter).inc(proposed)
            self.metrics.spec_accepted_tokens.labels(adapter).inc(accepted)
            self.metrics.spec_verify_steps.labels(adapter).inc()
            totals = self._speculation.setdefault(adapter, SpeculationStats())
            totals.proposed_tokens += proposed
            totals.accepted_tokens += accepted
            totals.verify_steps += 1

    def update_gauges(self) -> None:
        scheduler = self.scheduler
        self.metrics.running_requests.set(len(scheduler.running))
        self.metrics.waiting_requests.set(len(scheduler.waiting))
        self.metrics.kv_blocks_used.set(self.kv.num_used_blocks)
        queries, hits = self.kv.prefix_cache_queries, self.kv.prefix_cache_hits
        old_q, old_h = self._prefix_stats
        self.metrics.prefix_cache_queries.inc(queries - old_q)
        self.metrics.prefix_cache_hits.inc(hits - old_h)
        self._prefix_stats = (queries, hits)
        # Per-tenant gauges walk every sequence and every tenant ever seen: at most once a
        # second while there is work (a scrape reads them far less often), and once more
        # when the engine goes idle, so they never stay at a busy value.
        now = self.clock.now()
        if now - self._tenant_gauges_at >= TENANT_GAUGES_EVERY_S or not scheduler.has_work():
            self._tenant_gauges_at = now
            self.metrics.set_tenants(self._tenant_stats())

    def _tenant_stats(self) -> dict[str | None, TenantShareStats]:
        scheduler = self.scheduler
        return self.tenant_share.snapshot(
            scheduler.waiting, scheduler.running, scheduler.fair.weights
        )

    # --- now -----------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """What the engine is doing now: load, KV cache, adapter tiers, recent latency."""
        scheduler, kv, residency = self.scheduler, self.kv, self.residency
        device, host = tier_stats(residency.tiers, self.memory_plan.adapter_row_bytes)
        ttft, itl = self.latencies.snapshot()
        method, num_tokens = self._speculative
        launches = self.decode_lora_launches
        return EngineStats(
            running_requests=len(scheduler.running),
            waiting_requests=len(scheduler.waiting),
            kv_blocks_used=kv.num_used_blocks,
            kv_blocks_usable=kv.limit,
            kv_blocks_total=kv.num_blocks,
            kv_block_size=kv.block_size,
            device=device,
            host=host,
            adapter_residency=residency.residency(),
            pinned_adapters=residency.pin_states(),
            ttft=ttft,
            itl=itl,
            window_s=self.latencies.window_s,
            tenant_priorities=dict(self.tenant_priorities),
            tenant_weights=dict(scheduler.fair.weights),
            kv_blocks_held=kv.num_held_blocks,
            preemptions=scheduler.num_preemptions,
            residency=residency.watch.stats(residency.counts(scheduler.num_preemptions)),
            memory=self.memory_plan,
            tenants=self._tenant_stats(),
            share_window_s=self.tenant_share.window_s,
            speculative_method=method,
            num_speculative_tokens=0 if self.speculator is None else num_tokens,
            speculation={k: dataclasses.replace(v) for k, v in self._speculation.items()},
            grammar_cache=self.grammars.cache_stats(),
            lora_launches_per_decode_step=launches,
            lora_launches_per_layer=None if launches is None else launches / self.num_layers,
        )
