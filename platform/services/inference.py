"""Serving completions and chat completions: from a tenant's request to metered engine output.

One HTTP request becomes a :class:`Job`: the target (base model or one of the tenant's
adapter versions, loaded into the engine), the prompt, and one ``SamplingParams`` per
choice (``n`` independent engine requests).

``max_tokens``: a given value must fit the context with the prompt (400
``context_length_exceeded`` otherwise, as OpenAI answers). Without one (chat; the
completions API defaults to 16) a request gets what the context leaves, but never more
than the tenant's limits can ever grant: at most what fits its tokens/minute bucket
(``n * (prompt + max_tokens) <= tokens_per_minute``) and, with a monthly budget, what the
budget's room affords at the tenant's prices; generation then stops there with finish
reason ``length`` instead of the request being refused for good.

Before anything runs, the job takes what it may use: its maximum cost (``n * (prompt +
max_tokens)`` tokens at the tenant's prices) is held against the monthly budget
(:class:`~loramux.platform.limits.TenantBudget`; 402 when ``spent + held by running
requests + this maximum`` passes the budget), and ``n * (prompt tokens + max_tokens)``
tokens are reserved from the rate limits (429). Both are settled when the run ends: the
unused tokens are refunded and the budget hold released, after the usage is written.
With Redis (the limits' store) unreachable, ``limits_fail_open`` decides: the request
runs without rate limits and budget holds (its budget checked against the database
alone), or is refused with 503 ``limits_unavailable``; settling then fails quietly (the
hold's release is sent again once Redis answers). A final record the database cannot take
(down or restarting) does not fail the request: the usage journal writes it once the
database is back, and the holds are settled then; the response carries no ``usage``.

:meth:`InferenceService.run` streams ``(choice index, RequestOutput delta)`` pairs of all the
choices as they come. The caller marks each delta *delivered* once the client has it
(:meth:`Tally.deliver`; a non-streamed response delivers everything at once, and only if
the run reached its end, so the response is sent); when the run ends for whatever reason
(finished, failed, client gone, stopped by a shutdown) exactly one usage record is written
for the HTTP request, whose id is the response id, with the prompt tokens of every choice
and only the delivered completion tokens, and none if nothing was delivered. While it
runs, the usage journal checkpoints what it delivered (a crash loses at most one
checkpoint interval of tokens). The ``usage`` object the client gets carries the record's
own numbers. A shutdown past its grace period stops running jobs
(:class:`~loramux.platform.services.running.RunningRequests`): their choices end with
finish reason ``abort`` and the client gets what was generated.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from loramux.engine import SamplingParams
from loramux.engine.outputs import RequestOutput
from loramux.engine.sampler import TokenLogprobs
from loramux.engine.sequence import FinishReason
from loramux.platform.api.errors import APIError
from loramux.platform.context import PlatformContext
from loramux.platform.db.models import Price, Tenant
from loramux.platform.db.pricing import cost_micro_usd, current_price
from loramux.platform.db.types import utc_now
from loramux.platform.limits import BudgetHold, LimitsUnavailable, TenantBudget, TenantLimits
from loramux.platform.services.adapter_runtime import AdapterNotServable, AdapterRuntime
from loramux.platform.services.adapters import ready_version
from loramux.platform.services.metering import (
    Meter,
    UsageEvent,
    database_unavailable,
    usage_for_response,
)
from loramux.platform.services.rollups import month_spend
from loramux.platform.services.running import RunningRequests
from loramux.platform.services.tenants import micro_usd_to_usd
from loramux.platform.services.usage_journal import UsageJournal

logger = logging.getLogger(__name__)

_DONE = object()  # a pump's end-of-choice marker in the merge queue
_STOP = object()  # the run was stopped (shutdown): end it now
_NO_USAGE = {  # a request that delivered no token is not recorded, hence not billed
    "prompt_tokens": 0,
    "completion_tokens": 0,
    "total_tokens": 0,
    "prompt_tokens_details": {"cached_tokens": 0},
    "cost_micro_usd": 0,
}


# --- what a request is about --------------------------------------------------------------


@dataclass(frozen=True)
class Caller:
    """The tenant's values the run needs, copied out of the ORM row (the session closes)."""

    tenant_id: str
    priority: int
    requests_per_minute: int | None
    tokens_per_minute: int | None
    monthly_budget_micro_usd: int | None = None

    @classmethod
    def of(cls, tenant: Tenant) -> Caller:
        return cls(
            tenant.id,
            tenant.priority,
            tenant.requests_per_minute,
            tenant.tokens_per_minute,
            tenant.monthly_budget_micro_usd,
        )


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


@dataclass(frozen=True)
class Target:
    """What serves the request: the base model (no adapter) or one adapter version."""

    model: str  # the name the client used; echoed back and metered
    engine_adapter: str | None = None
    adapter_id: str | None = None
    adapter_version_id: str | None = None


@dataclass(frozen=True)
class Job:
    """One HTTP request, ready to run."""

    request_id: str  # the response id and the usage record's request id
    created: int
    caller: Caller
    target: Target
    prompt: str | list[int]
    prompt_tokens: int  # the prompt's length as the engine will tokenize it
    params: tuple[SamplingParams, ...]  # one per choice
    holds: Holds  # tokens/minute reserved and budget held, settled when the run ends

    @property
    def reserved_tokens(self) -> int:
        """Debited from the tokens/minute bucket."""
        return self.holds.reserved_tokens


@dataclass
class Choice:
    """What one choice delivered so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0


class Tally:
    """Per-choice accounting of what reached the client.

    A streamed tally counts each delta delivered as the client gets it. A non-streamed one
    (``streamed=False``) collects the deltas for the response and counts them delivered
    only once the run has reached its end (``ended``): a response cut short (client gone,
    engine failure) delivers nothing.
    """

    def __init__(self, job: Job, *, streamed: bool = True):
        self.choices = [Choice(prompt_tokens=job.prompt_tokens) for _ in job.params]
        self.streamed = streamed
        self.ended = False  # set by the run once it reached its end (the response follows)
        self.usage: dict[str, Any] | None = None  # set once the run has ended and was metered

    def deliver(self, index: int, out: RequestOutput) -> None:
        """``out``'s delta reached the client (or, non-streamed, is in the response)."""
        choice = self.choices[index]
        choice.text += out.delta_text
        choice.token_ids.extend(out.delta_token_ids)
        choice.logprobs.extend(delta_logprobs(out))
        if out.finished:
            choice.finish_reason = out.finish_reason
        if out.metrics is not None:
            choice.prompt_tokens = out.metrics.prompt_tokens or choice.prompt_tokens
            choice.cached_prompt_tokens = out.metrics.cached_prompt_tokens

    @property
    def prompt_tokens(self) -> int:
        return sum(c.prompt_tokens for c in self.choices)

    @property
    def cached_prompt_tokens(self) -> int:
        return sum(min(c.cached_prompt_tokens, c.prompt_tokens) for c in self.choices)

    @property
    def completion_tokens(self) -> int:
        """Tokens handed over so far (non-streamed: collected for the response)."""
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def delivered_completion_tokens(self) -> int:
        """Tokens the client has (or gets with the response): what is billed."""
        return self.completion_tokens if self.streamed or self.ended else 0


def delta_logprobs(out: RequestOutput) -> list[TokenLogprobs]:
    """The log-probabilities of ``out``'s new tokens (``out.logprobs`` holds them all)."""
    count = len(out.delta_token_ids)
    return list(out.logprobs[-count:]) if count and out.logprobs else []


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def stopped_output(job: Job, index: int) -> RequestOutput:
    """The last output of a choice stopped before its end: nothing new, reason ``abort``."""
    return RequestOutput(
        request_id=f"{job.request_id}-{index}",
        prompt_token_ids=[],
        token_ids=[],
        text="",
        finished=True,
        finish_reason=FinishReason.ABORT,
    )


class _Merge:
    """One run's choices as one queue of ``(index, output)``; ``stop`` ends it early."""

    def __init__(self, choices: int):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.unfinished = set(range(choices))

    def stop(self) -> None:
        self.queue.put_nowait((-1, _STOP))


class EngineRequestFailed(RuntimeError):
    """The engine ended a request it could not serve; ``code`` says which way:

    ``adapter_unavailable``: its adapter could not be loaded or does not fit (may pass);
    ``adapter_failed``: the request failed while it ran, alone (its adapter raised or
    computed NaN/infinity; the engine's other requests went on).
    """

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


# Marks of the engine's own messages (engine/engine.py): where the request failed.
_STEP_FAILURE = "failed in the engine step"
_TOO_LARGE = "cannot be served"


def tenant_facing_error(model: str, engine_error: str | None) -> EngineRequestFailed:
    """What a tenant is told when the engine could not serve its request.

    The engine's own message names internal ids, store endpoints, buckets and object keys:
    it goes to the log for operators; the tenant gets the model's name and what to do.
    """
    logger.warning("request for %r failed in the engine: %s", model, engine_error)
    error = engine_error or ""
    if _STEP_FAILURE in error:
        why = (
            "it computed non-finite values (NaN or infinity)"
            if "non-finite" in error
            else "it raised an error"
        )
        return EngineRequestFailed(
            f"{model!r} failed while generating this request ({why}); the request was "
            "stopped and nothing else was affected. If it happens again, check the "
            "adapter's weights or ask your operator.",
            "adapter_failed",
        )
    if _TOO_LARGE in error:
        return EngineRequestFailed(
            f"adapter {model!r} is too large for this deployment's device memory; "
            "ask your operator to raise the adapter memory budget",
            "adapter_unavailable",
        )
    return EngineRequestFailed(
        f"adapter {model!r} could not be loaded from adapter storage right now; try again shortly",
        "adapter_unavailable",
    )


# --- the service --------------------------------------------------------------------------


class InferenceService:
    """Turns requests into jobs and runs them on the context's engine.

    ``journal`` checkpoints running requests' usage; ``running`` lets a shutdown stop them.
    Both belong to the app (they outlive a request); without them runs are neither
    journaled nor stoppable.
    """

    def __init__(
        self,
        context: PlatformContext,
        *,
        journal: UsageJournal | None = None,
        running: RunningRequests | None = None,
    ):
        if context.engine is None:
            raise APIError(503, "No engine is running in this process.", code="no_engine")
        self._context = context
        self._engine = context.engine
        self._tokenizer = context.engine.tokenizer
        self._max_model_len = context.engine.max_model_len
        self._journal = journal
        self._running = running

    # --- resolving the model ----------------------------------------------------------
    async def resolve(
        self, session: Session, tenant: Tenant, model: str, runtime: AdapterRuntime
    ) -> Target:
        """The base model by its id, else the tenant's adapter of that name; 404 otherwise."""
        if model == self._context.base_model.model_id:
            return Target(model=model)
        return await self.adapter_target(session, tenant, model, runtime)

    async def adapter_target(
        self, session: Session, tenant: Tenant, name: str, runtime: AdapterRuntime
    ) -> Target:
        found = await run_in_threadpool(ready_version, session, tenant.id, name)
        if found is None:
            raise APIError(
                404,
                f"The model {name!r} does not exist or you do not have access to it.",
                code="model_not_found",
            )
        adapter, version = found
        try:
            engine_name = await runtime.ensure_loaded(version)
        except AdapterNotServable as exc:
            raise APIError(503, f"Adapter {name!r} cannot be served: {exc}") from exc
        return Target(name, engine_name, adapter.id, version.id)

    # --- building a job ---------------------------------------------------------------
    def render_chat(self, messages: Sequence[dict[str, Any]]) -> str:
        try:
            return self._tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # a template error is the caller's messages' fault
            raise APIError(400, f"messages cannot be rendered: {exc}") from exc

    def count_prompt(self, prompt: str | list[int]) -> int:
        count = (
            len(prompt) if isinstance(prompt, list) else len(self._tokenizer(prompt)["input_ids"])
        )
        if count == 0:
            raise APIError(400, "prompt is empty", code="invalid_prompt")
        if count >= self._max_model_len:
            raise APIError(
                400,
                f"prompt has {count} tokens; the context limit is {self._max_model_len}, "
                "leaving no room to generate",
                code="context_length_exceeded",
            )
        return count

    def default_max_tokens(self, prompt_tokens: int) -> int:
        """Chat without max_tokens: as much as the context leaves."""
        return max(1, self._max_model_len - prompt_tokens)

    def check_fits_context(self, prompt_tokens: int, max_tokens: Any) -> None:
        """400 when a given ``max_tokens`` can never fit the context with the prompt."""
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return  # SamplingParams names what is wrong with it
        if prompt_tokens + max_tokens > self._max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self._max_model_len} tokens. "
                f"However, you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} "
                f"in the prompt, {max_tokens} in the completion). Please reduce the length "
                "of the prompt or of max_tokens.",
                code="context_length_exceeded",
            )

    async def prepare(
        self,
        session: Session,
        tenant: Tenant,
        target: Target,
        *,
        request_id: str,
        prompt: str | list[int] | None = None,
        messages: Sequence[dict[str, Any]] | None = None,
        n: int,
        sampling: dict[str, Any],
        default_max_tokens: int | None = None,
    ) -> Job:
        """Validate, check budget and limits, and reserve tokens: the job to run.

        The prompt is ``prompt``, or ``messages`` rendered with the chat template. The
        blocking work (tokenizing, the budget query, the rate limiter) runs in one worker
        thread, off the event loop.
        """
        return await run_in_threadpool(
            self._prepare_sync,
            session,
            tenant,
            target,
            request_id=request_id,
            prompt=prompt,
            messages=messages,
            n=n,
            sampling=sampling,
            default_max_tokens=default_max_tokens,
        )

    def _prepare_sync(
        self,
        session: Session,
        tenant: Tenant,
        target: Target,
        *,
        request_id: str,
        prompt: str | list[int] | None,
        messages: Sequence[dict[str, Any]] | None,
        n: int,
        sampling: dict[str, Any],
        default_max_tokens: int | None,
    ) -> Job:
        if messages is not None:
            prompt = self.render_chat(messages)
        if prompt is None:
            raise TypeError("prepare needs a prompt or messages")
        prompt_tokens = self.count_prompt(prompt)
        caller = Caller.of(tenant)
        check_budget(session, tenant)
        price = None
        if caller.monthly_budget_micro_usd is not None:
            price = current_price(session, tenant.id, utc_now())
        given = sampling.get("max_tokens")
        if given is None:
            max_tokens = min(
                default_max_tokens or self.default_max_tokens(prompt_tokens),
                self.default_max_tokens(prompt_tokens),
            )
            max_tokens = self._within_limits(session, caller, price, n, prompt_tokens, max_tokens)
            sampling = {**sampling, "max_tokens": max_tokens}
        else:
            self.check_fits_context(prompt_tokens, given)
        # The request's session has done its reads: end its transaction before anything is
        # held, so no connection stays checked out across the generation and no commit is
        # left for the request's end (a database restart meanwhile would fail a request
        # whose tokens were generated, and its usage would be billed anyway).
        session.commit()
        params = build_params(sampling, n)
        budget_hold = self._hold_budget(caller, price, n, prompt_tokens, params)
        reserved = n * (prompt_tokens + params[0].max_tokens)
        holds = Holds(self._limits(), self._budget(), caller, reserved, budget_hold)
        try:
            if not self._reserve(caller, reserved):
                holds.reserved_tokens = 0  # passed unchecked: nothing to refund
        except APIError:
            holds.reserved_tokens = 0  # nothing was debited
            holds.settle(0)
            raise
        return Job(
            request_id=request_id,
            created=int(time.time()),
            caller=caller,
            target=target,
            prompt=prompt,
            prompt_tokens=prompt_tokens,
            params=params,
            holds=holds,
        )

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
            raise APIError(
                429,
                f"Rate limit: {decision.reason}",
                code="rate_limit_exceeded",
                headers={"Retry-After": header} if header else None,
            )
        return decision.enforced

    def _within_limits(
        self,
        session: Session,
        caller: Caller,
        price: Price | None,
        n: int,
        prompt_tokens: int,
        max_tokens: int,
    ) -> int:
        """A default ``max_tokens`` lowered to what the tenant's limits can ever grant: the
        tokens/minute bucket's capacity and the budget's room (when either allows at least
        one token; otherwise the request is refused as it would be anyway)."""
        if caller.tokens_per_minute is not None:
            fits = caller.tokens_per_minute // n - prompt_tokens
            if fits >= 1:
                max_tokens = min(max_tokens, fits)
        budget = caller.monthly_budget_micro_usd
        if budget is not None and price is not None:
            spent = month_spend(session, caller.tenant_id, now=utc_now())
            with limits_reachable():
                room = budget - spent - self._budget().held(caller.tenant_id)
            affordable = _affordable_tokens(price, n, prompt_tokens, room, max_tokens)
            if affordable >= 1:
                max_tokens = affordable
        return max_tokens

    def _hold_budget(
        self,
        caller: Caller,
        price: Price | None,
        n: int,
        prompt_tokens: int,
        params: tuple[SamplingParams, ...],
    ) -> BudgetHold | None:
        """Hold the job's maximum cost against the monthly budget; 402 if it has no room."""
        budget = caller.monthly_budget_micro_usd
        if budget is None:
            return None
        most = 0
        if price is not None:
            most = cost_micro_usd(price, n * prompt_tokens, 0, n * params[0].max_tokens)

        def spent() -> int:  # read after the hold, in a transaction of its own (not a snapshot)
            with self._context.sessions() as fresh:
                return month_spend(fresh, caller.tenant_id, now=utc_now())

        with limits_reachable():
            decision = self._budget().try_hold(caller.tenant_id, most, budget=budget, spent=spent)
        if not decision.allowed:
            raise APIError(
                402,
                f"Monthly budget: this request may cost up to ${micro_usd_to_usd(most):.6f} "
                f"(its prompt and max_tokens at your prices); this month's usage costs "
                f"${micro_usd_to_usd(decision.spent):.6f} and running requests hold "
                f"${micro_usd_to_usd(decision.held):.6f} of a ${micro_usd_to_usd(budget):.6f} "
                "budget. Lower max_tokens, wait for running requests, or ask your operator "
                "to raise the budget.",
                code="budget_exceeded",
            )
        return decision.hold

    # --- running ----------------------------------------------------------------------
    async def run(self, job: Job, tally: Tally) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every choice's deltas as they come; the usage record is written when this ends.

        Raises ``EngineError`` (a refused request), ``AsyncEngineError`` from the engine, or
        ``EngineRequestFailed`` when the engine ended it unserved (its adapter failed).
        Closing the iterator early aborts the choices still running. A shutdown's
        ``stop_all`` ends it early: each unfinished choice then ends with an empty output
        whose finish reason is ``abort``.
        """
        started = time.monotonic()
        merge = _Merge(len(job.params))
        handle = self._running.add(merge.stop) if self._running is not None else None
        if self._journal is not None:
            self._journal.open(
                job.request_id, lambda: self._usage_event(job, tally, time.monotonic() - started)
            )
        try:
            async for item in self._merged(job, merge):
                yield item
            tally.ended = True
        finally:
            if handle is not None:
                self._running.discard(handle)
            await self._end(job, tally, time.monotonic() - started)

    async def _end(self, job: Job, tally: Tally, elapsed_s: float) -> None:
        """Write the final record. Cancelled once more while it is written (uvicorn's
        shutdown backstop, then the event loop's own end), the request stays in the journal,
        whose last checkpoint at shutdown then records it in case the write is cut short."""
        try:
            with anyio.CancelScope(shield=True):  # even when the client's task is cancelled
                await run_in_threadpool(self._finish, job, tally, elapsed_s)
        except asyncio.CancelledError:
            raise
        except BaseException:
            self._close_journal(job)
            raise
        self._close_journal(job)

    def _close_journal(self, job: Job) -> None:
        if self._journal is not None:
            self._journal.close(job.request_id)

    async def _generate(self, job: Job, index: int) -> AsyncIterator[RequestOutput]:
        stream = self._engine.generate(
            job.prompt,
            job.params[index],
            adapter=job.target.engine_adapter,
            priority=job.caller.priority,
            tenant=job.caller.tenant_id,
            request_id=f"{job.request_id}-{index}",
        )
        try:
            async for out in stream:
                if out.finished and out.finish_reason == FinishReason.ERROR:
                    raise tenant_facing_error(job.target.model, out.error)
                yield out
        finally:
            await stream.aclose()

    async def _merged(self, job: Job, merge: _Merge) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The choices' outputs as they come, each choice read by its own task into the
        merge queue (so a stop can cut in whatever the engine is doing)."""

        async def pump(index: int) -> None:
            stream = self._generate(job, index)
            try:
                async for out in stream:
                    merge.queue.put_nowait((index, out))
                merge.queue.put_nowait((index, _DONE))
            except Exception as exc:
                merge.queue.put_nowait((index, exc))
            finally:
                await stream.aclose()

        tasks = [asyncio.create_task(pump(i)) for i in range(len(job.params))]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await merge.queue.get()
                if item is _STOP:
                    for stopped in sorted(merge.unfinished):
                        yield stopped, stopped_output(job, stopped)
                    return
                if item is _DONE:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    if item.finished:
                        merge.unfinished.discard(index)
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()  # closing each choice's stream aborts it on the engine
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await asyncio.gather(*tasks, return_exceptions=True)

    def _usage_event(
        self, job: Job, tally: Tally, elapsed_s: float, finish: str | None = None
    ) -> UsageEvent:
        """The request's usage as delivered so far (what the journal and the end record)."""
        return UsageEvent(
            request_id=job.request_id,
            tenant_id=job.caller.tenant_id,
            model=job.target.model,
            prompt_tokens=tally.prompt_tokens,
            cached_prompt_tokens=tally.cached_prompt_tokens,
            completion_tokens=tally.delivered_completion_tokens,
            adapter_id=job.target.adapter_id,
            adapter_version_id=job.target.adapter_version_id,
            latency_ms=int(elapsed_s * 1000),
            finish_reason=finish,
        )

    def _finish(self, job: Job, tally: Tally, elapsed_s: float) -> None:
        """Write the request's one usage record, then settle its holds (refund the unused
        tokens, release the budget hold). With the database down, the journal writes it
        once the database is back, then settles; ``tally.usage`` stays None."""
        finish = tally.choices[0].finish_reason or FinishReason.ABORT
        event = self._usage_event(job, tally, elapsed_s, str(finish))
        used = tally.prompt_tokens + tally.completion_tokens
        try:
            record = Meter(self._context.sessions).record(event)
        except Exception as exc:
            if self._journal is None or not database_unavailable(exc):
                job.holds.settle(used)
                raise
            # The client has (or is about to get) its tokens: the request does not fail.
            # The record keeps its moment (its day and price); the hold counts it meanwhile.
            logger.warning("usage of %s waits for the database: %s", job.request_id, exc)
            event = dataclasses.replace(event, created_at=utc_now())
            self._journal.write_later(event, job.holds.settle_later(used))
            return
        except BaseException:
            job.holds.settle(used)
            raise
        tally.usage = usage_for_response(record) if record is not None else _NO_USAGE
        job.holds.settle(used)

    # --- OpenAI shapes of logprobs ----------------------------------------------------
    def token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])

    def completion_logprobs(self, logprobs: Sequence[TokenLogprobs], offset: int) -> dict:
        """The completions API's ``logprobs`` object; ``offset`` is where the text starts."""
        tokens, token_logprobs, top, text_offset = [], [], [], []
        for entry in logprobs:
            text = self.token_text(entry.token_id)
            tokens.append(text)
            token_logprobs.append(entry.logprob)
            top.append({self.token_text(t): lp for t, lp in entry.top})
            text_offset.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": text_offset,
        }

    def chat_logprobs(self, logprobs: Sequence[TokenLogprobs], top_n: int) -> dict:
        """The chat API's ``logprobs`` object (``{"content": [...]}``)."""

        def item(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = []
        for entry in logprobs:
            alternatives = [item(t, lp) for t, lp in entry.top[:top_n]]
            content.append({**item(entry.token_id, entry.logprob), "top_logprobs": alternatives})
        return {"content": content}


LIMITS_UNAVAILABLE_RETRY_AFTER_S = 5


@contextlib.contextmanager
def limits_reachable() -> Iterator[None]:
    """Fail-closed: an unreachable limits store (Redis) refuses the request with 503."""
    try:
        yield
    except LimitsUnavailable as exc:
        logger.warning("limits store unreachable, request refused (fail-closed): %s", exc)
        raise APIError(
            503,
            "This tenant's rate limits and budget cannot be checked right now (their store "
            "is unreachable), so its requests are refused until it is back; try again in a "
            "few seconds.",
            code="limits_unavailable",
            headers={"Retry-After": str(LIMITS_UNAVAILABLE_RETRY_AFTER_S)},
        ) from exc


def build_params(sampling: dict[str, Any], n: int) -> tuple[SamplingParams, ...]:
    """One ``SamplingParams`` per choice (seeded choices get seed, seed+1, ...); 400 if bad."""
    given = {k: v for k, v in sampling.items() if v is not None}
    seed = given.pop("seed", None)
    try:
        return tuple(
            SamplingParams(**given, seed=None if seed is None else seed + i) for i in range(n)
        )
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_parameters") from exc


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
        raise APIError(
            402,
            f"Monthly budget exhausted: this month's usage costs ${micro_usd_to_usd(spent):.6f} of a "
            f"${micro_usd_to_usd(budget):.6f} budget. Ask your operator to raise it.",
            code="budget_exceeded",
        )


def _affordable_tokens(price: Price, n: int, prompt_tokens: int, room: int, most: int) -> int:
    """The largest ``max_tokens <= most`` whose maximum cost (``n`` choices of the prompt
    and ``max_tokens`` at ``price``) fits in ``room`` micro-dollars; 0 when none does."""

    def cost(max_tokens: int) -> int:
        return cost_micro_usd(price, n * prompt_tokens, 0, n * max_tokens)

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
