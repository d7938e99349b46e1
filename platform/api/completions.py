"""OpenAI-compatible inference: ``/v1/completions``, ``/v1/chat/completions`` and
``/v1/adapters/{name}/completions``.

The routes resolve the model and hand a job to
:class:`~loramux.platform.services.inference.InferenceService`; this module only shapes
the engine's deltas into OpenAI's JSON (a response, or server-sent chunks ending in
``data: [DONE]``).

A client that goes away ends its request at once, streamed or not: a stream stops at the
first chunk the server could not write (and is billed for those it wrote), or when
Starlette's disconnect listener cancels it; a non-streamed request races its run against
the ASGI ``http.disconnect`` and, when the client wins, the run is closed (which aborts
the engine work, in process or over HTTP to an engine process) and nothing is billed,
since no response reached the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import aclosing
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from sqlalchemy.orm import Session
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive

from loramux.engine import AsyncEngineError, EngineError, RequestOutput
from loramux.platform.api.deps import AdapterRuntimeDep, ContextDep, CurrentTenant, SessionDep
from loramux.platform.api.error_codes import ERROR_CODES, error_detail
from loramux.platform.api.errors import APIError
from loramux.platform.api.openai_render import ChatRender, CompletionRender, Render
from loramux.platform.api.schemas_openai import (
    AdapterCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
)
from loramux.platform.db.models import Tenant
from loramux.platform.engine_fleet.remote import EngineLost, EngineUnavailable
from loramux.platform.services.deadlines import DeadlineExceeded
from loramux.platform.services.engine_failures import EngineRequestFailed
from loramux.platform.services.inference import InferenceService
from loramux.platform.services.inference_job import Job, Tally, Target, new_request_id

router = APIRouter(tags=["inference"])
logger = logging.getLogger(__name__)


CLIENT_CLOSED_REQUEST = 499  # what the log and metrics show for a client that left early
DEADLINE_STATUS = ERROR_CODES["deadline_exceeded"].status


def get_inference(context: ContextDep, request: Request) -> InferenceService:
    state = request.app.state
    return InferenceService(
        context,
        journal=getattr(state, "usage_journal", None),
        running=getattr(state, "running_requests", None),
        load=getattr(state, "load_control", None),
    )


InferenceDep = Annotated[InferenceService, Depends(get_inference)]


# --- running a job -----------------------------------------------------------------------------


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def _engine_error(exc: Exception) -> APIError:
    """What the tenant is told when the engine refused or could not finish a request (the
    engine's own words name hosts and internal ids: they go to the log)."""
    if isinstance(exc, EngineError):
        return APIError(400, str(exc), code="invalid_request")
    if isinstance(exc, EngineRequestFailed):
        status = ERROR_CODES[exc.code].status
        return APIError(status, f"The request could not be served: {exc}", code=exc.code)
    logger.warning("engine failure: %s: %s", type(exc).__name__, exc)
    engine_id = getattr(exc, "engine_id", None)
    if isinstance(exc, EngineUnavailable) and not isinstance(exc, EngineLost):
        return APIError(
            503,
            "No engine can take this request right now (none is running or reachable); "
            "nothing was generated or billed. Try again shortly.",
            code="engine_unavailable",
        )
    which = f"The engine ({engine_id})" if engine_id else "The engine"
    return APIError(
        503,
        f"{which} running this request stopped before it finished; what was streamed, if "
        "anything, is billed, nothing else. Try again.",
        code="engine_error",
    )


_ENGINE_FAILURES = (EngineError, AsyncEngineError, EngineRequestFailed)


async def _respond(
    request: Request,
    service: InferenceService,
    job: Job,
    render: Render,
    *,
    stream: bool,
    include_usage: bool,
) -> Any:
    """The job's answer. Whatever fails before the first token is an HTTP error, streamed
    or not (a stream's 200 waits for its first output); what fails later in a stream is an
    error event with the same envelope, then ``[DONE]``."""
    tally = Tally(job, streamed=stream)
    run = service.run(job, tally)
    first: list[tuple[int, RequestOutput]] = []
    try:
        if stream:
            served = await _unless_disconnected(request.receive, _first(run, first))
        else:
            served = await _unless_disconnected(request.receive, _collect(run, tally))
    except DeadlineExceeded as exc:
        await _close(run, job)
        return _deadline_response(exc, None if stream else render.response(tally))
    except BaseException:
        await _close(run, job)
        raise
    if not served:
        await _close(run, job)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if not stream:
        await _close(run, job)
        return render.response(tally)
    # The client may leave before the body starts: the background still closes the run.
    return StreamingResponse(
        _stream(request, run, first, tally, render, include_usage),
        media_type="text/event-stream",
        background=BackgroundTask(_close, run, job),
    )


async def _close(run: AsyncGenerator, job: Job) -> None:
    """End the run (aborting what still runs; its usage is written) and, if it never
    started, give back what admission held (its place in the queue too)."""
    await run.aclose()
    if job.ticket is not None:
        job.ticket.close()
    if not job.holds.settled:
        await run_in_threadpool(job.holds.settle, 0)


def _deadline_response(exc: DeadlineExceeded, partial: dict[str, Any] | None) -> Response:
    """504 ``deadline_exceeded``; a non-streamed request's body also carries the response
    as far as it got (``partial``, with its ``usage``): what it is billed for."""
    body: dict[str, Any] = {"error": error_detail(DEADLINE_STATUS, exc.message, exc.code)}
    if partial is not None:
        body["partial"] = partial
    return JSONResponse(body, status_code=DEADLINE_STATUS)


async def _first(run: AsyncIterator, first: list) -> None:
    try:
        first.extend([await anext(run)])
    except StopAsyncIteration:
        pass
    except _ENGINE_FAILURES as exc:
        raise _engine_error(exc) from exc


async def _collect(run: AsyncIterator, tally: Tally) -> None:
    try:
        async for index, out in run:
            tally.deliver(index, out)
    except _ENGINE_FAILURES as exc:
        raise _engine_error(exc) from exc


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has gone (the request body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(receive: Receive, work: Awaitable[None]) -> bool:
    """Run ``work`` unless the client goes away first: True when it ran to its end (its
    exception is raised), False when the client left and ``work`` was cancelled."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():  # the client left (or this task is being cancelled)
            work_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work_task  # the run's own clean-up: abort, billing
    if work_task.cancelled():
        return False
    work_task.result()  # the run's error, if any
    return True


async def _stream(
    request: Request,
    run: AsyncGenerator,
    first: list[tuple[int, RequestOutput]],
    tally: Tally,
    render: Render,
    include_usage: bool,
) -> AsyncIterator[str]:
    for chunk in render.opening():
        yield _sse(chunk)
    try:
        async with aclosing(run):
            for index, out in first:
                yield _sse(render.chunk(index, out, tally))
                if not await _written(request):
                    return
                tally.deliver(index, out)  # only once the client was handed the chunk
            async for index, out in run:
                yield _sse(render.chunk(index, out, tally))
                if not await _written(request):
                    return  # closing the run aborts it; what was delivered is billed
                tally.deliver(index, out)
    except _ENGINE_FAILURES as exc:
        error = _engine_error(exc)
        yield _sse({"error": error_detail(error.status_code, error.message, error.code)})
    except DeadlineExceeded as exc:
        yield _sse({"error": error_detail(DEADLINE_STATUS, exc.message, exc.code)})
    if include_usage and tally.usage is not None:
        yield _sse(render.usage_chunk(tally))
    yield _sse("[DONE]")


async def _written(request: Request) -> bool:
    """Whether the chunk just handed to the server went out on the connection.

    A send returning proves nothing: a server on ASGI spec 2.3 (uvicorn) silently drops a
    send once the client has gone, and Starlette's disconnect listener, which ends the
    stream, may wake only after a few more chunks were "sent". The connection's state, read
    without waiting right after the send, says whether that send was written."""
    return not await request.is_disconnected()


async def _complete(
    request: Request,
    service: InferenceService,
    session: Session,
    tenant: Tenant,
    target: Target,
    body: AdapterCompletionRequest,
):
    job = await service.prepare(
        session,
        tenant,
        target,
        request_id=new_request_id("cmpl"),
        prompt=body.prompt,
        n=body.n,
        sampling=_sampling(body, max_tokens=body.max_tokens, logprobs=body.logprobs),
        default_max_tokens=16,  # OpenAI's default for completions
        timeout=body.timeout,
        end_user=body.user,
    )
    render = CompletionRender(service.tokenizer, job, body.logprobs)
    return await _respond(
        request, service, job, render, stream=body.stream, include_usage=body.include_usage
    )


def _sampling(body, **extra: Any) -> dict[str, Any]:
    fields = (
        "stop",
        "temperature",
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "seed",
    )
    return {**{name: getattr(body, name) for name in fields}, **extra}


# --- routes ------------------------------------------------------------------------------------

# /openapi.json: the answer is JSON, or with ``stream: true`` server-sent events.
_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The completion; with `stream: true`, server-sent events: one "
        "`data: {chunk}` per delta, then `data: [DONE]`.",
        "content": {"text/event-stream": {}},
    }
}


@router.post("/v1/completions", responses=_RESPONSES)
async def create_completion(
    request: Request,
    body: CompletionRequest,
    tenant: CurrentTenant,
    session: SessionDep,
    service: InferenceDep,
    runtime: AdapterRuntimeDep,
):
    """A text completion from the base model or one of the caller's adapters (``model``)."""
    target = await service.resolve(session, tenant, body.model, runtime)
    return await _complete(request, service, session, tenant, target, body)


@router.post("/v1/adapters/{name}/completions", responses=_RESPONSES)
async def create_adapter_completion(
    request: Request,
    name: str,
    body: AdapterCompletionRequest,
    tenant: CurrentTenant,
    session: SessionDep,
    service: InferenceDep,
    runtime: AdapterRuntimeDep,
):
    """A text completion from the caller's adapter ``name``."""
    target = await service.adapter_target(session, tenant, name, runtime)
    return await _complete(request, service, session, tenant, target, body)


@router.post("/v1/chat/completions", responses=_RESPONSES)
async def create_chat_completion(
    request: Request,
    body: ChatCompletionRequest,
    tenant: CurrentTenant,
    session: SessionDep,
    service: InferenceDep,
    runtime: AdapterRuntimeDep,
):
    """A chat completion: the messages rendered with the base model's chat template."""
    target = await service.resolve(session, tenant, body.model, runtime)
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    job = await service.prepare(
        session,
        tenant,
        target,
        request_id=new_request_id("chatcmpl"),
        messages=[m.for_template() for m in body.messages],
        n=body.n,
        sampling=_sampling(body, max_tokens=max_tokens, logprobs=top_logprobs),
        timeout=body.timeout,
        end_user=body.user,
    )
    render = ChatRender(service.tokenizer, job, top_logprobs)
    return await _respond(
        request, service, job, render, stream=body.stream, include_usage=body.include_usage
    )
