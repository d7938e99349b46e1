"""Serving completions and chat completions: from a tenant's request to metered engine output.

One HTTP request becomes a :class:`Job`: the target (base model or one of the tenant's
adapter versions, loaded into the engine), the prompt, and one ``SamplingParams`` per
choice (``n`` independent engine requests). Before anything runs, the tenant's monthly
budget (402) and rate limits (429) are checked; the limits reserve
``n * (prompt tokens + max_tokens)`` tokens and the unused part is refunded at the end.

:meth:`InferenceService.run` streams ``(choice index, RequestOutput delta)`` pairs of all the
choices as they come. The caller marks each delta *delivered* once the client has it
(:meth:`Tally.deliver`); when the run ends for whatever reason (finished, failed, client
gone) exactly one usage record is written for the HTTP request, whose id is the
response id, with the prompt tokens of every choice and only the delivered completion
tokens. The ``usage`` object the client gets carries the record's own numbers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
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
from loramux.platform.db.models import Tenant
from loramux.platform.db.types import utc_now
from loramux.platform.limits import TenantLimits
from loramux.platform.services.adapter_runtime import AdapterNotServable, AdapterRuntime
from loramux.platform.services.adapters import ready_version
from loramux.platform.services.metering import Meter, UsageEvent, usage_for_response
from loramux.platform.services.rollups import month_spend
from loramux.platform.services.tenants import micro_usd_to_usd

logger = logging.getLogger(__name__)

_DONE = object()  # a pump's end-of-choice marker in the merge queue
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

    @classmethod
    def of(cls, tenant: Tenant) -> Caller:
        return cls(tenant.id, tenant.priority, tenant.requests_per_minute, tenant.tokens_per_minute)


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
    reserved_tokens: int  # debited from the tokens/minute bucket


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
    """Per-choice accounting of what reached the client."""

    def __init__(self, job: Job):
        self.choices = [Choice(prompt_tokens=job.prompt_tokens) for _ in job.params]
        self.usage: dict[str, Any] | None = None  # set once the run has ended and was metered

    def deliver(self, index: int, out: RequestOutput) -> None:
        """``out``'s delta reached the client (or, non-streaming, will in the response)."""
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
        return sum(len(c.token_ids) for c in self.choices)


def delta_logprobs(out: RequestOutput) -> list[TokenLogprobs]:
    """The log-probabilities of ``out``'s new tokens (``out.logprobs`` holds them all)."""
    count = len(out.delta_token_ids)
    return list(out.logprobs[-count:]) if count and out.logprobs else []


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class EngineRequestFailed(RuntimeError):
    """The engine ended a request it could not serve (e.g. its adapter failed to load)."""


def tenant_facing_error(model: str, engine_error: str | None) -> str:
    """What a tenant is told when the engine could not serve its request.

    The engine's own message names internal ids, store endpoints, buckets and object keys:
    it goes to the log for operators; the tenant gets the adapter's name and what to do.
    """
    logger.warning("request for %r failed in the engine: %s", model, engine_error)
    if engine_error and "cannot be served" in engine_error:
        return (
            f"adapter {model!r} is too large for this deployment's device memory; "
            "ask your operator to raise the adapter memory budget"
        )
    return (
        f"adapter {model!r} could not be loaded from adapter storage right now; try again shortly"
    )


# --- the service --------------------------------------------------------------------------


class InferenceService:
    """Turns requests into jobs and runs them on the context's engine."""

    def __init__(self, context: PlatformContext):
        if context.engine is None:
            raise APIError(503, "No engine is running in this process.", code="no_engine")
        self._context = context
        self._engine = context.engine
        self._tokenizer = context.engine.tokenizer
        self._max_model_len = context.engine.max_model_len

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
        if sampling.get("max_tokens") is None:
            sampling["max_tokens"] = default_max_tokens or self.default_max_tokens(prompt_tokens)
        params = build_params(sampling, n)
        caller = Caller.of(tenant)
        check_budget(session, tenant)
        reserved = n * (prompt_tokens + params[0].max_tokens)
        self._reserve(caller, reserved)
        return Job(
            request_id=request_id,
            created=int(time.time()),
            caller=caller,
            target=target,
            prompt=prompt,
            prompt_tokens=prompt_tokens,
            params=params,
            reserved_tokens=reserved,
        )

    def _reserve(self, caller: Caller, tokens: int) -> None:
        decision = TenantLimits(self._context.rate_limiter).check_request(
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

    # --- running ----------------------------------------------------------------------
    async def run(self, job: Job, tally: Tally) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every choice's deltas as they come; the usage record is written when this ends.

        Raises ``EngineError`` (a refused request), ``AsyncEngineError`` from the engine, or
        ``EngineRequestFailed`` when the engine ended it unserved (its adapter failed).
        Closing the iterator early aborts the choices still running.
        """
        started = time.monotonic()
        try:
            async for item in self._merged(job):
                yield item
        finally:
            with anyio.CancelScope(shield=True):  # even when the client's task is cancelled
                await run_in_threadpool(self._finish, job, tally, time.monotonic() - started)

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
                    raise EngineRequestFailed(tenant_facing_error(job.target.model, out.error))
                yield out
        finally:
            await stream.aclose()

    async def _merged(self, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        if len(job.params) == 1:
            stream = self._generate(job, 0)
            try:
                async for out in stream:
                    yield 0, out
            finally:
                with anyio.CancelScope(shield=True):
                    await stream.aclose()
            return

        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int) -> None:
            stream = self._generate(job, index)
            try:
                async for out in stream:
                    queue.put_nowait((index, out))
                queue.put_nowait((index, _DONE))
            except Exception as exc:
                queue.put_nowait((index, exc))
            finally:
                await stream.aclose()

        tasks = [asyncio.create_task(pump(i)) for i in range(len(job.params))]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is _DONE:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await asyncio.gather(*tasks, return_exceptions=True)

    def _finish(self, job: Job, tally: Tally, elapsed_s: float) -> None:
        """Write the request's one usage record and refund the unused token reservation."""
        finish = tally.choices[0].finish_reason or "abort"
        event = UsageEvent(
            request_id=job.request_id,
            tenant_id=job.caller.tenant_id,
            model=job.target.model,
            prompt_tokens=tally.prompt_tokens,
            cached_prompt_tokens=tally.cached_prompt_tokens,
            completion_tokens=tally.completion_tokens,
            adapter_id=job.target.adapter_id,
            adapter_version_id=job.target.adapter_version_id,
            latency_ms=int(elapsed_s * 1000),
            finish_reason=finish,
        )
        record = Meter(self._context.sessions).record(event)
        tally.usage = usage_for_response(record) if record is not None else _NO_USAGE
        used = tally.prompt_tokens + tally.completion_tokens
        TenantLimits(self._context.rate_limiter).refund_tokens(
            job.caller.tenant_id,
            tokens_per_minute=job.caller.tokens_per_minute,
            tokens=max(0, job.reserved_tokens - used),
        )

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
