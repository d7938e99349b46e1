"""Running an inference job and answering with it: a JSON response, or server-sent events.

Every inference route (completions, chat, responses) resolves its model, prepares a
:class:`~loramux.platform.services.inference_job.Job` and hands it here with a
:class:`~loramux.platform.api.openai.render.Render`, which shapes the engine's deltas into
its API's JSON: a response, or a stream (the render's opening events, one or more events per
delta, its closing events; ``data: [DONE]`` for the chat-style APIs).

A client that goes away ends its request at once, streamed or not: a stream stops at the
first chunk the server could not write (and is billed for those it wrote), or when
Starlette's disconnect listener cancels it; a non-streamed request races its run against
the ASGI ``http.disconnect`` and, when the client wins, the run is closed: its engine
requests are aborted at once (in process, or on the engine process running them) and,
since no response reached the client, only the prompt tokens the engine had prefilled are
billed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import aclosing
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive

from loramux.engine import AsyncEngineError, EngineError, RequestOutput, UnknownAdapter
from loramux.platform.api.deps import ContextDep
from loramux.platform.api.error_codes import ERROR_CODES, error_detail
from loramux.platform.api.errors import APIError
from loramux.platform.api.openai.render import Render
from loramux.platform.engine_fleet.remote import EngineLost, EngineUnavailable
from loramux.platform.services.deadlines import DeadlineExceeded
from loramux.platform.services.engine_failures import EngineRequestFailed
from loramux.platform.services.inference import InferenceService
from loramux.platform.services.inference_job import Job, Tally

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


def _engine_error(exc: Exception) -> APIError:
    """What the tenant is told when the engine refused or could not finish a request (the
    engine's own words name hosts and internal ids: they go to the log)."""
    if isinstance(exc, UnknownAdapter):
        # The adapter was deleted between the request's admission and the engine: as if
        # the delete had come first.
        return APIError(
            404,
            "The model was deleted while this request was being admitted; nothing was "
            "generated or billed.",
            code="model_not_found",
        )
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


async def respond(
    request: Request,
    service: InferenceService,
    job: Job,
    render: Render,
    *,
    stream: bool,
    include_usage: bool,
) -> Any:
    """The job's answer. Whatever fails before the first token is an HTTP error, streamed
    or not (a stream's 200 waits for its first output); what fails later in a stream is the
    render's error event (the same envelope), then its closing events."""
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
    for event in render.opening():
        yield render.sse(event)
    failed = False
    try:
        async with aclosing(run):
            for index, out in first:
                yield "".join(render.sse(e) for e in render.chunks(index, out, tally))
                if not await _written(request):
                    return
                tally.deliver(index, out)  # only once the client was handed the chunk
            async for index, out in run:
                yield "".join(render.sse(e) for e in render.chunks(index, out, tally))
                if not await _written(request):
                    return  # closing the run aborts it; what was delivered is billed
                tally.deliver(index, out)
    except _ENGINE_FAILURES as exc:
        error = _engine_error(exc)
        failed = True
        yield render.sse(render.error(error_detail(error.status_code, error.message, error.code)))
    except DeadlineExceeded as exc:
        failed = True
        yield render.sse(render.error(error_detail(DEADLINE_STATUS, exc.message, exc.code)))
    for event in render.closing(tally, include_usage=include_usage, failed=failed):
        yield render.sse(event)


async def _written(request: Request) -> bool:
    """Whether the chunk just handed to the server went out on the connection.

    A send returning proves nothing: a server on ASGI spec 2.3 (uvicorn) silently drops a
    send once the client has gone, and Starlette's disconnect listener, which ends the
    stream, may wake only after a few more chunks were "sent". The connection's state, read
    without waiting right after the send, says whether that send was written."""
    return not await request.is_disconnected()


# /openapi.json: the answer is JSON, or with ``stream: true`` server-sent events.
STREAMED_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The completion; with `stream: true`, server-sent events: one "
        "`data: {chunk}` per delta, then `data: [DONE]`.",
        "content": {"text/event-stream": {}},
    }
}
