"""Each OpenAI API's body read into the one typed request the inference service takes
(``services/inference_request.InferenceRequest``): its prompts or messages, its choices,
its sampling fields and the policies that decide them (``best_of`` ranks by
log-probabilities; ``echo`` scores the prompt; chat's ``max_completion_tokens`` over
``max_tokens``). Field-level checks are ``params``'; chat's and the Responses API's
structured-output spec comes in already read and checked (``structured``;
``chat/tool_params.py``).
"""

from __future__ import annotations

from typing import Any

from loramux.engine import StructuredSpec
from loramux.platform.api.openai.params import (
    check_best_of,
    check_suffix,
    completion_max_tokens,
    prompts_of,
    sampling_of,
)
from loramux.platform.api.openai.structured import response_format_spec
from loramux.platform.services.inference_job import new_request_id
from loramux.platform.services.inference_request import InferenceRequest, Sampling

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's, for the completions API

# The Responses API's sampling fields (it has no stop, logit_bias or logprobs).
_RESPONSE_SAMPLING = (
    "temperature",
    "top_p",
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "ignore_eos",
    "speculative",
)


def completion_request(body) -> InferenceRequest:
    """A completions body (``CompletionRequest`` or ``AdapterCompletionRequest``), its
    ``response_format`` (an extension) read but not compiled yet (the route checks it off
    the event loop)."""
    check_suffix(body.suffix)
    check_best_of(body.best_of, body.n, stream=body.stream)
    structured = response_format_spec(body.response_format)
    max_tokens = completion_max_tokens(body.max_tokens, echo=body.echo)
    ranked = body.best_of is not None and body.best_of > body.n
    # best_of ranks candidates by their tokens' log-probabilities: asked of the engine
    # even when the client wants none shown.
    logprobs = 0 if ranked and body.logprobs is None else body.logprobs
    prompt_logprobs = None
    if body.echo and (body.logprobs is not None or max_tokens == 0):
        # max_tokens 0 scores the prompt: the engine computes its logprobs either way.
        prompt_logprobs = body.logprobs or 0
    return InferenceRequest(
        request_id=new_request_id("cmpl"),
        sampling=sampling_of(
            body,
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured=structured,
        ),
        prompts=tuple(prompts_of(body.prompt)),
        n=body.n,
        best_of=body.best_of,
        default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS,
        timeout=body.timeout,
        end_user=body.user,
    )


def _chat_top_logprobs(body) -> int | None:
    """Top log-probabilities per token a chat body asks for (None: no logprobs)."""
    return (body.top_logprobs or 0) if body.logprobs else None


def chat_request(
    body, messages: list[dict[str, Any]], structured: StructuredSpec | None
) -> InferenceRequest:
    """A chat body, its ``messages`` as the template will render them (tools told)."""
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    return InferenceRequest(
        request_id=new_request_id("chatcmpl"),
        sampling=sampling_of(
            body, max_tokens=max_tokens, logprobs=_chat_top_logprobs(body), structured=structured
        ),
        messages=tuple(messages),
        n=body.n,
        timeout=body.timeout,
        end_user=body.user,
    )


def response_request(
    body, messages: list[dict[str, Any]], structured: StructuredSpec | None
) -> InferenceRequest:
    """A Responses API body (one choice), its input as chat ``messages``."""
    fields = {name: getattr(body, name) for name in _RESPONSE_SAMPLING}
    return InferenceRequest(
        request_id=new_request_id("resp", separator="_"),
        sampling=Sampling(**fields, max_tokens=body.max_output_tokens, structured=structured),
        messages=tuple(messages),
        n=1,
        timeout=body.timeout,
        end_user=body.user,
    )
