"""VTC fair share: a virtual token counter per tenant (Sheng et al., "Fairness in Serving
Large Language Models"), as the scheduler uses it.

Each tenant's counter grows by the service it receives divided by its weight: a prompt
token computed costs ``PROMPT_TOKEN_COST``, a generated one ``OUTPUT_TOKEN_COST``. The
scheduler admits the waiting tenant with the lowest counter first (within a priority
class), so tenants that stay backlogged receive service in proportion to their weights.
``activate`` keeps credit from being banked; ``charge_scheduled`` charges each token once,
when it is scheduled. Tenants whose counters are equal go least recently served first
(``recency``): a tenant that joins lifted to the lowest counter ties with the tenant holding
it, and is served before it, not after all that tenant's queued work (round robin).
"""

from __future__ import annotations

import itertools

PROMPT_TOKEN_COST = 1.0
OUTPUT_TOKEN_COST = 2.0


class FairShare:
    """Virtual token counters per tenant (VTC)."""

    def __init__(self) -> None:
        self.counters: dict[str | None, float] = {}
        self.weights: dict[str | None, float] = {}
        # request id -> tokens charged to its tenant so far (the most it ever computed)
        self._charged: dict[str, int] = {}
        self._served: dict[str | None, int] = {}  # tenant -> when it was last charged
        self._charges = itertools.count(1)

    def set_weight(self, tenant: str | None, weight: float) -> None:
        if not weight > 0:
            raise ValueError(f"tenant weight must be > 0, got {weight}")
        self.weights[tenant] = weight

    def counter(self, tenant: str | None) -> float:
        return self.counters.get(tenant, 0.0)

    def recency(self, tenant: str | None) -> int:
        """Orders tenants by when they were last charged: 0 for never, larger for later."""
        return self._served.get(tenant, 0)

    def activate(self, tenant: str | None, peers: set[str | None]) -> None:
        """A tenant with nothing queued joins: lift it to the lowest counter of ``peers``
        (other than its own), never lower it."""
        others = [self.counters.get(t, 0.0) for t in peers if t != tenant]
        floor = min(others) if others else self.counters.get(tenant, 0.0)
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def charge(self, tenant: str | None, prompt_tokens: int, output_tokens: int) -> None:
        cost = prompt_tokens * PROMPT_TOKEN_COST + output_tokens * OUTPUT_TOKEN_COST
        self.counters[tenant] = self.counter(tenant) + cost / self.weights.get(tenant, 1.0)
        if cost > 0:
            self._served[tenant] = next(self._charges)

    def charge_scheduled(
        self, tenant: str | None, request_id: str, computed: int, num_tokens: int, samples: bool
    ) -> None:
        """Charge ``tenant`` for the tokens ``[computed, computed + num_tokens)`` of a request
        scheduled now that are computed for the first time.

        Charged when scheduled, not when computed, so that admission within one step sees
        it: several slots freed at once went all to the tenant lowest at the step's start
        (a weight-1 tenant took 7 of 8 slots, then waited for hundreds of steps). The last
        token of a sampling chunk is the one whose logits make the new token: it counts as
        output, the rest of the chunk as prompt. Tokens computed again after a preemption
        (or a step cut short) are not charged: the scheduler chose to recompute them and
        the tenant received nothing more (charging them made a tenant preempted by the
        share rule pay for it in the share it got).
        """
        end = computed + num_tokens
        charged = self._charged.get(request_id, 0)
        self._charged[request_id] = max(end, charged)
        fresh = end - max(computed, charged)
        output = 1 if samples and fresh > 0 else 0
        self.charge(tenant, max(0, fresh - output), output)

    def charge_accepted(
        self, tenant: str | None, request_id: str, num_tokens: int, computed: int
    ) -> None:
        """Charge ``tenant`` for ``num_tokens`` generated tokens a step emitted beyond the one
        it scheduled (accepted speculative proposals: they were not charged when scheduled);
        their KV is computed up to ``computed``, so a recompute after a preemption does not
        charge them again as prompt."""
        self.charge(tenant, 0, num_tokens)
        self._charged[request_id] = max(self._charged.get(request_id, 0), computed)

    def forget(self, request_id: str) -> None:
        """The request ended: nothing more is charged for it."""
        self._charged.pop(request_id, None)
