"""Each tenant's service as the engine gives it: tokens served, queue depth, and its share
of the last 30 seconds next to its weight's share.

Tokens are counted in the step that computes or generates them (``TenantShare.record_step``,
fed by ``Engine.step`` before the scheduler applies the step), not when a request finishes:
a request's usage lands all at once at its end, so a share counted from finished requests
swings (2.5 to 3.6 over 30-second windows for a true 3:1 share) with how many requests
happen to end inside the window.

What is counted, per tenant:

* **prompt tokens**: tokens computed by prefill, chunk by chunk, including recompute after
  a preemption; prefix-cache hits are not computed and not counted;
* **output tokens**: tokens generated (one per sampling step).

**Share** is *service*, weighted as the scheduler's fair share (VTC) weighs it: a prompt
token costs ``PROMPT_TOKEN_COST``, an output token ``OUTPUT_TOKEN_COST`` (1 and 2). VTC
gives each backlogged tenant of a priority class service in proportion to its weight, so
a tenant's ``share`` (its service over the last ``window_s`` / everyone's) is what its
``weight_share`` (its weight / the summed weights of the tenants with requests queued or
running) says it should be when the fair share holds. The two sit side by side in the
engine panel and ``/metrics``. (VTC charges the last token of a prefill as the one that
produced an output; here it is a prompt token: the share differs from the scheduler's
charge by one cost unit per prefill, well under 1% for real requests.) Tenants of higher
priority are served first, whatever the weights: compare shares within a priority.

The window is a ring of one-second buckets (memory bounded by window_s × tenants, tenants
bounded by the platform), so it looks back between ``window_s - 1`` and ``window_s``
seconds. Window token counts travel with the snapshot so that several engines' shares can
be merged (``with_shares`` on the summed counts).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from loramux.engine.fair_share import OUTPUT_TOKEN_COST, PROMPT_TOKEN_COST
from loramux.engine.scheduler import ScheduledSequence
from loramux.engine.sequence import Sequence, SequenceStatus

DEFAULT_SHARE_WINDOW_S = 30.0
BUCKET_S = 1.0
DEFAULT_WEIGHT = 1.0  # the scheduler's weight for a tenant it was never told of

Tenant = str | None


@dataclass(frozen=True)
class TenantShareStats:
    """One tenant's service (``EngineStats.tenants``)."""

    served_prompt_tokens: int  # since the engine started
    served_output_tokens: int
    window_prompt_tokens: int  # over the last window (what share is computed from)
    window_output_tokens: int
    queued_requests: int  # waiting in the scheduler (preempted ones included)
    running_requests: int
    weight: float  # the fair-share weight the scheduler uses
    share: float | None = None  # its service / everyone's over the window; None: none served
    weight_share: float | None = None  # weight / Σ weights of tenants with work; None: no work

    @property
    def window_service(self) -> float:
        return service(self.window_prompt_tokens, self.window_output_tokens)

    @property
    def has_work(self) -> bool:
        return self.queued_requests + self.running_requests > 0


def service(prompt_tokens: int, output_tokens: int) -> float:
    """Tokens weighted as the scheduler's fair share charges them."""
    return prompt_tokens * PROMPT_TOKEN_COST + output_tokens * OUTPUT_TOKEN_COST


def with_shares(tenants: dict[Tenant, TenantShareStats]) -> dict[Tenant, TenantShareStats]:
    """``tenants`` with ``share`` and ``weight_share`` computed from their window tokens,
    queues and weights (one engine's, or several engines' summed)."""
    total_service = sum(t.window_service for t in tenants.values())
    total_weight = sum(t.weight for t in tenants.values() if t.has_work)
    return {
        tenant: replace(
            stats,
            share=stats.window_service / total_service if total_service > 0 else None,
            weight_share=stats.weight / total_weight if stats.has_work else None,
        )
        for tenant, stats in tenants.items()
    }


def merge_tenants(parts: list[dict[Tenant, TenantShareStats]]) -> dict[Tenant, TenantShareStats]:
    """Several engines' tenants as one: tokens and requests summed, the weight the largest
    any engine holds (the platform pushes the same to each), shares recomputed."""
    merged: dict[Tenant, TenantShareStats] = {}
    for part in parts:
        for tenant, stats in part.items():
            seen = merged.get(tenant)
            if seen is None:
                merged[tenant] = stats
                continue
            merged[tenant] = TenantShareStats(
                served_prompt_tokens=seen.served_prompt_tokens + stats.served_prompt_tokens,
                served_output_tokens=seen.served_output_tokens + stats.served_output_tokens,
                window_prompt_tokens=seen.window_prompt_tokens + stats.window_prompt_tokens,
                window_output_tokens=seen.window_output_tokens + stats.window_output_tokens,
                queued_requests=seen.queued_requests + stats.queued_requests,
                running_requests=seen.running_requests + stats.running_requests,
                weight=max(seen.weight, stats.weight),
            )
    return with_shares(merged)


def served_in_step(
    scheduled: Iterable[ScheduledSequence], emitted: Mapping[str, int] | None = None
) -> dict[Tenant, tuple[int, int]]:
    """(prompt, output) tokens per tenant that a step served: call it after the step ran
    and before the scheduler applies it (sequences failed or aborted meanwhile got nothing).

    ``emitted``: request id -> the tokens the step emitted for it, where that is more than
    one (speculative decoding: accepted proposals and one more; a stop inside the run may
    leave the last of them undelivered, they were served all the same)."""
    emitted = emitted or {}
    served: dict[Tenant, tuple[int, int]] = {}
    for item in scheduled:
        seq = item.seq
        if seq.status is not SequenceStatus.RUNNING:
            continue
        # A decode computes the last generated token and samples the next; any other chunk
        # computes prompt (or, after a preemption, recomputes prompt and output) tokens.
        decode = item.samples and item.num_tokens == 1 and bool(seq.output_token_ids)
        prompt = 0 if decode else item.num_tokens
        output = emitted.get(seq.request_id, 1) if item.samples else 0
        before = served.get(seq.tenant, (0, 0))
        served[seq.tenant] = (before[0] + prompt, before[1] + output)
    return served


class TenantShare:
    """Tokens served per tenant, since the start and over a sliding window."""

    def __init__(
        self,
        window_s: float = DEFAULT_SHARE_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if window_s < BUCKET_S:
            raise ValueError(f"a share window needs window_s >= {BUCKET_S}")
        self.window_s = window_s
        self._clock = clock
        self._buckets_kept = math.ceil(window_s / BUCKET_S)
        self._totals: dict[Tenant, tuple[int, int]] = {}
        # (bucket index, tenant -> [prompt, output]), oldest first; _window sums them.
        self._buckets: deque[tuple[int, dict[Tenant, list[int]]]] = deque()
        self._window: dict[Tenant, list[int]] = {}
        self._seen: set[Tenant] = set()  # every tenant ever reported stays (its gauges go to 0)

    def record_step(
        self, scheduled: Iterable[ScheduledSequence], emitted: Mapping[str, int] | None = None
    ) -> dict[Tenant, tuple[int, int]]:
        """Count what a step served (see ``served_in_step``); returns it."""
        served = served_in_step(scheduled, emitted)
        if not served:
            return served
        bucket = self._current_bucket()
        for tenant, (prompt, output) in served.items():
            total = self._totals.get(tenant, (0, 0))
            self._totals[tenant] = (total[0] + prompt, total[1] + output)
            for counts in (
                bucket.setdefault(tenant, [0, 0]),
                self._window.setdefault(tenant, [0, 0]),
            ):
                counts[0] += prompt
                counts[1] += output
        return served

    def _current_bucket(self) -> dict[Tenant, list[int]]:
        index = self._expire()
        if not self._buckets or self._buckets[-1][0] != index:
            self._buckets.append((index, {}))
        return self._buckets[-1][1]

    def _expire(self) -> int:
        """Drop the buckets that left the window; returns the current bucket's index."""
        index = math.floor(self._clock() / BUCKET_S)
        while self._buckets and self._buckets[0][0] <= index - self._buckets_kept:
            _, old = self._buckets.popleft()
            for tenant, (prompt, output) in old.items():
                counts = self._window[tenant]
                counts[0] -= prompt
                counts[1] -= output
        return index

    def snapshot(
        self,
        waiting: Iterable[Sequence],
        running: Iterable[Sequence],
        weights: dict[Tenant, float],
    ) -> dict[Tenant, TenantShareStats]:
        """Every tenant that was served, has requests or has a weight: its counts, queue
        and shares now (``waiting``, ``running``: the scheduler's sequences)."""
        self._expire()
        queued, runs = _per_tenant(waiting), _per_tenant(running)
        self._seen.update(queued, runs, weights)
        known = {*self._totals, *self._seen}
        return with_shares(
            {
                tenant: TenantShareStats(
                    served_prompt_tokens=self._totals.get(tenant, (0, 0))[0],
                    served_output_tokens=self._totals.get(tenant, (0, 0))[1],
                    window_prompt_tokens=self._window.get(tenant, [0, 0])[0],
                    window_output_tokens=self._window.get(tenant, [0, 0])[1],
                    queued_requests=queued.get(tenant, 0),
                    running_requests=runs.get(tenant, 0),
                    weight=weights.get(tenant, DEFAULT_WEIGHT),
                )
                for tenant in known
            }
        )


def _per_tenant(sequences: Iterable[Sequence]) -> dict[Tenant, int]:
    counts: dict[Tenant, int] = {}
    for seq in sequences:
        counts[seq.tenant] = counts.get(seq.tenant, 0) + 1
    return counts
