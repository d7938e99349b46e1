"""The engine snapshot's figures, one model per part (latencies, KV cache, memory plan,
residency, grammar cache, speculation), each built from the engine's own stats
(``loramux.engine``); ``engine_schemas`` puts them in the rows of ``GET /admin/engine``.
Latencies are milliseconds; ``null`` while the window holds no sample.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from loramux.engine import (
    EngineStats,
    GrammarCacheStats,
    LatencySummary,
    MemoryPlan,
    ResidencyStats,
    SpeculationStats,
)
from loramux.platform.engine_fleet.merge import sum_speculation
from loramux.platform.services.adapters import VersionLabel

MS_PER_S = 1000.0


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * MS_PER_S, 3)


class LatencyOut(BaseModel):
    samples: int = Field(description="Samples in the window.")
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None

    @classmethod
    def from_summary(cls, summary: LatencySummary) -> LatencyOut:
        return cls(
            samples=summary.samples,
            p50_ms=ms(summary.p50),
            p90_ms=ms(summary.p90),
            p99_ms=ms(summary.p99),
        )


class KVCacheOut(BaseModel):
    blocks_used: int
    blocks_usable: int = Field(description="Blocks KV may use now (the rest hold adapters).")
    blocks_total: int
    block_size: int = Field(description="Tokens per block.")
    usage: float = Field(description="blocks_used / blocks_usable, 0-1.")
    blocks_held: int = Field(
        0, description="Released blocks held back for a waiting adapter's device memory."
    )
    preemptions: int = Field(
        0, description="Running requests preempted (recomputed later) since the engine started."
    )


class MemoryOut(BaseModel):
    """What the KV + adapter budget holds (the engine logs the same at start)."""

    budget_bytes: int = Field(description="Device bytes the KV cache and resident adapters share.")
    source: str = Field(
        description="`set` (LORAMUX_ENGINE_KV_CACHE_BYTES / kv_cache_bytes) or `machine` (sized to "
        "it at start: a share of the RAM or GPU memory available)."
    )
    detail: str = Field(description="Where the budget came from, in words.")
    device: str
    kv_blocks: int = Field(description="KV blocks the budget holds with no adapter on it.")
    kv_tokens: int = Field(description="Tokens those blocks hold.")
    block_size: int = Field(description="Tokens per block.")
    rank: int = Field(description="The adapter rank the two adapter counts are for (16).")
    rank_adapter_bytes: int = Field(description="Device bytes one adapter of that rank takes.")
    full_batch_requests: int = Field(description="A full batch: this many requests (max_num_seqs)…")
    full_batch_context: int = Field(description="…of this many tokens each.")
    full_batch_fits: bool = Field(description="Whether a full batch's KV fits the budget at all.")
    adapters_beside_full_batch: int = Field(
        description="Adapters of that rank that fit beside a full batch's KV (0 if none)."
    )
    adapters_max: int = Field(description="Adapters of that rank that fit with KV at its floor.")
    max_model_len: int = Field(
        description="The context limit: the longest request (prompt and output) in tokens."
    )
    kv_floor_blocks: int = Field(
        description="KV blocks adapters never take: those one request of max_model_len needs."
    )
    draft_kv_bytes: int = Field(
        description="Bytes of the budget given to the draft model's KV cache (0 without one)."
    )

    @classmethod
    def from_plan(cls, plan: MemoryPlan | None) -> MemoryOut | None:
        if plan is None:
            return None
        # Its fields, properties (rank_adapter_bytes, full_batch_fits) too, read off the plan.
        return cls.model_validate(plan, from_attributes=True)


class ResidencyOut(BaseModel):
    """When memory, not compute, is the limit: counts since the start and per minute over
    the last `window_s` seconds."""

    preemptions: int = Field(description="Running requests preempted (their KV recomputed later).")
    adapter_evictions: int = Field(description="Adapters evicted from device memory.")
    adapter_reloads: int = Field(
        description="Adapters loaded to the device again after it had evicted them."
    )
    adapter_room_wait_steps: int = Field(
        description="Engine steps in which a waiting request's adapter found no device room."
    )
    preemptions_per_min: float
    adapter_evictions_per_min: float
    adapter_reloads_per_min: float
    adapter_room_wait_steps_per_min: float
    window_s: float = Field(description="How far back the per-minute rates look.")
    thrashing: bool = Field(
        description="Re-loads at 30 a minute or more: adapters thrash; raise "
        "LORAMUX_ENGINE_KV_CACHE_BYTES or lower LORAMUX_ENGINE_MAX_NUM_SEQS."
    )

    @classmethod
    def from_stats(cls, stats: ResidencyStats) -> ResidencyOut:
        return cls.model_validate(stats, from_attributes=True)


class GrammarCacheOut(BaseModel):
    """Compiled structured-output grammars kept in host RAM for reuse (engines' summed)."""

    bytes: int = Field(description="Bytes the cached grammars hold, as measured at compile.")
    entries: int = Field(description="Grammars cached (one per tenant and schema).")
    budget_bytes: int = Field(
        description="The most kept (LORAMUX_ENGINE_GRAMMAR_CACHE_BYTES); least recently used go."
    )
    tenant_budget_bytes: int = Field(
        description="The most one tenant's grammars keep (LORAMUX_ENGINE_GRAMMAR_CACHE_TENANT_BYTES)."
    )
    tenants: int = Field(description="Tenants with a cached grammar.")
    largest_tenant_bytes: int = Field(description="The bytes of the tenant holding most.")
    hits: int = Field(description="Compiles answered from the cache.")
    misses: int = Field(description="Compiles run (failed ones too).")
    evictions: int = Field(description="Grammars evicted to fit a budget.")
    tenant_evictions: int = Field(description="Of those, evicted to fit their own tenant's.")
    evicted_bytes: int
    not_kept: int = Field(description="Grammars larger than the tenant budget: used, not kept.")

    @classmethod
    def from_stats(cls, stats: GrammarCacheStats) -> GrammarCacheOut:
        return cls.model_validate(stats, from_attributes=True)


class SpeculationFiguresOut(BaseModel):
    """Speculative decoding's totals since the engines started."""

    proposed_tokens: int = Field(description="Tokens proposed for verification.")
    accepted_tokens: int = Field(description="Proposed tokens the model accepted.")
    verify_steps: int = Field(description="Request-steps that verified proposals.")
    decode_steps: int = Field(
        description="Request-steps that emitted tokens (with or without proposals)."
    )
    generated_tokens: int = Field(description="Tokens emitted (what is billed).")
    acceptance_rate: float | None = Field(
        description="accepted_tokens / proposed_tokens, 0-1; null before any proposal."
    )
    tokens_per_step: float | None = Field(
        description="generated_tokens / decode_steps: 1.0 without speculation, more the more "
        "it gains; null before any token."
    )

    @staticmethod
    def figures(stats: SpeculationStats) -> dict:
        """The totals and the rates (properties of ``stats``) by this model's field names."""
        return {name: getattr(stats, name) for name in SpeculationFiguresOut.model_fields}


class AdapterSpeculationOut(SpeculationFiguresOut):
    """One adapter version's (or the base model's) speculative decoding; names are null for
    the base model and for versions the database does not know."""

    engine_name: str = Field(
        description="The engine's name of the adapter version (its id); empty for the base model."
    )
    tenant_id: str | None
    tenant_name: str | None
    adapter: str | None
    version: int | None


class SpeculationOut(BaseModel):
    """Speculative decoding: how the engines propose tokens to verify, and per adapter what
    was proposed, accepted and gained (tokens per step)."""

    method: str = Field(
        description="`off`, `ngram` (prompt lookup) or `draft`; `mixed` when engines differ "
        "(each engine's row says its own). Set by LORAMUX_ENGINE_SPECULATIVE_METHOD."
    )
    num_speculative_tokens: int = Field(
        description="The most tokens a request verifies per step (0 when off; the largest "
        "of the engines' when mixed)."
    )
    adapters: list[AdapterSpeculationOut] = Field(
        description="Per adapter version, the base model first; those with no request served "
        "since the engines started are left out."
    )
    total: SpeculationFiguresOut = Field(description="The adapters' figures added up.")

    @classmethod
    def from_stats(cls, stats: EngineStats, labels: dict[str, VersionLabel]) -> SpeculationOut:
        def order(name: str) -> tuple:
            label = labels.get(name)
            if label is None:
                return (name != "", 1, name)
            return (True, 0, label.tenant_name, label.adapter, label.version)

        return cls(
            method=stats.speculative_method,
            num_speculative_tokens=stats.num_speculative_tokens,
            adapters=[
                AdapterSpeculationOut(
                    engine_name=name,
                    **label_fields(labels.get(name)),
                    **SpeculationFiguresOut.figures(stats.speculation[name]),
                )
                for name in sorted(stats.speculation, key=order)
            ],
            total=SpeculationFiguresOut.model_validate(
                sum_speculation(list(stats.speculation.values())), from_attributes=True
            ),
        )


def label_fields(label: VersionLabel | None) -> dict:
    """The database's names of an adapter version (null where it does not know it)."""
    return {
        "tenant_id": label and label.tenant_id,
        "tenant_name": label and label.tenant_name,
        "adapter": label and label.adapter,
        "version": label and label.version,
    }
