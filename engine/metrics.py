"""Prometheus metrics of one engine, in its own registry (no process-wide globals).

Per-tenant series carry a ``tenant`` label (the platform's tenant id; the empty string for
requests without a tenant): their number is bounded by the tenants the platform admits,
and each tenant adds six series, so a platform of a few thousand tenants stays well within
what Prometheus handles. A tenant's series stay once seen, so its gauges read 0 when it
has no work rather than its last value.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loramux.engine.tenant_share import TenantShareStats

if TYPE_CHECKING:
    from loramux.engine.structured_outputs import Grammars

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self._add_latency(r)
        self._add_memory(r)
        self._add_adapter_tiers(r)
        self._add_residency(r)
        self._add_speculation(r)
        self._add_failures(r)
        self._add_tenants(r)

    def _add_latency(self, r: CollectorRegistry) -> None:
        """Latency and load: time to first token, inter-token gaps, queue time, requests."""
        self.time_to_first_token = Histogram(
            "loramux_time_to_first_token_seconds",
            "Arrival to first token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "loramux_inter_token_latency_seconds",
            "Gap between consecutive tokens.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "loramux_queue_time_seconds",
            "Arrival to first scheduled.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running_requests = Gauge("loramux_running_requests", "Requests running.", registry=r)
        self.waiting_requests = Gauge("loramux_waiting_requests", "Requests waiting.", registry=r)
        self.lora_launches_per_decode_step = Gauge(
            "loramux_lora_launches_per_decode_step",
            "LoRA op launches of the last decode step with adapters (kernel launches on a GPU).",
            registry=r,
        )

    def _add_memory(self, r: CollectorRegistry) -> None:
        """The KV cache, its prefix cache and the compute threads."""
        self.kv_blocks_used = Gauge("loramux_kv_blocks_used", "KV blocks in use.", registry=r)
        self.kv_blocks_total = Gauge("loramux_kv_blocks_total", "KV blocks in all.", registry=r)
        self.compute_threads = Gauge(
            "loramux_compute_threads",
            "The engine's CPU threads now (fewer while other processes take cores).",
            registry=r,
        )
        self.kv_blocks_moved = Counter(
            "loramux_kv_blocks_moved",
            "KV blocks copied out of the way of a waiting adapter's device rows.",
            registry=r,
        )
        self.kv_blocks_held = Gauge(
            "loramux_kv_blocks_held",
            "Released KV blocks held back for a waiting adapter's device rows.",
            registry=r,
        )
        self.prefix_cache_queries = Counter(
            "loramux_prefix_cache_query_tokens", "Prompt tokens looked up.", registry=r
        )
        self.prefix_cache_hits = Counter(
            "loramux_prefix_cache_hit_tokens", "Prompt tokens found cached.", registry=r
        )

    def _add_adapter_tiers(self, r: CollectorRegistry) -> None:
        """Adapter tiers: loads, lookups per tier, evictions, what each tier holds."""
        self.adapter_loads = Counter(
            "loramux_adapter_loads", "Adapters loaded from their source into host RAM.", registry=r
        )
        # Per tier ("device", "host"): a request's adapter is looked up on the device, then
        # (on a device miss) in host RAM, then loaded from the store; so per tier
        # hits + misses = lookups, and device lookups = requests with an adapter.
        self.adapter_hits = Counter(
            "loramux_adapter_hits", "Adapter lookups found in the tier.", ["tier"], registry=r
        )
        self.adapter_misses = Counter(
            "loramux_adapter_misses", "Adapter lookups not found in the tier.", ["tier"], registry=r
        )
        self.adapter_evictions = Counter(
            "loramux_adapter_evictions", "Adapters evicted from the tier.", ["tier"], registry=r
        )
        self.adapters_resident = Gauge(
            "loramux_adapters_resident", "Adapters held in the tier.", ["tier"], registry=r
        )
        self.adapter_bytes = Gauge(
            "loramux_adapter_bytes",
            "Bytes of adapter weights held in the tier.",
            ["tier"],
            registry=r,
        )
        self.adapter_load_seconds = Histogram(
            "loramux_adapter_load_seconds",
            "Fetching and parsing one adapter from its source (the loader thread).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def _add_residency(self, r: CollectorRegistry) -> None:
        """Preemptions, interrupted steps, re-loads and room waits: is memory the limit?"""
        self.preemptions = Counter("loramux_preemptions", "Sequences preempted.", registry=r)
        self.steps_interrupted = Counter(
            "loramux_steps_interrupted",
            "Steps abandoned between layers for a request of higher priority (their work is "
            "recomputed in the next step).",
            registry=r,
        )
        # With evictions{tier=device} and preemptions, these say when device memory, not
        # compute, is the limit (see residency.py).
        self.adapter_reloads = Counter(
            "loramux_adapter_reloads",
            "Device loads of adapters the device had held before and evicted.",
            registry=r,
        )
        self.adapter_room_wait_steps = Counter(
            "loramux_adapter_room_wait_steps",
            "Engine steps in which a waiting request's adapter found no device room.",
            registry=r,
        )
        self.generated_tokens = Counter("loramux_generated_tokens", "Tokens generated.", registry=r)

    def _add_speculation(self, r: CollectorRegistry) -> None:
        """Speculative decoding and tokens per adapter."""
        # Speculative decoding, per adapter (the base model's label is the empty string):
        # acceptance rate = accepted / proposed; tokens per step = generated / decode steps.
        self.spec_proposed_tokens = Counter(
            "loramux_spec_proposed_tokens",
            "Speculative proposals verified by the target model (an engine cost, not billed).",
            ["adapter"],
            registry=r,
        )
        self.spec_accepted_tokens = Counter(
            "loramux_spec_accepted_tokens",
            "Speculative proposals the target model accepted (emitted as output).",
            ["adapter"],
            registry=r,
        )
        self.spec_verify_steps = Counter(
            "loramux_spec_verify_steps",
            "Per request and step: proposals verified (requests x steps that speculated).",
            ["adapter"],
            registry=r,
        )
        self.spec_proposal_cost = Gauge(
            "loramux_spec_proposal_cost",
            "What one more proposed token costs relative to a request's share of a step, as "
            "the draft length weighs it (measured from decode steps; engine/speculative/"
            "step_cost.py).",
            registry=r,
        )
        self.decode_steps = Counter(
            "loramux_decode_steps",
            "Per request and step: steps that emitted tokens (requests x steps), by adapter.",
            ["adapter"],
            registry=r,
        )
        self.adapter_generated_tokens = Counter(
            "loramux_adapter_generated_tokens",
            "Tokens generated, by adapter (with decode steps: tokens per step).",
            ["adapter"],
            registry=r,
        )

    def _add_failures(self, r: CollectorRegistry) -> None:
        """Steps in which requests failed, alone (blast radius)."""
        self.step_failures = Counter(
            "loramux_step_failures",
            "Engine steps in which some request failed (the others went on).",
            registry=r,
        )
        self.step_reruns = Counter(
            "loramux_step_reruns",
            "Partial re-runs of failed steps while finding which requests caused them.",
            registry=r,
        )
        self.requests_failed_in_step = Counter(
            "loramux_requests_failed_in_step",
            "Requests failed alone because they made an engine step fail.",
            registry=r,
        )

    def _add_tenants(self, r: CollectorRegistry) -> None:
        """Per tenant: service, queue depth, share beside the weight's share."""
        # Per tenant (tenant_share.py): tokens as each step serves them, queue depth, and the
        # share of the last 30 s's service next to the weight's share; compare the two.
        self.tenant_served_tokens = Counter(
            "loramux_tenant_served_tokens",
            "Tokens served to the tenant, counted in the step that serves them: prompt "
            "tokens computed (prefix-cache hits not, recompute after preemption too) and "
            "output tokens generated.",
            ["tenant", "kind"],
            registry=r,
        )
        self.tenant_queued_requests = Gauge(
            "loramux_tenant_queued_requests",
            "The tenant's requests waiting.",
            ["tenant"],
            registry=r,
        )
        self.tenant_running_requests = Gauge(
            "loramux_tenant_running_requests",
            "The tenant's requests running.",
            ["tenant"],
            registry=r,
        )
        self.tenant_share = Gauge(
            "loramux_tenant_share",
            "The tenant's fraction of the service (prompt tokens x1, output tokens x2, as "
            "the fair-share scheduler weighs them) over the last 30 s; 0 when none was served.",
            ["tenant"],
            registry=r,
        )
        self.tenant_weight = Gauge(
            "loramux_tenant_weight", "The tenant's fair-share weight.", ["tenant"], registry=r
        )
        self.tenant_weight_share = Gauge(
            "loramux_tenant_weight_share",
            "The tenant's weight / the summed weights of the tenants with requests queued or "
            "running: the share it should get while backlogged; 0 when it has no work.",
            ["tenant"],
            registry=r,
        )

    def watch_grammar_cache(self, grammars: Grammars) -> None:
        """Export the compiled-grammar cache's figures, read from it when scraped (its
        compiles run on other threads too)."""
        self.registry.register(_GrammarCacheCollector(grammars))

    def count_served(self, served: dict[str | None, tuple[int, int]]) -> None:
        """Add one step's (prompt, output) tokens per tenant."""
        for tenant, (prompt, output) in served.items():
            label = _tenant_label(tenant)
            self.tenant_served_tokens.labels(label, "prompt").inc(prompt)
            self.tenant_served_tokens.labels(label, "output").inc(output)

    def set_tenants(self, tenants: dict[str | None, TenantShareStats]) -> None:
        for tenant, stats in tenants.items():
            label = _tenant_label(tenant)
            self.tenant_queued_requests.labels(label).set(stats.queued_requests)
            self.tenant_running_requests.labels(label).set(stats.running_requests)
            self.tenant_share.labels(label).set(stats.share or 0.0)
            self.tenant_weight.labels(label).set(stats.weight)
            self.tenant_weight_share.labels(label).set(stats.weight_share or 0.0)


class _GrammarCacheCollector(Collector):
    """``loramux_grammar_cache_*``: bytes and entries held, engine-wide and per tenant with
    an entry (a tenant whose grammars were all evicted drops out), the budgets, and counts
    since the start."""

    def __init__(self, grammars: Grammars):
        self._grammars = grammars

    def collect(self) -> Iterator[Metric]:
        stats = self._grammars.cache_stats()
        usage = self._grammars.tenant_usage()
        for name, text, value in (
            ("bytes", "Bytes of compiled grammars the cache holds (host RAM).", stats.bytes),
            ("entries", "Compiled grammars the cache holds.", stats.entries),
            ("budget_bytes", "The most the cache keeps.", stats.budget_bytes),
            (
                "tenant_budget_bytes",
                "The most one tenant's grammars keep.",
                stats.tenant_budget_bytes,
            ),
        ):
            yield GaugeMetricFamily(f"loramux_grammar_cache_{name}", text, value=value)
        tenant_bytes = GaugeMetricFamily(
            "loramux_grammar_cache_tenant_bytes",
            "Bytes of the tenant's compiled grammars the cache holds.",
            labels=["tenant"],
        )
        tenant_entries = GaugeMetricFamily(
            "loramux_grammar_cache_tenant_entries",
            "The tenant's compiled grammars the cache holds.",
            labels=["tenant"],
        )
        for tenant, (nbytes, entries) in sorted(usage.items(), key=lambda i: _tenant_label(i[0])):
            tenant_bytes.add_metric([_tenant_label(tenant)], nbytes)
            tenant_entries.add_metric([_tenant_label(tenant)], entries)
        yield tenant_bytes
        yield tenant_entries
        lookups = CounterMetricFamily(
            "loramux_grammar_cache_lookups",
            "Compiles asked for, by result: hit (cached, or compiled by another thread) or "
            "miss (compiled; failed compiles too).",
            labels=["result"],
        )
        lookups.add_metric(["hit"], stats.hits)
        lookups.add_metric(["miss"], stats.misses)
        yield lookups
        evictions = CounterMetricFamily(
            "loramux_grammar_cache_evictions",
            "Compiled grammars evicted, by the budget that needed the room: the tenant's own "
            "or the engine's.",
            labels=["budget"],
        )
        evictions.add_metric(["tenant"], stats.tenant_evictions)
        evictions.add_metric(["engine"], stats.evictions - stats.tenant_evictions)
        yield evictions
        yield CounterMetricFamily(
            "loramux_grammar_cache_evicted_bytes",
            "Bytes of the compiled grammars evicted.",
            value=stats.evicted_bytes,
        )
        yield CounterMetricFamily(
            "loramux_grammar_cache_not_kept",
            "Compiled grammars larger than the tenant budget: used by their requests, not kept.",
            value=stats.not_kept,
        )


def _tenant_label(tenant: str | None) -> str:
    return "" if tenant is None else tenant
