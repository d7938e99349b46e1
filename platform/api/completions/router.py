"""OpenAI's (legacy) text completions: ``POST /v1/completions`` and
``POST /v1/adapters/{name}/completions``.

The routes resolve the model, read OpenAI's fields (``openai/params.py``) and hand a job to
:class:`~loramux.platform.services.inference.InferenceService`; ``openai/respond.py`` runs
it and answers with the JSON the render shapes (a response, or server-sent chunks ending
in ``data: [DONE]``).

A completion's ``prompt`` may be a batch: each prompt gets ``n`` choices (the best ``n`` of
``best_of``), indexed prompt-major as OpenAI does (``index = prompt_index * n + i``, in a
stream's chunks too), and one usage record sums them all. ``response_format`` is accepted
as an extension (``openai/structured.py``), checked before admission.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from loramux.platform.api.deps import AdapterRuntimeDep, CurrentTenant, SessionDep
from loramux.platform.api.openai.params import check_no_priority
from loramux.platform.api.openai.render import CompletionRender
from loramux.platform.api.openai.requests import completion_request
from loramux.platform.api.openai.respond import STREAMED_RESPONSES, InferenceDep, respond
from loramux.platform.api.openai.schemas import AdapterCompletionRequest, CompletionRequest
from loramux.platform.api.openai.structured import check_structured
from loramux.platform.db.models import Tenant
from loramux.platform.services.inference import InferenceService
from loramux.platform.services.inference_job import Target

router = APIRouter(tags=["inference"])


async def _complete(
    request: Request,
    service: InferenceService,
    session: Session,
    tenant: Tenant,
    target: Target,
    body: AdapterCompletionRequest,
):
    check_no_priority(body.priority)
    inference = completion_request(body)
    await run_in_threadpool(check_structured, inference.sampling.structured)
    job = await service.prepare(session, tenant, target, inference)
    render = CompletionRender(service.tokenizer, job, body.logprobs, echo=body.echo)
    return await respond(
        request, service, job, render, stream=body.stream, include_usage=body.include_usage
    )


@router.post("/v1/completions", responses=STREAMED_RESPONSES)
async def create_completion(
    request: Request,
    body: CompletionRequest,
    tenant: CurrentTenant,
    session: SessionDep,
    service: InferenceDep,
    runtime: AdapterRuntimeDep,
):
    """A text completion from the base model or one of the caller's adapters (``model``)."""
    target = await service.resolve(session, tenant, body.model, runtime, body.mix_parts())
    return await _complete(request, service, session, tenant, target, body)


@router.post("/v1/adapters/{name}/completions", responses=STREAMED_RESPONSES)
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
