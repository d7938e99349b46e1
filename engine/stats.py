"""A live snapshot of one engine for operators: load, KV cache, adapter tiers, latency,
what the memory budget holds and whether memory is the limit (``residency``), and what the
compiled-grammar cache holds.

Prometheus histograms (``metrics.py``) count since the process started; an operator
watching the engine wants *recent* latency instead, so the engine also keeps the last
TTFT and inter-token samples in a :class:`LatencyWindow` (bounded in count and in age)
and reports their percentiles in :class:`EngineStats`, a plain value built on the engine
thread by ``Engine.stats()``.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loramux.engine import dataclass_json
from loramux.engine.lora.tiers import AdapterTiers, Tier
from loramux.engine.memory.plan import MemoryPlan
from loramux.engine.residency import ResidencyStats
from loramux.engine.structured.grammar_cache import GrammarCacheStats
from loramux.engine.tenant_share import DEFAULT_SHARE_WINDOW_S, TenantShareStats

DEFAULT_WINDOW_S = 300.0  # percentiles cover the last five minutes...
DEFAULT_MAX_SAMPLES = 4096  # ...or this many samples, whichever is fewer


@dataclass(frozen=True)
class LatencySummary:
    """Percentiles (seconds) of the samples in a window; ``None`` while it is empty."""

    samples: int
    p50: float | None
    p90: float | None
    p99: float | None


def percentile(ordered: list[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile of a non-empty ascending list."""
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


class LatencyWindow:
    """The recent samples of one latency: at most ``max_samples``, none older than
    ``window_s`` seconds (by ``clock``)."""

    def __init__(
        self,
        window_s: float = DEFAULT_WINDOW_S,
        max_samples: int = DEFAULT_MAX_SAMPLES,
        clock: Callable[[], float] = time.monotonic,
    ):
        if window_s <= 0 or max_samples < 1:
            raise ValueError("a latency window needs window_s > 0 and max_samples >= 1")
        self.window_s = window_s
        self._clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (when, value)

    def add(self, seconds: float) -> None:
        self._samples.append((self._clock(), seconds))

    def _drop_old(self) -> None:
        oldest = self._clock() - self.window_s
        while self._samples and self._samples[0][0] < oldest:
            self._samples.popleft()

    def summary(self) -> LatencySummary:
        self._drop_old()
        ordered = sorted(value for _, value in self._samples)
        if not ordered:
            return LatencySummary(samples=0, p50=None, p90=None, p99=None)
        return LatencySummary(
            samples=len(ordered),
            p50=percentile(ordered, 50),
            p90=percentile(ordered, 90),
            p99=percentile(ordered, 99),
        )


@dataclass
class SpeculationStats:
    """Speculative decoding for one adapter's requests since the engine started (the base
    model's under the empty name): proposals verified and accepted, and the steps that
    emitted its tokens, so tokens per step shows what speculation gained."""

    proposed_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0  # request-steps that verified proposals
    decode_steps: int = 0  # request-steps that emitted tokens (with or without proposals)
    generated_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed; None before anything was proposed."""
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else None

    @property
    def tokens_per_step(self) -> float | None:
        """Generated tokens per request-step; 1.0 without speculation."""
        return self.generated_tokens / self.decode_steps if self.decode_steps else None


@dataclass(frozen=True)
class TierStats:
    """Adapters held in one memory tier: their engine names, bytes used and the most the
    tier may hold."""

    adapters: tuple[str, ...]
    bytes: int
    capacity_bytes: int


@dataclass(frozen=True)
class EngineStats:
    """What the engine is doing now (``Engine.stats()``): one value from the engine to the
    engine process's wire, the fleet's merge and the admin API. ``to_json`` / ``from_json``
    carry it losslessly (``dataclass_json``: the tenant maps, keyed by ``None`` too, travel as
    ``[tenant, value]`` pairs; ``speculation`` as adapter -> totals, the base model under "").
    An older engine's JSON, without the memory plan, residency counts, per-tenant service,
    speculation or grammar-cache figures, still parses: those take their defaults; figures a
    newer engine adds are dropped."""

    running_requests: int
    waiting_requests: int
    kv_blocks_used: int
    kv_blocks_usable: int  # blocks KV may use now (the rest lent to resident adapters)
    kv_blocks_total: int
    kv_block_size: int  # tokens per block
    device: TierStats  # adapters in device memory
    host: TierStats  # adapters parsed in host RAM (those on the device too, usually)
    adapter_residency: dict[str, str]  # every registered adapter -> its fastest tier
    ttft: LatencySummary  # arrival to first token
    itl: LatencySummary  # gap between consecutive tokens
    window_s: float  # how far back the latency samples go
    tenant_priorities: dict[str | None, int]  # as last set by set_tenant_priority
    tenant_weights: dict[str | None, float]  # the fair-share weights the scheduler uses
    # Released KV blocks held back for a cold adapter's device rows (see kv_cache.hold_from).
    kv_blocks_held: int = 0
    preemptions: int = 0  # running requests sent back to the queue since the engine started
    # Preemptions, device evictions, re-loads and adapter-room waits: since the start and
    # over the last minute (residency.py).
    residency: ResidencyStats = field(default_factory=ResidencyStats)
    memory: MemoryPlan | None = None  # what the KV + adapter budget holds (memory/plan.py)
    # Per tenant: tokens served, queue depth, share of the recent window next to the weight's
    # share (tenant_share.py); the default tenant None too.
    tenants: dict[str | None, TenantShareStats] = field(default_factory=dict)
    share_window_s: float = DEFAULT_SHARE_WINDOW_S  # how far back ``share`` looks
    # Speculative decoding: the method ("off", "ngram", "draft"), the most proposals a
    # request verifies per step, and per adapter what was proposed, accepted and emitted.
    # Adapters pinned on the device (Engine.keep_adapter) -> "pinned", or why not yet.
    pinned_adapters: dict[str, str] = field(default_factory=dict)
    speculative_method: str = "off"
    num_speculative_tokens: int = 0
    speculation: dict[str, SpeculationStats] = field(default_factory=dict)
    # Compiled structured-output grammars kept in host RAM: bytes and entries against the
    # engine's and each tenant's budget, evictions (structured/grammar_cache.py).
    grammar_cache: GrammarCacheStats = field(default_factory=GrammarCacheStats)
    # LoRA op launches (Triton kernel launches on a GPU, native op calls on the CPU) of the
    # last decode-only step with adapters, and per decoder layer; None before one ran and
    # on a simulated device.
    lora_launches_per_decode_step: int | None = None
    lora_launches_per_layer: float | None = None

    @property
    def tenant_ids(self) -> list[str]:
        """Tenants the engine holds scheduling for (the default tenant ``None`` left out)."""
        known = {*self.tenant_priorities, *self.tenant_weights, *self.tenants}
        return sorted(tenant for tenant in known if tenant is not None)

    def to_json(self) -> dict[str, Any]:
        return dataclass_json.to_json(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EngineStats:
        if "adapter_residency" not in data:
            # An engine from before the memory figures: "residency" was adapter -> tier.
            data = dict(data)
            data["adapter_residency"] = data.pop("residency", None) or {}
        return dataclass_json.from_json(cls, data)


def tier_stats(tiers: AdapterTiers, bytes_per_row: int) -> tuple[TierStats, TierStats]:
    """(device, host) occupancy of the adapter tiers."""
    residency = tiers.residency()
    on_device = tuple(name for name, tier in residency.items() if tier == Tier.DEVICE)
    in_host = tuple(name for name in residency if tiers.get(name).adapter_id in tiers.host)
    device = TierStats(
        adapters=on_device,
        bytes=tiers.pool.bytes_used,
        capacity_bytes=tiers.pool.capacity * bytes_per_row,
    )
    host = TierStats(
        adapters=in_host, bytes=tiers.host.bytes_used, capacity_bytes=tiers.host.max_bytes
    )
    return device, host


class LatencyRecorder:
    """The engine's TTFT and inter-token windows, fed as tokens are produced."""

    def __init__(
        self, window_s: float = DEFAULT_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ):
        self.ttft = LatencyWindow(window_s, clock=clock)
        self.itl = LatencyWindow(window_s, clock=clock)

    @property
    def window_s(self) -> float:
        return self.ttft.window_s

    def snapshot(self) -> tuple[LatencySummary, LatencySummary]:
        return self.ttft.summary(), self.itl.summary()
