"""OpenAI's Responses API for text (and JSON: ``text.format``): ``POST /v1/responses`` and
``POST /v1/adapters/{name}/responses``.

A response is a chat completion underneath: its input (``responses/input.py``) is rendered with
the chat template and runs as a one-choice job on the same path as chat (admission, queue,
deadline, budget and rate limits, fairness, one usage record with the request's ``user``);
``responses/render.py`` shapes the answer. Nothing is stored: there is no retrieval, and
``previous_response_id`` is refused.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from loramux.platform.api.deps import AdapterRuntimeDep, CurrentTenant, SessionDep
from loramux.platform.api.openai.params import check_no_priority
from loramux.platform.api.openai.requests import response_request
from loramux.platform.api.openai.respond import InferenceDep, respond
from loramux.platform.api.openai.structured import check_structured, text_format_spec
from loramux.platform.api.responses.input import check_supported, messages_of
from loramux.platform.api.responses.render import ResponsesRender
from loramux.platform.api.responses.schemas import AdapterResponseRequest, ResponseRequest
from loramux.platform.db.models import Tenant
from loramux.platform.services.inference import InferenceService
from loramux.platform.services.inference_job import Target

router = APIRouter(tags=["inference"])

# /openapi.json: the answer is JSON, or with ``stream: true`` server-sent events.
_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The response object; with `stream: true`, server-sent events "
        "(`event: <type>` and `data: {event}`), from `response.created` to "
        "`response.completed` (or `response.incomplete`, `response.failed`).",
        "content": {"text/event-stream": {}},
    }
}


async def _answer(
    request: Request,
    service: InferenceService,
    session: Session,
    tenant: Tenant,
    target: Target,
    body: AdapterResponseRequest,
):
    check_no_priority(body.priority)
    check_supported(body)
    structured = text_format_spec(body.text)
    await run_in_threadpool(check_structured, structured, "text.format")
    inference = response_request(body, messages_of(body), structured)
    job = await service.prepare(session, tenant, target, inference)
    settings = body.model_dump(
        include={"instructions", "max_output_tokens", "temperature", "top_p", "user", "metadata"}
    )
    if structured is not None:
        settings["text"] = {"format": body.text["format"]}  # returned as sent
    render = ResponsesRender(service.tokenizer, job, settings)
    return await respond(request, service, job, render, stream=body.stream, include_usage=False)


@router.post("/v1/responses", responses=_RESPONSES)
async def create_response(
    request: Request,
    body: ResponseRequest,
    tenant: CurrentTenant,
    session: SessionDep,
    service: InferenceDep,
    runtime: AdapterRuntimeDep,
):
    """A model response (text in, text out) from the base model or one of the caller's
    adapters (``model``)."""
    target = await service.resolve(session, tenant, body.model, runtime, body.mix_parts())
    return await _answer(request, service, session, tenant, target, body)


@router.post("/v1/adapters/{name}/responses", responses=_RESPONSES)
async def create_adapter_response(
    request: Request,
    name: str,
    body: AdapterResponseRequest,
    tenant: CurrentTenant,
    session: SessionDep,
    service: InferenceDep,
    runtime: AdapterRuntimeDep,
):
    """A model response from the caller's adapter ``name``."""
    target = await service.adapter_target(session, tenant, name, runtime)
    return await _answer(request, service, session, tenant, target, body)
