"""Several engines' snapshots as one (``GET /admin/engine``'s merged view, routing's
residency): counts, rates, budgets and bytes summed, each adapter at the fastest tier any
engine holds it in, latency percentiles the worst engine's (percentiles of a union are not
derivable from the parts' percentiles). Per tenant, tokens served and requests queued and
running are summed and the shares recomputed from the summed window tokens: a tenant's
share of the fleet, not of any one engine. Speculative decoding's totals are summed per
adapter (so its acceptance rate and tokens per step are the fleet's); the method and the
proposals per step are the engines' own when they agree, else "mixed" and the most any
engine verifies. The compiled-grammar caches' figures are summed."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import TypeVar

from loramux.engine import (
    EngineStats,
    GrammarCacheStats,
    LatencySummary,
    MemoryPlan,
    ResidencyStats,
    SpeculationStats,
    TierStats,
    merge_tenants,
)

F = TypeVar("F")

_TIER_ORDER = {"device": 0, "host": 1, "loading": 2, "store": 3}


def fastest_tiers(residencies: list[dict[str, str]]) -> dict[str, str]:
    """Per adapter, the fastest tier any engine holds it in."""
    merged: dict[str, str] = {}
    for residency in residencies:
        for name, tier in residency.items():
            if _TIER_ORDER.get(tier, 9) < _TIER_ORDER.get(merged.get(name, ""), 9):
                merged[name] = tier
    return merged


def _worst(latencies: list[LatencySummary]) -> LatencySummary:
    def worst(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return max(known) if known else None

    return LatencySummary(
        samples=sum(s.samples for s in latencies),
        p50=worst([s.p50 for s in latencies]),
        p90=worst([s.p90 for s in latencies]),
        p99=worst([s.p99 for s in latencies]),
    )


def _sum_fields(cls: type[F], parts: list[F], **others: object) -> F:
    """A ``cls`` value with each field summed over ``parts``, but those given in ``others``."""
    summed = {
        f.name: sum(getattr(p, f.name) for p in parts) for f in fields(cls) if f.name not in others
    }
    return cls(**summed, **others)


def _merge_tier(tiers: list[TierStats]) -> TierStats:
    return _sum_fields(
        TierStats, tiers, adapters=tuple(sorted({a for t in tiers for a in t.adapters}))
    )


def _merge_residency(parts: list[ResidencyStats]) -> ResidencyStats:
    """Counts and rates summed; thrashing if any engine thrashes."""
    return _sum_fields(
        ResidencyStats,
        parts,
        window_s=max(p.window_s for p in parts),
        thrashing=any(p.thrashing for p in parts),
    )


def _merge_memory(plans: list[MemoryPlan]) -> MemoryPlan | None:
    """Budgets, blocks, tokens and adapter counts summed (each engine holds its own); the
    per-block and per-row figures are the first engine's (one model behind the platform)."""
    if not plans:
        return None
    if len(plans) == 1:
        return plans[0]
    sources = {p.source for p in plans}
    return replace(
        plans[0],
        budget_bytes=sum(p.budget_bytes for p in plans),
        source=sources.pop() if len(sources) == 1 else "mixed",
        detail=f"{len(plans)} engines' budgets added up",
        device=", ".join(sorted({p.device for p in plans})),
        kv_blocks=sum(p.kv_blocks for p in plans),
        kv_tokens=sum(p.kv_tokens for p in plans),
        full_batch_requests=sum(p.full_batch_requests for p in plans),
        full_batch_blocks=sum(p.full_batch_blocks for p in plans),
        adapters_beside_full_batch=sum(p.adapters_beside_full_batch for p in plans),
        adapters_max=sum(p.adapters_max for p in plans),
        draft_kv_bytes=sum(p.draft_kv_bytes for p in plans),
        max_model_len=min(p.max_model_len for p in plans),  # what every engine takes
    )


def sum_speculation(parts: list[SpeculationStats]) -> SpeculationStats:
    """Speculative decoding's totals added up (over engines, or over adapters)."""
    return _sum_fields(SpeculationStats, parts)


def _merge_speculation(parts: list[dict[str, SpeculationStats]]) -> dict[str, SpeculationStats]:
    """Per adapter, every engine's totals summed."""
    adapters = sorted({name for part in parts for name in part})
    return {
        name: sum_speculation([part[name] for part in parts if name in part]) for name in adapters
    }


def _merge_grammar_cache(parts: list[GrammarCacheStats]) -> GrammarCacheStats:
    """Held bytes, entries, budgets and counts summed (each engine keeps its own grammars,
    and gives each tenant its own share); the largest tenant's bytes the largest on one
    engine."""
    return _sum_fields(
        GrammarCacheStats,
        parts,
        largest_tenant_bytes=max((p.largest_tenant_bytes for p in parts), default=0),
    )


def _one_or_mixed(values: list[str]) -> str:
    distinct = set(values)
    return distinct.pop() if len(distinct) == 1 else "mixed"


def merge_stats(parts: list[EngineStats]) -> EngineStats:
    return EngineStats(
        running_requests=sum(p.running_requests for p in parts),
        waiting_requests=sum(p.waiting_requests for p in parts),
        kv_blocks_used=sum(p.kv_blocks_used for p in parts),
        kv_blocks_usable=sum(p.kv_blocks_usable for p in parts),
        kv_blocks_total=sum(p.kv_blocks_total for p in parts),
        kv_block_size=parts[0].kv_block_size,
        kv_blocks_held=sum(p.kv_blocks_held for p in parts),
        preemptions=sum(p.preemptions for p in parts),
        device=_merge_tier([p.device for p in parts]),
        host=_merge_tier([p.host for p in parts]),
        adapter_residency=fastest_tiers([p.adapter_residency for p in parts]),
        pinned_adapters=merge_pin_states([p.pinned_adapters for p in parts]),
        residency=_merge_residency([p.residency for p in parts]),
        memory=_merge_memory([p.memory for p in parts if p.memory is not None]),
        ttft=_worst([p.ttft for p in parts]),
        itl=_worst([p.itl for p in parts]),
        window_s=max(p.window_s for p in parts),
        tenant_priorities={k: v for p in parts for k, v in p.tenant_priorities.items()},
        tenant_weights={k: v for p in parts for k, v in p.tenant_weights.items()},
        tenants=merge_tenants([p.tenants for p in parts]),
        share_window_s=max(p.share_window_s for p in parts),
        speculative_method=_one_or_mixed([p.speculative_method for p in parts]),
        num_speculative_tokens=max(p.num_speculative_tokens for p in parts),
        speculation=_merge_speculation([p.speculation for p in parts]),
        grammar_cache=_merge_grammar_cache([p.grammar_cache for p in parts]),
        lora_launches_per_decode_step=_most([p.lora_launches_per_decode_step for p in parts]),
        lora_launches_per_layer=_most([p.lora_launches_per_layer for p in parts]),
    )


def merge_pin_states(parts: list[dict[str, str]]) -> dict[str, str]:
    """Each pinned adapter -> ``pinned`` when every engine that pins it holds it, else the
    first engine's reason and how many of them hold it."""
    merged: dict[str, str] = {}
    for name in sorted({name for part in parts for name in part}):
        states = [part[name] for part in parts if name in part]
        not_held = [state for state in states if state != "pinned"]
        merged[name] = (
            "pinned"
            if not not_held
            else f"pinned on {len(states) - len(not_held)} of {len(states)} engines; {not_held[0]}"
            if len(states) > 1
            else not_held[0]
        )
    return merged


def _most(values):
    """The largest of the engines' figures (the costliest engine's), None if none has one."""
    known = [v for v in values if v is not None]
    return max(known) if known else None
