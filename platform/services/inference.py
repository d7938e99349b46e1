"""Serving completions and chat completions: from a job to metered engine output.

One HTTP request becomes a :class:`~loramux.platform.services.inference_job.Job` (checked
and bounded by :class:`~loramux.platform.services.admission.Admission`): the target (base
model or one of the tenant's adapter versions, loaded into the engine), its prompts (one,
or a completions batch), and one ``SamplingParams`` per sequence (``n`` independent engine
requests per prompt, or ``best_of`` candidates).

:meth:`InferenceService.run` streams ``(sequence index, RequestOutput delta)`` pairs of all
the sequences as they come. The caller marks each delta *delivered* once the client has it
(:meth:`Tally.deliver`; a non-streamed response delivers everything at once, and only if
the run reached its end, so the response is sent); when the run ends for whatever reason
(finished, failed, client gone, stopped by a shutdown) one usage record is written for the
HTTP request, whose id is the response id, with the prompt tokens of every sequence and only
the delivered completion tokens. A run that delivered nothing writes one only if it was
abandoned (its client left, or its deadline passed): its engine requests are aborted at
once, each answering with the prompt tokens it had prefilled, and those are billed (a
prompt list dropped mid-prefill is not free); one that failed, or was stopped by a
shutdown, before delivering anything writes none. While it runs, the usage journal
checkpoints what it delivered (a crash loses at most one checkpoint interval of tokens).
The ``usage`` object the client gets carries the record's own numbers. The job's holds on
the tenant's limits are settled after the record is written. A final record the database
cannot take (down or restarting) does not fail the request: the usage journal writes it
once the database is back, and the holds are settled then; the response carries no
``usage``. A shutdown past its grace period stops running
jobs (:class:`~loramux.platform.services.running.RunningRequests`): their choices end with
finish reason ``abort`` and the client gets what was generated.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import anyio
from sqlalchemy.orm import Session

from loramux.engine import FinishReason, RequestOutput
from loramux.platform.context import PlatformContext
from loramux.platform.db.models import Tenant
from loramux.platform.db.types import utc_now
from loramux.platform.errors import Invalid, NotFound, Unavailable
from loramux.platform.services.adapter_grants import callable_version
from loramux.platform.services.adapter_mix import MixPart, check_parts, parse_mixed_model
from loramux.platform.services.adapter_refs import AdapterRef
from loramux.platform.services.adapter_runtime import AdapterNotServable, AdapterRuntime
from loramux.platform.services.admission import Admission
from loramux.platform.services.deadlines import DEADLINE_FINISH, DeadlineExceeded
from loramux.platform.services.engine_failures import tenant_facing_error
from loramux.platform.services.inference_job import Job, Tally, Target, stopped_output
from loramux.platform.services.inference_request import InferenceRequest
from loramux.platform.services.load_shedding import LoadControl
from loramux.platform.services.metering import (
    Meter,
    Usage,
    UsageEvent,
    database_unavailable,
)
from loramux.platform.services.running import RunningRequests
from loramux.platform.services.usage_journal import UsageJournal

logger = logging.getLogger(__name__)
request_log = logging.getLogger("loramux.requests")  # a line per request served

T = TypeVar("T")

_DONE = object()  # a pump's end-of-choice marker in the merge queue
_STOP = object()  # the run was stopped (shutdown): end it now
_EXPIRED = object()  # the run passed its deadline: end it with an error
# An engine answers an abort once its current step is done (a fraction of a second); one
# that does not answer in this long is not waited for: the run's end (its usage record)
# must not hang on it, and closing the choices' streams aborts them anyway.
ABORT_WAIT_S = 5.0


async def _in_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a worker thread, off the event loop (anyio's pool)."""
    return await anyio.to_thread.run_sync(partial(fn, *args, **kwargs))


class _Expired(Exception):
    """The run's deadline passed (raised inside the service, turned into DeadlineExceeded)."""


class _Merge:
    """One run's choices as one queue of ``(index, output)``; ``stop`` ends it early, and
    so does ``expire``, which also abandons the choices' engine work at once.

    ``abort(indices)`` aborts those choices' engine requests and notes what each had done
    (the service's ``_abort_choices``)."""

    def __init__(self, choices: int, abort: Callable[[list[int]], Awaitable[None]]):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.unfinished = set(range(choices))
        self.pumps: list[asyncio.Task] = []
        self._abort = abort
        self.abandoning: asyncio.Future | None = None  # set once abandoned

    def stop(self) -> None:
        self.queue.put_nowait((-1, _STOP))

    def expire(self) -> None:
        """The deadline passed: the engine requests are abandoned now (their KV blocks are
        freed now, not when the client next reads); what they had queued is still handed out
        first, so the client gets, and is billed for, every token before the end."""
        self.abandon()
        self.queue.put_nowait((-1, _EXPIRED))

    def abandon(self) -> asyncio.Future:
        """Nobody will read the rest (the client left, or the deadline passed): abort the
        unfinished choices' engine requests, then cancel the pumps. Idempotent: the same
        future each time, done once the pumps are cancelled."""
        if self.abandoning is None:
            self.abandoning = asyncio.ensure_future(self._abort_then_cancel())
        return self.abandoning

    async def _abort_then_cancel(self) -> None:
        # Aborted by id first, not by closing their streams, so that each abort answers
        # with the request's metrics (what its prefill cost): cancelling a pump would
        # abort the request with no answer.
        try:
            running = [i for i in sorted(self.unfinished) if not self.pumps[i].done()]
            await self._abort(running)
        finally:
            for pump in self.pumps:
                pump.cancel()


def _log_request(event: UsageEvent, target: Target) -> None:
    """One line per request, as its usage record holds it, with the digest of the adapter
    weights that served it (never its prompt or its text)."""
    request_log.info(
        "request %s tenant=%s model=%r adapter_version=%s sha256=%s prompt_tokens=%d "
        "cached_prompt_tokens=%d completion_tokens=%d finish=%s latency_ms=%d",
        event.request_id,
        event.tenant_id,
        event.model,
        event.adapter_version_id or "-",
        target.adapter_sha256 or "-",
        event.prompt_tokens,
        event.cached_prompt_tokens,
        event.completion_tokens,
        event.finish_reason,
        event.latency_ms,
    )


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
        load: LoadControl | None = None,
    ):
        if context.engine is None:
            raise Unavailable("No engine is running in this process.", code="engine_unavailable")
        self._context = context
        self._engine = context.engine
        self.tokenizer = context.engine.tokenizer
        self.admission = Admission(
            context,
            self.tokenizer,
            context.engine.max_model_len,
            vocab_size=len(self.tokenizer),
        )
        self._journal = journal
        self._running = running
        self._load = load

    # --- resolving the model ----------------------------------------------------------
    async def resolve(
        self,
        session: Session,
        tenant: Tenant,
        model: str,
        runtime: AdapterRuntime,
        adapters: list[MixPart] | None = None,
    ) -> Target:
        """The base model by its id, a composition of adapters (``adapters``, with
        ``model`` the base model's id; or ``model`` in ``adapter_mix``'s form), else the
        adapter ``model`` names that the tenant may call; 404 otherwise."""
        base = self._context.base_model.model_id
        if adapters is not None:
            if model != base:
                raise Invalid(
                    f"With `adapters`, `model` names the base model ({base!r}), to which "
                    f"they are added; got {model!r}.",
                    code="invalid_model",
                )
            return await self.mix_target(session, tenant, adapters, runtime)
        if model == base:
            return Target(model=model)
        parts = parse_mixed_model(model)
        if parts is not None:
            return await self.mix_target(session, tenant, parts, runtime)
        return await self.adapter_target(session, tenant, model, runtime)

    async def mix_target(
        self, session: Session, tenant: Tenant, parts: list[MixPart], runtime: AdapterRuntime
    ) -> Target:
        """Several adapters the tenant may call, weighted (``adapter_mix``): each part's
        version, on the engine. Its ``model`` names each version served."""
        check_parts(parts, self._context.settings.max_mixed_adapters)
        found = []
        for part in parts:
            ref = AdapterRef.parse(part.ref)
            callable_ = await _in_thread(callable_version, session, tenant, ref)
            if callable_ is None:
                raise NotFound(
                    f"The adapter {part.ref!r} of this composition does not exist or you "
                    "do not have access to it.",
                    code="model_not_found",
                )
            found.append((ref, callable_[1], part.weight))
        if len({version.id for _, version, _ in found}) < len(found):
            raise Invalid(
                "The composition names one adapter version twice: give each once, with "
                "the sum of its weights.",
                code="invalid_adapters",
            )
        mix, labels = [], []
        for ref, version, weight in found:
            mix.append((await self._engine_name(runtime, version, str(ref)), weight))
            owned = ref.name if ref.owner is None else f"{ref.owner}/{ref.name}"
            labels.append(f"{owned}@{version.version}*{weight:g}")
        digests = "+".join(version.sha256 or "" for _, version, _ in found)
        return Target("+".join(labels), mix=tuple(mix), adapter_sha256=digests)

    async def _engine_name(self, runtime: AdapterRuntime, version, model: str) -> str:
        try:
            return await runtime.ensure_loaded(version)
        except AdapterNotServable as exc:
            raise Unavailable(
                f"Adapter {model!r} cannot be served: {exc}", code="adapter_unavailable"
            ) from exc

    async def adapter_target(
        self, session: Session, tenant: Tenant, model: str, runtime: AdapterRuntime
    ) -> Target:
        """The version of the adapter that ``model`` names (``adapter_refs``): the tenant's
        own, or another's granted to it (``adapter_grants``)."""
        ref = AdapterRef.parse(model)
        found = await _in_thread(callable_version, session, tenant, ref)
        if found is None:
            what = "does not exist" if ref.is_bare else "names no ready version"
            raise NotFound(
                f"The model {model!r} {what} or you do not have access to it.",
                code="model_not_found",
            )
        adapter, version = found
        engine_name = await self._engine_name(runtime, version, model)
        return Target(model, engine_name, adapter.id, version.id, adapter_sha256=version.sha256)

    # --- building a job ---------------------------------------------------------------
    async def prepare(
        self, session: Session, tenant: Tenant, target: Target, request: InferenceRequest
    ) -> Job:
        """Validate, check the queue, the deadline, budget and limits, and reserve tokens:
        the job to run (:meth:`Admission.prepare`, in a worker thread, off the event loop)."""
        return await _in_thread(
            self.admission.prepare, session, tenant, target, request, load=self._load
        )

    # --- running ----------------------------------------------------------------------
    async def run(self, job: Job, tally: Tally) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every choice's deltas as they come; the usage record is written when this ends.

        Raises ``EngineError`` (a refused request), ``AsyncEngineError`` from the engine, or
        ``EngineRequestFailed`` when the engine ended it unserved (its adapter failed).
        Closing the iterator early (or cancelling its reader: the client left) abandons the
        run: the choices still running are aborted, and the tally learns what each had
        prefilled (billed if nothing was delivered). A shutdown's
        ``stop_all`` ends it early: each unfinished choice then ends with an empty output
        whose finish reason is ``abort``.
        """
        started = time.monotonic()
        merge = _Merge(len(job.params), partial(self._abort_choices, job, tally))
        handle = self._running.add(merge.stop) if self._running is not None else None
        if self._journal is not None:
            self._journal.open(
                job.request_id, lambda: self._usage_event(job, tally, time.monotonic() - started)
            )
        try:
            # Closed with this run (not left to the garbage collector), so that the choices
            # are aborted, and their prefill known, before the usage is written below.
            async with contextlib.aclosing(self._merged(job, tally, merge)) as merged:
                async for item in merged:
                    yield item
            tally.ended = True
        except (GeneratorExit, asyncio.CancelledError):
            tally.abandoned = True  # the caller stopped reading: the client left
            raise
        except _Expired:
            # What came before the deadline is the client's: a stream's chunks, or the
            # partial response in a non-streamed request's error body. It is billed.
            tally.ended = tally.expired = tally.abandoned = True
            if self._load is not None:
                state = "generating" if tally.completion_tokens else "queued"
                self._load.expired(job.caller.tenant_id, state)
            raise DeadlineExceeded(job.deadline, tally.completion_tokens) from None
        finally:
            if handle is not None:
                self._running.discard(handle)
            if job.ticket is not None:
                job.ticket.close()
            await self._end(job, tally, time.monotonic() - started)

    async def _end(self, job: Job, tally: Tally, elapsed_s: float) -> None:
        """Write the final record. Cancelled once more while it is written (uvicorn's
        shutdown backstop, then the event loop's own end), the request stays in the journal,
        whose last checkpoint at shutdown then records it in case the write is cut short."""
        try:
            with anyio.CancelScope(shield=True):  # even when the client's task is cancelled
                await _in_thread(self._finish, job, tally, elapsed_s)
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
        stream = self._engine.stream(job.engine_request(index))
        try:
            async for out in stream:
                if out.finished and out.finish_reason == FinishReason.ERROR:
                    raise tenant_facing_error(job.target.model, out)
                yield out
        finally:
            await stream.aclose()

    async def _merged(
        self, job: Job, tally: Tally, merge: _Merge
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The choices' outputs as they come, each choice read by its own task into the
        merge queue (so a stop can cut in whatever the engine is doing). Closed early (the
        client left) or past its deadline, it abandons the choices (``_Merge.abandon``)."""

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

        tasks = merge.pumps = [asyncio.create_task(pump(i)) for i in range(len(job.params))]
        timer = asyncio.get_running_loop().call_later(
            max(0.0, job.deadline.remaining()), merge.expire
        )
        started: set[int] = set()
        stopping = False
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await merge.queue.get()
                if item is _STOP:
                    stopping = True
                    for stopped in sorted(merge.unfinished):
                        yield stopped, stopped_output(job, stopped)
                    return
                if item is _EXPIRED:
                    raise _Expired
                if item is _DONE:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    self._observe(job, index, item, first=index not in started)
                    tally.prefilled(index, item.metrics)
                    started.add(index)
                    if item.finished:
                        merge.unfinished.discard(index)
                    yield index, item
        except (GeneratorExit, asyncio.CancelledError):
            if not stopping:  # the client left: abandoned, not stopped by a shutdown
                merge.abandon()
            raise
        finally:
            timer.cancel()
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                if merge.abandoning is not None:
                    await merge.abandoning
                for task in tasks:
                    task.cancel()  # closing each choice's stream aborts it on the engine
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _abort_choices(self, job: Job, tally: Tally, indices: list[int]) -> None:
        """Abort the choices' engine requests; each abort answers with the request's final
        output, whose metrics say how much of its prompt the engine had prefilled."""
        if not indices or self._engine.not_ready_reason() is not None:
            return  # no engine runs them (an abort must not start a stopped engine loop)
        aborts = (
            asyncio.wait_for(self._engine.abort(f"{job.request_id}-{index}"), ABORT_WAIT_S)
            for index in indices
        )
        outs = await asyncio.gather(*aborts, return_exceptions=True)
        failures = [out for out in outs if isinstance(out, BaseException)]
        if failures:  # their pumps' cancellation still ends them, unanswered
            logger.warning(
                "aborting %d choice(s) of %s failed: %r", len(failures), job.request_id, failures[0]
            )
        for index, out in zip(indices, outs, strict=True):
            if isinstance(out, RequestOutput):
                tally.prefilled(index, out.metrics)

    def _observe(self, job: Job, index: int, out: RequestOutput, *, first: bool) -> None:
        """A choice's first output takes it out of the queue; outputs feed the measured
        rates that predict when a new request would start."""
        if first and job.ticket is not None:
            job.ticket.started(index)
        if self._load is not None:
            self._load.observe(out, first=first)

    def _usage_event(
        self, job: Job, tally: Tally, elapsed_s: float, finish: str | None = None
    ) -> UsageEvent:
        """The request's usage as delivered so far (what the journal and the end record);
        abandoned before it delivered anything, the prompt tokens the engine prefilled."""
        prefill_only = tally.bills_prefill_only
        return UsageEvent(
            request_id=job.request_id,
            tenant_id=job.caller.tenant_id,
            model=job.target.model,
            prompt_tokens=tally.prefilled_prompt_tokens if prefill_only else tally.prompt_tokens,
            cached_prompt_tokens=(
                tally.prefilled_cached_tokens if prefill_only else tally.cached_prompt_tokens
            ),
            completion_tokens=tally.delivered_completion_tokens,
            adapter_id=job.target.adapter_id,
            adapter_version_id=job.target.adapter_version_id,
            latency_ms=int(elapsed_s * 1000),
            finish_reason=finish,
            end_user=job.end_user,
            delivered_prompt=tally.delivered_prompt,
            abandoned_prefill=prefill_only,
        )

    def _finish(self, job: Job, tally: Tally, elapsed_s: float) -> None:
        """Write the request's one usage record, then settle its holds (refund the unused
        tokens, release the budget hold). With the database down, the journal writes it
        once the database is back, then settles; ``tally.usage`` stays None."""
        finish = (
            DEADLINE_FINISH
            if tally.expired
            else (tally.choices[0].finish_reason or FinishReason.ABORT)
        )
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
            _log_request(event, job.target)
            return
        except BaseException:
            job.holds.settle(used)
            raise
        tally.usage = Usage.of(record) if record is not None else Usage()
        job.holds.settle(used)
        _log_request(event, job.target)
