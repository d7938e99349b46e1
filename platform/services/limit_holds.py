"""What a job takes from its tenant's limits while it runs, and giving it back.

A job reserves tokens from the tenant's tokens/minute bucket and holds its maximum cost
against the monthly budget (:mod:`loramux.platform.limits`); :class:`Holds` gives back
what was not used, once, when the run ends. :func:`limits_reachable` turns an unreachable
limits store (Redis) into a 503 when the platform fails closed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from loramux.platform.errors import Unavailable
from loramux.platform.limits import BudgetHold, LimitsUnavailable, TenantBudget, TenantLimits

if TYPE_CHECKING:
    from loramux.platform.services.inference_job import Caller

logger = logging.getLogger(__name__)


class Holds:
    """What a job takes from the tenant's limits until it ends: tokens reserved from the
    tokens/minute bucket and its maximum cost held against the monthly budget.

    ``settle`` gives back what was not used, once: a job that never ran (its client left
    before the stream started) is settled by whoever notices, and a second call is a no-op.
    ``settle_later`` claims the settling for whoever writes the usage later (the database
    was down): calls of ``settle`` are then no-ops. Settling never raises for an
    unreachable store: what could not be given back is logged (a refund is lost, the
    tokens come back as the bucket refills; a release is sent again by the limiter).
    """

    def __init__(
        self,
        limits: TenantLimits,
        budget: TenantBudget,
        caller: Caller,
        reserved_tokens: int,
        budget_hold: BudgetHold | None,
    ):
        self._limits, self._budget, self._caller = limits, budget, caller
        self.reserved_tokens = reserved_tokens
        self.budget_hold = budget_hold
        self._settled = False
        self._lock = threading.Lock()

    @property
    def settled(self) -> bool:
        return self._settled

    def settle(self, used_tokens: int) -> None:
        """Refund the reserved tokens beyond ``used_tokens`` and release the budget hold
        (call it after the usage is written: the budget then counts it as spent)."""
        if self._claim():
            self._give_back(used_tokens)

    def settle_later(self, used_tokens: int) -> Callable[[], None]:
        """Claim the settling now; the returned callable settles (call it once the usage
        is written)."""
        if not self._claim():
            return lambda: None
        return lambda: self._give_back(used_tokens)

    def _claim(self) -> bool:
        with self._lock:
            if self._settled:
                return False
            self._settled = True
            return True

    def _give_back(self, used_tokens: int) -> None:
        try:
            if self.budget_hold is not None:
                self._budget.release(self.budget_hold)
        except LimitsUnavailable as exc:
            logger.warning(
                "budget hold of tenant %s not released now: %s", self._caller.tenant_id, exc
            )
        try:
            self._limits.refund_tokens(
                self._caller.tenant_id,
                tokens_per_minute=self._caller.tokens_per_minute,
                tokens=max(0, self.reserved_tokens - used_tokens),
            )
        except LimitsUnavailable as exc:
            logger.warning(
                "unused tokens of tenant %s not refunded: %s", self._caller.tenant_id, exc
            )


LIMITS_UNAVAILABLE_RETRY_AFTER_S = 5


@contextlib.contextmanager
def limits_reachable() -> Iterator[None]:
    """Fail-closed: an unreachable limits store (Redis) refuses the request with 503."""
    try:
        yield
    except LimitsUnavailable as exc:
        logger.warning("limits store unreachable, request refused (fail-closed): %s", exc)
        raise Unavailable(
            "This tenant's rate limits and budget cannot be checked right now (their store "
            "is unreachable), so its requests are refused until it is back; try again in a "
            "few seconds.",
            code="limits_unavailable",
            retry_after_s=LIMITS_UNAVAILABLE_RETRY_AFTER_S,
        ) from exc
