"""OpenAI's chat completions: ``POST /v1/chat/completions``.

The messages are rendered with the base model's chat template and run as a job of the
inference service (``openai/respond.py`` answers with JSON or server-sent chunks).

Structured outputs: ``response_format`` and ``tools`` become the request's grammar spec
(``openai/structured.py``, ``chat/tool_params.py``), checked before admission; a request with tools
is told of them in its system message (``chat/tool_messages.py``) and answered with ``tool_calls``
(``chat/tool_render.py``). One request has one spec: ``response_format`` other than text with
tools that may be called is a 400.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from loramux.engine import StructuredSpec, ToolCalls
from loramux.platform.api.chat.tool_messages import template_messages
from loramux.platform.api.chat.tool_params import check_tools, tool_spec
from loramux.platform.api.chat.tool_render import ToolChatRender
from loramux.platform.api.deps import AdapterRuntimeDep, CurrentTenant, SessionDep
from loramux.platform.api.openai.params import check_no_priority
from loramux.platform.api.openai.render import ChatRender
from loramux.platform.api.openai.requests import chat_request
from loramux.platform.api.openai.respond import STREAMED_RESPONSES, InferenceDep, respond
from loramux.platform.api.openai.schemas import ChatCompletionRequest
from loramux.platform.api.openai.structured import check_structured, invalid, response_format_spec

router = APIRouter(tags=["inference"])


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


@router.post("/v1/chat/completions", responses=STREAMED_RESPONSES)
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
    target = await service.resolve(session, tenant, body.model, runtime, body.mix_parts())
    structured, tools = await _chat_specs(body)
    inference = chat_request(body, template_messages(body.messages, tools), structured)
    job = await service.prepare(session, tenant, target, inference)
    kind = ChatRender if tools is None else ToolChatRender
    render = kind(service.tokenizer, job, inference.sampling.logprobs)
    return await respond(
        request, service, job, render, stream=body.stream, include_usage=body.include_usage
    )
