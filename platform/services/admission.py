"""Admission: a tenant's request checked, bounded and turned into a :class:`Job`.

``max_tokens``: a given value must fit the context with the prompt (400
``context_length_exceeded`` otherwise, as OpenAI answers). Without one (chat; the
completions API defaults to 16) a request gets what the context leaves, but never more
than the tenant's limits can ever grant: at most what fits its tokens/minute bucket
(``sum over sequences of (prompt + max_tokens) <= tokens_per_minute``) and, with a monthly
budget, what the budget's room affords at the tenant's prices; generation then stops there
with finish reason ``length`` instead of the request being refused for good.

A *sequence* is one engine request: ``n`` per prompt (``best_of`` when it asks for more
candidates), for each prompt of a batch (``prompts.py`` bounds them). Before anything runs,
the job takes what it may use: its maximum cost (every sequence's prompt and
``max_tokens`` at the tenant's prices) is held against the monthly budget
(:class:`~loramux.platform.limits.TenantBudget`; 402 when ``spent + held by running
requests + this maximum`` passes the budget), and the same tokens are reserved from the
rate limits (429); each sequence takes its place in the queue (``load_shedding.py``). Both are settled when the run ends
(:class:`~loramux.platform.services.limit_holds.Holds`). With Redis (the limits' store)
unreachable, ``limits_fail_open`` decides: the request runs without rate limits and
budget holds (its budget checked against the database alone), or is refused with 503
``limits_unavailable``.

Everything here blocks (tokenizing, the budget query, the rate limiter): the service runs
it in a worker thread, off the event loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy.orm import Session

from loramux.engine import SamplingParams
from loramux.platform.context import PlatformContext
from loramux.platform.db.models import END_USER_LENGTH, Price, Tenant
from loramux.platform.db.pricing import cost_micro_usd, current_price
from loramux.platform.db.types import utc_now
from loramux.platform.errors import Invalid, PlatformError, QuotaExceeded
from loramux.platform.limits import BudgetHold, TenantBudget, TenantLimits
from loramux.platform.services.deadlines import request_deadline
from loramux.platform.services.inference_job import Caller, Job, Target
from loramux.platform.services.inference_request import InferenceRequest, Sampling
from loramux.platform.services.limit_holds import Holds, limits_reachable
from loramux.platform.services.load_shedding import LoadControl
from loramux.platform.services.prompts import PromptReader, check_batch, sequences_per_prompt
from loramux.platform.services.rollups import month_spend
from loramux.platform.services.tenants import micro_usd_to_usd


@dataclass(frozen=True)
class _Shape:
    """What a job may use at most: its sequences' prompt lengths and ``max_tokens`` each."""

    prompt_tokens: tuple[int, ...]  # one per sequence

    @property
    def sequences(self) -> int:
        return len(self.prompt_tokens)

    @property
    def all_prompt_tokens(self) -> int:
        return sum(self.prompt_tokens)

    def tokens(self, max_tokens: int) -> int:
        """Prompt and completion tokens of every sequence: what the rate limits reserve."""
        return self.all_prompt_tokens + self.sequences * max_tokens

    def cost(self, price: Price, max_tokens: int) -> int:
        """The most the job can cost at ``price`` (micro-dollars)."""
        return cost_micro_usd(price, self.all_prompt_tokens, 0, self.sequences * max_tokens)


class Admission:
    """Checks a request against the model (prompts, context) and the tenant's limits."""

    def __init__(self, context: PlatformContext, tokenizer, max_model_len: int, vocab_size: int):
        self._context = context
        self.prompts = PromptReader(tokenizer, max_model_len, vocab_size)

    def prepare(
        self,
        session: Session,
        tenant: Tenant,
        target: Target,
        request: InferenceRequest,
        *,
        load: LoadControl | None = None,
    ) -> Job:
        """The job, holding its place in ``load``'s queue (given back if anything after
        refuses it); the queue and deadline checks come before the budget and rate limits,
        so a request refused for load uses none of them. A chat request's messages are
        rendered with the chat template into its one prompt."""
        check_end_user(request.end_user)
        per_prompt = sequences_per_prompt(request.n, request.best_of)
        prompts = request.prompts
        if request.messages is not None:
            prompts = [self.prompts.render_chat(request.messages)]
        check_batch(len(prompts), per_prompt)
        sampling = request.sampling
        self.prompts.check_logit_bias(sampling.logit_bias)
        deadline = request_deadline(
            self._context.settings.request_timeout_s, tenant.request_timeout_s, request.timeout
        )
        read = self.prompts.read(prompts, generates=sampling.max_tokens != 0)
        shape = _Shape(tuple(p.tokens for p in read for _ in range(per_prompt)))
        caller = Caller.of(tenant)
        ticket = None
        if load is not None:
            ticket = load.admit(
                caller.tenant_id,
                caller.priority,
                shape.sequences,
                max(shape.prompt_tokens),
                deadline,
                caller.max_queued_requests,
            )
        try:
            params, holds = self._take(
                session, tenant, caller, shape, per_prompt, sampling, request.default_max_tokens
            )
        except BaseException:
            if ticket is not None:
                ticket.close()
            raise
        return Job(
            request_id=request.request_id,
            created=int(time.time()),
            caller=caller,
            target=target,
            prompts=read,
            params=params,
            holds=holds,
            deadline=deadline,
            ticket=ticket,
            end_user=request.end_user,
            n=request.n,
        )

    def _take(
        self,
        session: Session,
        tenant: Tenant,
        caller: Caller,
        shape: _Shape,
        per_prompt: int,
        sampling: Sampling,
        default_max_tokens: int | None,
    ) -> tuple[tuple[SamplingParams, ...], Holds]:
        """The sequences' parameters, and what they take of the budget and rate limits."""
        check_budget(session, tenant)
        price = None
        if caller.monthly_budget_micro_usd is not None:
            price = current_price(session, tenant.id, utc_now())
        longest = max(shape.prompt_tokens)
        given = sampling.max_tokens
        if given is None:
            room = self.prompts.default_max_tokens(longest)
            max_tokens = min(default_max_tokens or room, room)
            max_tokens = self._within_limits(session, caller, price, shape, max_tokens)
            sampling = sampling.with_max_tokens(max_tokens)
        else:
            self.prompts.check_fits_context(longest, given)
        # The request's session has done its reads: end its transaction before anything is
        # held, so no connection stays checked out across the generation and no commit is
        # left for the request's end (a database restart meanwhile would fail a request
        # whose tokens were generated, and its usage would be billed anyway).
        session.commit()
        params = build_params(sampling, shape.sequences, per_prompt)
        budget_hold = self._hold_budget(caller, price, shape, params[0].max_tokens)
        reserved = shape.tokens(params[0].max_tokens)
        holds = Holds(self._limits(), self._budget(), caller, reserved, budget_hold)
        try:
            if not self._reserve(caller, reserved):
                holds.reserved_tokens = 0  # passed unchecked: nothing to refund
        except PlatformError:
            holds.reserved_tokens = 0  # nothing was debited
            holds.settle(0)
            raise
        return params, holds

    def _budget(self) -> TenantBudget:
        fail_open = self._context.settings.limits_fail_open
        return TenantBudget(self._context.rate_limiter, fail_open=fail_open)

    def _limits(self) -> TenantLimits:
        fail_open = self._context.settings.limits_fail_open
        return TenantLimits(self._context.rate_limiter, fail_open=fail_open)

    def _reserve(self, caller: Caller, tokens: int) -> bool:
        """Debit the rate limits (429 when they refuse); False when they were not checked
        (their store is unreachable and the platform fails open)."""
        with limits_reachable():
            decision = self._limits().check_request(
                caller.tenant_id,
                requests_per_minute=caller.requests_per_minute,
                tokens_per_minute=caller.tokens_per_minute,
                tokens_needed=tokens,
            )
        if not decision.allowed:
            header = decision.retry_after_header
            raise QuotaExceeded(
                f"Rate limit: {decision.reason}",
                code="rate_limit_exceeded",
                retry_after_s=int(header) if header else None,
            )
        return decision.enforced

    def _within_limits(
        self,
        session: Session,
        caller: Caller,
        price: Price | None,
        shape: _Shape,
        max_tokens: int,
    ) -> int:
        """A default ``max_tokens`` lowered to what the tenant's limits can ever grant: the
        tokens/minute bucket's capacity and the budget's room (when either allows at least
        one token; otherwise the request is refused as it would be anyway)."""
        if caller.tokens_per_minute is not None:
            fits = (caller.tokens_per_minute - shape.all_prompt_tokens) // shape.sequences
            if fits >= 1:
                max_tokens = min(max_tokens, fits)
        budget = caller.monthly_budget_micro_usd
        if budget is not None and price is not None:
            spent = month_spend(session, caller.tenant_id, now=utc_now())
            with limits_reachable():
                room = budget - spent - self._budget().held(caller.tenant_id)
            affordable = _affordable_tokens(price, shape, room, max_tokens)
            if affordable >= 1:
                max_tokens = affordable
        return max_tokens

    def _hold_budget(
        self,
        caller: Caller,
        price: Price | None,
        shape: _Shape,
        max_tokens: int,
    ) -> BudgetHold | None:
        """Hold the job's maximum cost against the monthly budget; 402 if it has no room."""
        budget = caller.monthly_budget_micro_usd
        if budget is None:
            return None
        most = 0 if price is None else shape.cost(price, max_tokens)

        def spent() -> int:  # read after the hold, in a transaction of its own (not a snapshot)
            with self._context.sessions() as fresh:
                return month_spend(fresh, caller.tenant_id, now=utc_now())

        with limits_reachable():
            decision = self._budget().try_hold(caller.tenant_id, most, budget=budget, spent=spent)
        if not decision.allowed:
            raise QuotaExceeded(
                f"Monthly budget: this request may cost up to ${micro_usd_to_usd(most):.6f} "
                f"(its prompt and max_tokens at your prices); this month's usage costs "
                f"${micro_usd_to_usd(decision.spent):.6f} and running requests hold "
                f"${micro_usd_to_usd(decision.held):.6f} of a ${micro_usd_to_usd(budget):.6f} "
                "budget. Lower max_tokens, wait for running requests, or ask your operator "
                "to raise the budget.",
                code="budget_exceeded",
            )
        return decision.hold


def build_params(sampling: Sampling, sequences: int, per_prompt: int) -> tuple[SamplingParams, ...]:
    """One ``SamplingParams`` per sequence; 400 if bad. Seeded sequences of a prompt get
    seed, seed+1, ...: each prompt of a batch draws what it would alone."""
    given = sampling.given()
    seed = given.pop("seed", None)
    try:
        return tuple(
            SamplingParams(**given, seed=None if seed is None else seed + i % per_prompt)
            for i in range(sequences)
        )
    except ValueError as exc:
        raise Invalid(str(exc), code="invalid_sampling_parameters") from exc


def check_end_user(end_user: str | None) -> None:
    """400 for a ``user`` longer than the usage record keeps (OpenAI sets no bound; ids,
    hashes and e-mail addresses fit)."""
    if end_user is not None and len(end_user) > END_USER_LENGTH:
        raise Invalid(
            f"user is {len(end_user)} characters long; at most {END_USER_LENGTH} are allowed "
            "(send an id or a hash of it)",
            code="invalid_request",
        )


def check_budget(session: Session, tenant: Tenant) -> None:
    """402 once the tenant's cost this calendar month (UTC) has reached its budget.

    The cost comes from the daily roll-ups plus the raw records of the days not rolled up
    yet (``month_spend``), so the check stays cheap late in a busy month.
    """
    budget = tenant.monthly_budget_micro_usd
    if budget is None:
        return
    spent = month_spend(session, tenant.id, now=utc_now())
    if spent >= budget:
        raise QuotaExceeded(
            f"Monthly budget exhausted: this month's usage costs ${micro_usd_to_usd(spent):.6f} of a "
            f"${micro_usd_to_usd(budget):.6f} budget. Ask your operator to raise it.",
            code="budget_exceeded",
        )


def _affordable_tokens(price: Price, shape: _Shape, room: int, most: int) -> int:
    """The largest ``max_tokens <= most`` whose maximum cost (every sequence's prompt and
    ``max_tokens`` at ``price``) fits in ``room`` micro-dollars; 0 when none does."""

    def cost(max_tokens: int) -> int:
        return shape.cost(price, max_tokens)

    if cost(most) <= room:
        return most
    if cost(1) > room:
        return 0
    low, high = 1, most  # cost(low) fits, cost(high) does not: the answer is in [low, high)
    while high - low > 1:
        middle = (low + high) // 2
        if cost(middle) <= room:
            low = middle
        else:
            high = middle
    return low
