"""Metering: one priced usage record per request that delivered tokens (or was abandoned
after the engine prefilled part of its prompt).

The serving path builds a ``UsageEvent`` when a request ends (finished, stopped, or dropped
by the client) and hands it to ``Meter.record``::

    meter = Meter(context.sessions)
    record = meter.record(UsageEvent(request_id=..., tenant_id=..., model=..., ...))
    usage = Usage.of(record) if record else None

While a request streams, ``loramux.platform.services.usage_journal`` hands its running
tallies to ``Meter.checkpoint`` every ``usage_journal_interval_s`` (1 s by default): each
becomes a *provisional* row (``UsageRecord.final`` false) with the tokens delivered so far,
which ``record`` later makes final. **A crash (SIGKILL, power loss) therefore loses at most
the tokens a request delivered since its last checkpoint: one interval's worth plus the
time a checkpoint write takes**; what was checkpointed stays, billed like any record.

Rules:

* **Idempotent on the request id.** The first final write wins; recording the same
  ``request_id`` again (a retry, a duplicate delivery, two workers racing) writes nothing
  and returns ``None``. A checkpoint never changes a final row. ``Meter.stored(request_id)``
  reads back what was recorded.
* **Only requests that delivered something, or were abandoned after the engine worked
  on them, are recorded**: an event with ``completion_tokens == 0`` (rejected, failed
  before its first token) is skipped and returns ``None``; its prompt is not billed. Two
  exceptions. A request that scored its prompt (``echo`` with ``max_tokens: 0``:
  ``delivered_prompt``): the client got the prompt's log-probabilities, so its prompt is
  billed though nothing was generated. And a request *abandoned* before anything reached
  its client (the client left, or its deadline passed: ``abandoned_prefill``): its
  ``prompt_tokens`` are those the engine prefilled for it (computed or prefix-cache hits,
  ``cached_prompt_tokens`` of them), billed when there are any, so that abandoning work is
  never free. A request the engine failed is never billed for what it did not deliver.
* **A dropped stream bills only what was delivered**: the caller passes, as
  ``completion_tokens``, the tokens actually sent to the client, not those generated.
* **Cost** is computed here, at each write, from the tenant's price in force at the
  event's moment (``created_at``, default now) with
  ``loramux.platform.db.pricing.cost_micro_usd``; a tenant without a price at that moment
  is charged 0. A row's cost always follows its tokens; a final row's never changes.
* ``Usage.of`` gives the client exactly the numbers of the record, so the sum of
  what the API returned over a period equals the billing export's totals for it.
* **A write the database refuses because it is down** raises an error for which
  ``database_unavailable`` is true; the serving path then keeps the event and writes it
  once the database is back (``UsageJournal.write_later``), still exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import exc as sa_exc
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from loramux.platform.db.models import END_USER_LENGTH, UsageRecord
from loramux.platform.db.pricing import cost_micro_usd, current_price
from loramux.platform.db.types import utc_now
from loramux.platform.db.usage import checkpoint_usage, record_usage

REQUEST_ID_MAX_LENGTH = 128  # UsageRecord.request_id is String(128)


def database_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database cannot be reached now (down, restarting, the
    connection dropped, the pool exhausted), as opposed to a bug in a statement: the same
    write may pass once it is back."""
    if isinstance(exc, sa_exc.DBAPIError):
        return exc.connection_invalidated or isinstance(
            exc, (sa_exc.OperationalError, sa_exc.InterfaceError)
        )
    return isinstance(exc, sa_exc.TimeoutError)  # no pooled connection came free in time


# The event's fields its usage record keeps as they are (the record adds the cost and the
# moment; delivered_prompt and abandoned_prefill only decide what is billed).
RECORDED_FIELDS = (
    "request_id",
    "tenant_id",
    "adapter_id",
    "adapter_version_id",
    "model",
    "prompt_tokens",
    "cached_prompt_tokens",
    "completion_tokens",
    "latency_ms",
    "finish_reason",
    "end_user",
)


@dataclass(frozen=True, kw_only=True)
class UsageEvent:
    """What one request used, as the serving path saw it when the request ended.

    ``cached_prompt_tokens`` is the part of ``prompt_tokens`` served from the prefix cache.
    ``adapter_id`` / ``adapter_version_id`` are ``None`` for the base model.
    ``completion_tokens`` counts tokens delivered to the client (see the module docstring).
    ``created_at`` is when the request happened; leave it ``None`` (now) except in tests and
    backfills. It must be timezone-aware. ``end_user`` is the request's ``user`` (the
    tenant's id for its end user), stored and exported with the record.
    ``delivered_prompt``: the client received the prompt's log-probabilities (echo), so the
    request is billed for its prompt even with no completion token.
    ``abandoned_prefill``: the request was abandoned before it delivered anything (client
    gone, deadline passed); ``prompt_tokens`` are the prompt tokens the engine prefilled
    for it, billed even with no completion token (there can be none).
    """

    request_id: str
    tenant_id: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0
    adapter_id: str | None = None
    adapter_version_id: str | None = None
    latency_ms: int = 0
    finish_reason: str | None = None
    created_at: datetime | None = None
    end_user: str | None = None
    delivered_prompt: bool = False
    abandoned_prefill: bool = False

    def __post_init__(self) -> None:
        if not self.request_id or len(self.request_id) > REQUEST_ID_MAX_LENGTH:
            raise ValueError(f"request_id must be 1-{REQUEST_ID_MAX_LENGTH} characters")
        if self.end_user is not None and len(self.end_user) > END_USER_LENGTH:
            raise ValueError(f"end_user must be at most {END_USER_LENGTH} characters")
        counts = {
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "latency_ms": self.latency_ms,
        }
        for name, value in counts.items():
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.cached_prompt_tokens > self.prompt_tokens:
            raise ValueError(
                f"cached_prompt_tokens {self.cached_prompt_tokens} > "
                f"prompt_tokens {self.prompt_tokens}"
            )
        if self.created_at is not None and self.created_at.utcoffset() is None:
            raise ValueError("created_at must be timezone-aware")
        if self.abandoned_prefill and self.completion_tokens:
            raise ValueError("an abandoned prefill delivered no completion token")

    @property
    def billable(self) -> bool:
        """Whether this request is recorded at all: it delivered at least one token, or its
        prompt's log-probabilities, or it was abandoned after the engine prefilled some of
        its prompt."""
        prefilled = self.abandoned_prefill and self.prompt_tokens > 0
        return self.completion_tokens > 0 or self.delivered_prompt or prefilled


def price_event(session: Session, event: UsageEvent, at: datetime) -> int:
    """The event's cost in micro-dollars under the tenant's price in force at ``at``."""
    price = current_price(session, event.tenant_id, at)
    if price is None:
        return 0
    return cost_micro_usd(
        price, event.prompt_tokens, event.cached_prompt_tokens, event.completion_tokens
    )


def _stored(session: Session, request_id: str) -> UsageRecord | None:
    return session.scalars(
        select(UsageRecord).where(UsageRecord.request_id == request_id)
    ).one_or_none()


def _priced_record(session: Session, event: UsageEvent, moment: datetime) -> UsageRecord:
    return UsageRecord(
        **{name: getattr(event, name) for name in RECORDED_FIELDS},
        cost_micro_usd=price_event(session, event, moment),
        created_at=moment,
    )


class Meter:
    """Writes usage records, each in its own short transaction on ``sessions``.

    Safe to share between threads and requests: it holds only the session factory.
    """

    def __init__(self, sessions: sessionmaker[Session]):
        self._sessions = sessions

    def record(self, event: UsageEvent) -> UsageRecord | None:
        """Price and store ``event``; the stored record, or ``None`` if nothing was written.

        ``None`` means the event is not billable (see ``UsageEvent.billable``) or its
        request id was already recorded (then ``stored`` returns the first record).
        """
        if not event.billable:
            return None
        with self._sessions.begin() as session:
            record = _priced_record(session, event, event.created_at or utc_now())
            # Every column is set here (defaults included), so the written record is the row.
            return record if record_usage(session, record) else None

    def checkpoint(self, events: Sequence[UsageEvent]) -> int:
        """Store running requests' usage so far as provisional rows, in one short
        transaction; how many rows were written.

        Events that are not billable are skipped, and so are requests whose final record
        exists (the request ended while this checkpoint was on its way). Each event's
        request id must appear once.
        """
        billable = [event for event in events if event.billable]
        if not billable:
            return 0
        with self._sessions.begin() as session:
            moment = utc_now()
            records = [
                _priced_record(session, event, event.created_at or moment) for event in billable
            ]
            return checkpoint_usage(session, records)

    def stored(self, request_id: str) -> UsageRecord | None:
        """The record written for ``request_id``, if any."""
        with self._sessions() as session:
            return _stored(session, request_id)


@dataclass(frozen=True)
class Usage:
    """What a request was billed for: its usage record's numbers, so a client summing what
    it was told gets the billing totals. All zero for a request that was not recorded
    (hence not billed)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    cost_micro_usd: int = 0

    @classmethod
    def of(cls, record: UsageRecord) -> Usage:
        return cls(
            prompt_tokens=record.prompt_tokens,
            completion_tokens=record.completion_tokens,
            cached_prompt_tokens=record.cached_prompt_tokens,
            cost_micro_usd=record.cost_micro_usd,
        )
