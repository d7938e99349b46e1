"""Response body of ``GET /admin/engine``: the engines' live snapshot, merged, with a
row per engine (one, ``local``, in the embedded default).

Built from ``loramux.engine.EngineStats`` (the engine knows adapters by version id
and tenants by id) and the names the platform's database holds for them. Latencies are
milliseconds over the engine's recent window (``latency_window_s``); ``null`` while the
window holds no sample. ``speculation`` says what speculative decoding proposed, had
accepted and gained, per adapter version (the base model's row has an empty engine name);
``grammar_cache`` what the compiled structured-output grammars hold in host RAM.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from loramux.engine import (
    EngineStats,
    TierStats,
)
from loramux.platform.api.admin.engine_figures import (
    GrammarCacheOut,
    KVCacheOut,
    LatencyOut,
    MemoryOut,
    ResidencyOut,
    SpeculationOut,
    label_fields,
    ms,
)
from loramux.platform.engine_fleet.client import EngineReport
from loramux.platform.services.adapters import VersionLabel


class EngineAdapterOut(BaseModel):
    """A registered adapter version and where it is; names are null for versions the
    database does not know."""

    engine_name: str = Field(description="The engine's name: the adapter version's id.")
    tier: str = Field(description="Fastest tier: device, host, loading, store or failed.")
    tenant_id: str | None
    tenant_name: str | None
    adapter: str | None
    version: int | None
    pin: str | None = Field(
        default=None,
        description="Pinned on the device: `pinned`, or why the engines do not hold it yet; "
        "null: not pinned.",
    )


class TierOut(BaseModel):
    count: int
    bytes: int
    capacity_bytes: int
    adapters: list[EngineAdapterOut]


class EngineTenantOut(BaseModel):
    """A tenant's scheduling as the engine holds it (what the platform last pushed), and
    the service it gets: tokens served, requests queued, and its share of the recent
    service next to the share its weight asks for."""

    tenant_id: str
    tenant_name: str | None
    priority: int | None
    weight: float | None
    served_prompt_tokens: int = Field(
        0,
        description="Prompt tokens computed for it since the engines started (prefix-cache "
        "hits not; recompute after a preemption too), counted as each step computes them.",
    )
    served_output_tokens: int = Field(
        0, description="Output tokens generated for it since the engines started."
    )
    queued_requests: int = Field(0, description="Its requests waiting in the engines' queues.")
    running_requests: int = Field(0, description="Its requests running.")
    share: float | None = Field(
        None,
        description="Its fraction, 0-1, of the service over the last `share_window_s` seconds "
        "(prompt tokens count 1, output tokens 2, as the fair-share scheduler weighs them); "
        "null when no tenant was served in that window.",
    )
    weight_share: float | None = Field(
        None,
        description="Its weight / the summed weights of the tenants with requests queued or "
        "running: the share it should get while backlogged (among tenants of equal "
        "priority); null while it has no request.",
    )

    @classmethod
    def from_stats(cls, tenant_id: str, name: str | None, stats: EngineStats) -> EngineTenantOut:
        service = stats.tenants.get(tenant_id)
        figures = {}
        if service is not None:
            figures = {
                "served_prompt_tokens": service.served_prompt_tokens,
                "served_output_tokens": service.served_output_tokens,
                "queued_requests": service.queued_requests,
                "running_requests": service.running_requests,
                "share": service.share,
                "weight_share": service.weight_share,
            }
        return cls(
            tenant_id=tenant_id,
            tenant_name=name,
            priority=stats.tenant_priorities.get(tenant_id),
            weight=stats.tenant_weights.get(tenant_id),
            **figures,
        )


class EngineRowOut(BaseModel):
    """One engine's own figures (the snapshot around it merges every engine's)."""

    engine_id: str = Field(description="`local` for the engine in the platform's process.")
    url: str | None = Field(description="Where the platform reaches it (null: in process).")
    status: str = Field(description="`up`, or `unreachable` with `error` saying why.")
    error: str | None
    heartbeat_age_s: float | None = Field(
        description="Seconds since its last registry heartbeat (null: in process)."
    )
    capacity: int = Field(description="Requests it runs at once.")
    running_requests: int | None
    waiting_requests: int | None
    kv_usage: float | None = Field(description="KV blocks used / usable, 0-1.")
    preemptions: int | None
    device_adapters: int | None
    host_adapters: int | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    budget_bytes: int | None = Field(description="Its KV + adapter budget.")
    budget_source: str | None = Field(description="`set` or `machine`.")
    kv_tokens: int | None = Field(description="Tokens its budget holds as KV.")
    adapters_beside_full_batch: int | None = Field(
        description="Rank-16 adapters that fit beside a full batch's KV."
    )
    preemptions_per_min: float | None
    adapter_evictions_per_min: float | None
    adapter_reloads_per_min: float | None
    adapter_room_wait_steps_per_min: float | None
    thrashing: bool | None
    speculative_method: str | None = Field(description="`off`, `ngram` or `draft`.")
    num_speculative_tokens: int | None = Field(
        description="The most tokens a request verifies per step (0 when off)."
    )

    @classmethod
    def from_report(cls, report: EngineReport) -> EngineRowOut:
        stats = report.stats
        row = {
            "engine_id": report.engine_id,
            "url": report.url,
            "status": "up" if stats is not None else "unreachable",
            "error": report.error,
            "heartbeat_age_s": None
            if report.heartbeat_age_s is None
            else round(report.heartbeat_age_s, 1),
            "capacity": report.capacity,
        }
        if stats is None:
            figures = dict.fromkeys(set(cls.model_fields) - set(row))
            return cls(**row, **figures)
        memory, residency = stats.memory, stats.residency
        return cls(
            **row,
            running_requests=stats.running_requests,
            waiting_requests=stats.waiting_requests,
            kv_usage=stats.kv_blocks_used / stats.kv_blocks_usable,
            preemptions=stats.preemptions,
            device_adapters=len(stats.device.adapters),
            host_adapters=len(stats.host.adapters),
            ttft_p50_ms=ms(stats.ttft.p50),
            ttft_p99_ms=ms(stats.ttft.p99),
            itl_p50_ms=ms(stats.itl.p50),
            itl_p99_ms=ms(stats.itl.p99),
            budget_bytes=None if memory is None else memory.budget_bytes,
            budget_source=None if memory is None else memory.source,
            kv_tokens=None if memory is None else memory.kv_tokens,
            adapters_beside_full_batch=None
            if memory is None
            else memory.adapters_beside_full_batch,
            preemptions_per_min=residency.preemptions_per_min,
            adapter_evictions_per_min=residency.adapter_evictions_per_min,
            adapter_reloads_per_min=residency.adapter_reloads_per_min,
            adapter_room_wait_steps_per_min=residency.adapter_room_wait_steps_per_min,
            thrashing=residency.thrashing,
            speculative_method=stats.speculative_method,
            num_speculative_tokens=stats.num_speculative_tokens,
        )


class EngineSnapshotOut(BaseModel):
    taken_at: datetime
    running_requests: int
    waiting_requests: int
    kv_cache: KVCacheOut
    device: TierOut = Field(description="Adapters in device memory (shared with the KV cache).")
    host: TierOut = Field(description="Adapters parsed in host RAM (most on the device too).")
    adapters: list[EngineAdapterOut] = Field(description="Every registered adapter version.")
    latency_window_s: float
    ttft: LatencyOut = Field(description="Arrival to first token.")
    itl: LatencyOut = Field(description="Gap between consecutive tokens.")
    tenants: list[EngineTenantOut]
    share_window_s: float = Field(description="How far back each tenant's `share` looks.")
    memory: MemoryOut | None = Field(
        description="What the KV + adapter budget holds (engines' budgets added up; null "
        "from an engine too old to say)."
    )
    residency: ResidencyOut = Field(
        description="Preemptions, adapter evictions, re-loads and adapter-room waits: whether "
        "memory, not compute, is the limit."
    )
    speculation: SpeculationOut = Field(
        description="Speculative decoding: the method, tokens verified per step, and per "
        "adapter the tokens proposed and accepted and the tokens emitted per step."
    )
    grammar_cache: GrammarCacheOut = Field(
        description="Compiled structured-output grammars kept in host RAM, against their budgets."
    )
    lora_launches_per_decode_step: int | None = Field(
        default=None,
        description="LoRA op launches of the last decode step with adapters (Triton kernel "
        "launches on a GPU, native op calls on the CPU); null before one ran.",
    )
    lora_launches_per_layer: float | None = Field(
        default=None, description="The same per decoder layer (one per projection group: 4)."
    )
    engines: list[EngineRowOut] = Field(
        description="Each engine on its own; the fields above merge them (counts summed, "
        "latency percentiles the worst engine's)."
    )

    @classmethod
    def from_stats(
        cls,
        stats: EngineStats,
        *,
        taken_at: datetime,
        labels: dict[str, VersionLabel],
        tenant_names: dict[str, str],
        engines: list[EngineReport],
    ) -> EngineSnapshotOut:
        adapters = {
            name: _adapter(name, tier, labels.get(name), stats.pinned_adapters.get(name))
            for name, tier in stats.adapter_residency.items()
        }
        return cls(
            taken_at=taken_at,
            running_requests=stats.running_requests,
            waiting_requests=stats.waiting_requests,
            kv_cache=KVCacheOut(
                blocks_used=stats.kv_blocks_used,
                blocks_usable=stats.kv_blocks_usable,
                blocks_total=stats.kv_blocks_total,
                block_size=stats.kv_block_size,
                usage=stats.kv_blocks_used / stats.kv_blocks_usable,
                blocks_held=stats.kv_blocks_held,
                preemptions=stats.preemptions,
            ),
            device=_tier(stats.device, adapters),
            host=_tier(stats.host, adapters),
            adapters=list(adapters.values()),
            latency_window_s=stats.window_s,
            ttft=LatencyOut.from_summary(stats.ttft),
            itl=LatencyOut.from_summary(stats.itl),
            tenants=[
                EngineTenantOut.from_stats(tid, tenant_names.get(tid), stats)
                for tid in stats.tenant_ids
            ],
            share_window_s=stats.share_window_s,
            memory=MemoryOut.from_plan(stats.memory),
            residency=ResidencyOut.from_stats(stats.residency),
            speculation=SpeculationOut.from_stats(stats, labels),
            grammar_cache=GrammarCacheOut.from_stats(stats.grammar_cache),
            lora_launches_per_decode_step=stats.lora_launches_per_decode_step,
            lora_launches_per_layer=stats.lora_launches_per_layer,
            engines=[EngineRowOut.from_report(report) for report in engines],
        )


def _adapter(name: str, tier: str, label: VersionLabel | None, pin: str | None) -> EngineAdapterOut:
    return EngineAdapterOut(engine_name=name, tier=tier, pin=pin, **label_fields(label))


def _tier(tier: TierStats, adapters: dict[str, EngineAdapterOut]) -> TierOut:
    return TierOut(
        count=len(tier.adapters),
        bytes=tier.bytes,
        capacity_bytes=tier.capacity_bytes,
        adapters=[adapters[name] for name in tier.adapters if name in adapters],
    )
