"""Money arithmetic on integer micro-dollars, and which price is in force when.

Prices are micro-dollars per million tokens (``*_micro_usd_per_mtok``): $0.50 per million
input tokens is ``500_000``. A request's cost is therefore

    cost_micro_usd = floor(( (prompt - cached) * input
                            + cached * cached_input
                            + completion * output ) / 1_000_000)

computed with Python integers, so it is exact for any size. Rounding: the sum is taken in
millionths of a micro-dollar first and floored once (never per token class); the fraction of
a micro-dollar below that, at most 0.999999 µ$ per request, is not charged.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from loramux.platform.db.models import Price
from loramux.platform.db.types import utc_now

TOKENS_PER_MTOK = 1_000_000


def cost_micro_usd(
    price: Price, prompt_tokens: int, cached_tokens: int, completion_tokens: int
) -> int:
    """What a request costs under ``price``, in whole micro-dollars (rounded down; see module).

    ``cached_tokens`` is the part of ``prompt_tokens`` served from the prefix cache and is
    billed at the cached-input rate instead of the input rate.
    """
    if min(prompt_tokens, cached_tokens, completion_tokens) < 0:
        raise ValueError("token counts must be non-negative")
    if cached_tokens > prompt_tokens:
        raise ValueError(f"cached_tokens {cached_tokens} > prompt_tokens {prompt_tokens}")
    millionths = (
        (prompt_tokens - cached_tokens) * price.input_micro_usd_per_mtok
        + cached_tokens * price.cached_input_micro_usd_per_mtok
        + completion_tokens * price.output_micro_usd_per_mtok
    )
    return millionths // TOKENS_PER_MTOK


def current_price(session: Session, tenant_id: str, at: datetime | None = None) -> Price | None:
    """The tenant's price in force at ``at`` (default: now): latest ``effective_from <= at``.

    ``None`` when the tenant has no price yet at that moment.
    """
    moment = utc_now() if at is None else at
    statement = (
        select(Price)
        .where(Price.tenant_id == tenant_id, Price.effective_from <= moment)
        .order_by(Price.effective_from.desc())
        .limit(1)
    )
    return session.scalars(statement).first()
