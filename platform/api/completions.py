"""OpenAI-compatible inference: ``/v1/completions``, ``/v1/chat/completions`` and
``/v1/adapters/{name}/completions``.

The routes resolve the model, read OpenAI's fields (``openai_params``) and hand a job to
:class:`~loramux.platform.services.inference.InferenceService`; ``respond`` runs it and
answers with the JSON the render shapes (a response, or server-sent chunks ending in
``data: [DONE]``).

A completion's ``prompt`` may be a batch: each prompt gets ``n`` choices (the best ``n`` of
``best_of``), indexed prompt-major as OpenAI does (``index = prompt_index * n + i``, in a
stream's chunks too), and one usage record sums them all.

Structured outputs: ``response_format`` (chat, and completions as an extension) and chat's
``tools`` become the request's grammar spec (``structured_params``, ``tool_params``),
checked before admission; a chat request with tools is told of them in its system message
(``tool_messages``) and answered with ``tool_calls`` (``tool_render``). One request has one
spec: ``response_format`` other than text with tools that may be called is a 400.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from loramux.engine import StructuredSpec, ToolCalls
from loramux.platform.api.deps import AdapterRuntimeDep, CurrentTenant, SessionDep
from loramux.platform.api.openai_params import (
    check_best_of,
    check_no_priority,
    check_suffix,
    completion_max_tokens,
    logit_bias_of,
    prompts_of,
)
from loramux.platform.api.openai_render import ChatRender, CompletionRender
from loramux.platform.api.respond import InferenceDep, respond
from loramux.platform.api.schemas_openai import (
    AdapterCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
)
from loramux.platform.api.structured_params import (
    check_structured,
    invalid,
    response_format_spec,
)
from loramux.platform.api.tool_messages import template_messages
from loramux.platform.api.tool_params import check_tools, tool_spec
from loramux.platform.api.tool_render import ToolChatRender
from loramux.platform.db.models import Tenant
from loramux.platform.services.inference import InferenceService
from loramux.platform.services.inference_job import Target, new_request_id

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
    check_suffix(body.suffix)
    check_best_of(body.best_of, body.n, stream=body.stream)
    structured = response_format_spec(body.response_format)
    await run_in_threadpool(check_structured, structured)
    max_tokens = completion_max_tokens(body.max_tokens, echo=body.echo)
    ranked = body.best_of is not None and body.best_of > body.n
    # best_of ranks candidates by their tokens' log-probabilities: asked of the engine
    # even when the client wants none shown.
    logprobs = 0 if ranked and body.logprobs is None else body.logprobs
    prompt_logprobs = None
    if body.echo and (body.logprobs is not None or max_tokens == 0):
        # max_tokens 0 scores the prompt: the engine computes its logprobs either way.
        prompt_logprobs = body.logprobs or 0
    job = await service.prepare(
        session,
        tenant,
        target,
        request_id=new_request_id("cmpl"),
        prompts=prompts_of(body.prompt),
        n=body.n,
        best_of=body.best_of,
        sampling=sampling_of(
            body,
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured=structured,
        ),
        default_max_tokens=16,  # OpenAI's default for completions
        timeout=body.timeout,
        end_user=body.user,
    )
    render = CompletionRender(service.tokenizer, job, body.logprobs, echo=body.echo)
    return await respond(
        request, service, job, render, stream=body.stream, include_usage=body.include_usage
    )


async def _chat_specs(
    body: ChatCompletionRequest,
) -> tuple[StructuredSpec | None, ToolCalls | None]:
    """The chat request's grammar spec, checked (a 400 if it cannot compile), and its tool
    spec when tools may be called (then they are the spec)."""
    structured = response_format_spec(body.response_format)
    tools = tool_spec(body.tools, body.tool_choice, body.parallel_tool_calls)
    if tools is None:
        await run_in_threadpool(check_structured, structured)
        return structured, None
    if structured is not None:
        raise invalid(
            "response_format must be text when tools may be called: send tool_choice "
            "'none', or no response_format"
        )
    await run_in_threadpool(check_tools, tools)
    return tools, tools


def sampling_of(body, **extra: Any) -> dict[str, Any]:
    """The engine's sampling parameters among a request's fields, plus ``extra``."""
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
        "speculative",
        "seed",
    )
    given = {name: getattr(body, name) for name in fields}
    return {**given, "logit_bias": logit_bias_of(body.logit_bias), **extra}


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
    check_no_priority(body.priority)
    target = await service.resolve(session, tenant, body.model, runtime)
    structured, tools = await _chat_specs(body)
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    job = await service.prepare(
        session,
        tenant,
        target,
        request_id=new_request_id("chatcmpl"),
        messages=template_messages(body.messages, tools),
        n=body.n,
        sampling=sampling_of(
            body, max_tokens=max_tokens, logprobs=top_logprobs, structured=structured
        ),
        timeout=body.timeout,
        end_user=body.user,
    )
    kind = ChatRender if tools is None else ToolChatRender
    render = kind(service.tokenizer, job, top_logprobs)
    return await respond(
        request, service, job, render, stream=body.stream, include_usage=body.include_usage
    )
