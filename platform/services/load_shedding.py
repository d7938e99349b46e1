"""Admission by load: queue limits (429) and refusing what would start too late (503).

The queue is what this process admitted that the engine has not started: each choice of a
request (``n`` of them) counts from its admission until its first token. Two limits bound
it, checked before anything runs:

- the tenant's: ``max_queued_requests`` on the tenant, else
  ``LORAMUX_MAX_QUEUED_REQUESTS_PER_TENANT``;
- everyone's: ``LORAMUX_MAX_QUEUED_REQUESTS``.

A request that would pass either is refused at once with 429 ``queue_full`` and a
``Retry-After`` of about the time the queue takes to drain that far.

A request that fits is then checked against its deadline (``deadlines.py``): its predicted
time to first token is the time the choices queued ahead of it (its priority or higher)
take to get a slot, plus its own prefill,

    wait    = ahead × slot_seconds / slots
    prefill = first_token_seconds × max(1, prompt_tokens / mean_prompt_tokens)

with ``slot_seconds`` (how long a request holds one of the ``slots``, scheduled to finished;
the slots are every live engine's ``max_num_seqs`` together), ``first_token_seconds`` (scheduled to first token) and ``mean_prompt_tokens``
measured by :class:`ServiceRates` from the engine's own request metrics, as moving averages.
When that prediction already passes the deadline the request is refused at once with 503
``deadline_unattainable`` and the figures, instead of waiting to fail. Until a few requests
have been measured nothing is predicted and nothing refused.

Refusals and expiries are counted per tenant for ``/metrics`` (``LoadMetrics``). The queue
is this process's: several platform replicas each bound their own.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client import Counter as PromCounter

from loramux.engine import RequestOutput
from loramux.platform.errors import Invalid, QuotaExceeded, Unavailable
from loramux.platform.services.deadlines import Deadline

MIN_SAMPLES = 3  # requests measured before anything is predicted
SMOOTHING = 0.2  # weight of the newest sample in the moving averages


@dataclass(frozen=True)
class QueueLimits:
    total: int  # choices queued across tenants
    per_tenant: int  # a tenant's queued choices, unless the tenant sets its own


class _Average:
    """An exponentially weighted moving average with a sample count."""

    def __init__(self) -> None:
        self.value: float | None = None
        self.samples = 0

    def add(self, sample: float) -> None:
        self.samples += 1
        self.value = (
            sample if self.value is None else self.value + SMOOTHING * (sample - self.value)
        )


class ServiceRates:
    """How fast the engine serves, measured from the metrics on its outputs."""

    def __init__(self, slots: Callable[[], int]):
        self._slots = slots  # requests the engine(s) run at once: max_num_seqs, summed
        self.first_token_s = _Average()
        self.prompt_tokens = _Average()
        self.slot_s = _Average()

    def observe_first(self, out: RequestOutput) -> None:
        m = out.metrics
        if m is None or m.first_scheduled_time is None or m.first_token_time is None:
            return
        self.first_token_s.add(max(0.0, m.first_token_time - m.first_scheduled_time))
        self.prompt_tokens.add(max(1, m.prompt_tokens - m.cached_prompt_tokens))

    def observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        if m is None or m.first_scheduled_time is None or m.finished_time is None:
            return
        if out.finish_reason in ("stop", "length"):  # aborted ones say little of the rate
            self.slot_s.add(max(0.0, m.finished_time - m.first_scheduled_time))

    @property
    def slots(self) -> int:
        return max(1, self._slots())  # none live: routing refuses anyway

    @property
    def measured(self) -> bool:
        return min(self.first_token_s.samples, self.slot_s.samples) >= MIN_SAMPLES

    def seconds_to_start(self, ahead: int) -> float:
        """Predicted wait for a slot behind ``ahead`` queued choices (needs ``measured``)."""
        assert self.slot_s.value is not None
        return ahead * self.slot_s.value / self.slots

    def prefill_seconds(self, prompt_tokens: int) -> float:
        assert self.first_token_s.value is not None and self.prompt_tokens.value is not None
        return self.first_token_s.value * max(1.0, prompt_tokens / self.prompt_tokens.value)


class LoadMetrics:
    """Per-tenant counts of refused and expired requests, and queue depth, for /metrics."""

    def __init__(self, registry: CollectorRegistry):
        self.shed = PromCounter(
            "loramux_requests_shed",
            "Requests refused at admission by load: reason queue_full (429) or "
            "deadline_unattainable (503).",
            ["tenant", "reason"],
            registry=registry,
        )
        self.expired = PromCounter(
            "loramux_requests_expired",
            "Requests ended by their deadline, by where they were: queued (no token yet) "
            "or generating.",
            ["tenant", "state"],
            registry=registry,
        )
        self.queued = Gauge(
            "loramux_platform_queued_requests",
            "Choices this process admitted that have no first token yet, per tenant.",
            ["tenant"],
            registry=registry,
        )


class Ticket:
    """One admitted request's place in the queue: each choice leaves at its first token."""

    def __init__(self, board: LoadControl, tenant: str, priority: int, choices: int):
        self._board = board
        self.tenant = tenant
        self.priority = priority
        self._waiting = set(range(choices))

    def started(self, index: int) -> None:
        if index in self._waiting:
            self._waiting.discard(index)
            self._board._leave(self, 1)

    def close(self) -> None:
        """The run ended: whatever still waited leaves the queue."""
        if self._waiting:
            self._board._leave(self, len(self._waiting))
            self._waiting.clear()


class LoadControl:
    """The process's queue, its limits and the engine's measured rates (one per app)."""

    def __init__(self, limits: QueueLimits, rates: ServiceRates, metrics: LoadMetrics | None):
        self.limits = limits
        self.rates = rates
        self.metrics = metrics
        self._by_tenant: Counter[str] = Counter()
        self._by_priority: Counter[int] = Counter()
        # Admission runs in worker threads, the runs' bookkeeping on the event loop.
        self._lock = threading.Lock()

    # --- the queue ----------------------------------------------------------------
    def queued(self, tenant: str | None = None) -> int:
        if tenant is None:
            return sum(self._by_tenant.values())
        return self._by_tenant[tenant]

    def ahead_of(self, priority: int) -> int:
        """Queued choices served before a new one of ``priority`` (its class or higher)."""
        return sum(count for p, count in self._by_priority.items() if p >= priority)

    def admit(
        self,
        tenant: str,
        priority: int,
        choices: int,
        prompt_tokens: int,
        deadline: Deadline,
        tenant_limit: int | None,
    ) -> Ticket:
        """Queue the request's choices, or raise 429 ``queue_full`` / 503
        ``deadline_unattainable`` (counted in the metrics)."""
        with self._lock:
            try:
                self._check_limits(tenant, choices, tenant_limit)
                self._check_deadline(priority, prompt_tokens, deadline)
            except (QuotaExceeded, Unavailable) as exc:
                if self.metrics is not None:
                    self.metrics.shed.labels(tenant, exc.code).inc()
                raise
            ticket = Ticket(self, tenant, priority, choices)
            self._by_tenant[tenant] += choices
            self._by_priority[priority] += choices
            self._gauge(tenant)
        return ticket

    def _leave(self, ticket: Ticket, count: int) -> None:
        with self._lock:
            self._by_tenant[ticket.tenant] -= count
            self._by_priority[ticket.priority] -= count
            self._gauge(ticket.tenant)

    def _gauge(self, tenant: str) -> None:
        if self.metrics is not None:
            self.metrics.queued.labels(tenant).set(self._by_tenant[tenant])

    def expired(self, tenant: str, state: str) -> None:
        if self.metrics is not None:
            self.metrics.expired.labels(tenant, state).inc()

    # --- the checks ---------------------------------------------------------------
    def _check_limits(self, tenant: str, choices: int, tenant_limit: int | None) -> None:
        per_tenant = self.limits.per_tenant if tenant_limit is None else tenant_limit
        checks = (
            (self.queued(tenant), per_tenant, "your queue"),
            (self.queued(), self.limits.total, "the server's queue"),
        )
        for queued, limit, whose in checks:
            if choices > limit:  # it could never pass: not a matter of waiting
                raise Invalid(
                    f"{choices} sequences (each choice of `n`, for each prompt) are more than "
                    f"{whose} limit of {limit} queued requests; send fewer choices or prompts "
                    "per request.",
                    code="invalid_sampling_parameters",
                )
            if queued + choices > limit:
                retry = self._retry_after(queued + choices - limit)
                raise QuotaExceeded(
                    f"Too many requests waiting: {whose} holds {queued} of at most {limit} "
                    f"queued requests (each choice of `n` counts) and this one adds "
                    f"{choices}. Retry after {retry} s, or send fewer at once.",
                    code="queue_full",
                    retry_after_s=retry,
                )

    def _retry_after(self, excess: int) -> int:
        """Whole seconds until ``excess`` queued choices have started (at least 1)."""
        if not self.rates.measured:
            return 1
        return max(1, math.ceil(self.rates.seconds_to_start(excess)))

    def _check_deadline(self, priority: int, prompt_tokens: int, deadline: Deadline) -> None:
        if not self.rates.measured:
            return
        ahead = self.ahead_of(priority)
        wait = self.rates.seconds_to_start(ahead)
        prefill = self.rates.prefill_seconds(prompt_tokens)
        left = deadline.remaining()
        if wait + prefill <= left:
            return
        raise Unavailable(
            f"This request cannot start before its deadline of {deadline.describe()}: its "
            f"predicted time to first token is {wait + prefill:.2f} s ({ahead} queued ahead "
            f"of it, {wait:.2f} s to get one of {self.rates.slots} slots at "
            f"{self.rates.slot_s.value:.2f} s each; {prefill:.2f} s to prefill "
            f"{prompt_tokens} prompt tokens). Retry later or with a longer `timeout`.",
            code="deadline_unattainable",
            retry_after_s=max(1, math.ceil(wait)),
        )

    # --- measuring ------------------------------------------------------------------
    def observe(self, out: RequestOutput, *, first: bool) -> None:
        if first:
            self.rates.observe_first(out)
        if out.finished:
            self.rates.observe_finished(out)
