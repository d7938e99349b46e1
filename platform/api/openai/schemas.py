"""Request bodies of the OpenAI-compatible inference routes, apart from the engine's types.

Only JSON *types* are checked here (a wrong type is a 422: strict models, so ``true`` is not
a ``top_p`` nor ``"5"`` an ``n``); ranges are checked once, by
``loramux.engine.SamplingParams``, whose message becomes a 400. Unknown fields are ignored,
as OpenAI's own clients send fields a server may not know (``metadata``...). ``user`` is
stored with the request's usage record (at most 256 characters, else a 400).
``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens`` and ``ignore_eos`` are extensions
(send them with the client's ``extra_body``; benchmarks use the last two for exact lengths).
A top-level ``priority`` (vLLM's clients send one) is the one unknown field refused (400):
a tenant's priority is the operator's to set, per tenant, never per request.
``timeout`` (seconds) is loramux's too: the request's deadline, which can only shorten the
tenant's default and the server's maximum (``services/deadlines.py``); so is
``speculative`` (default true): ``false`` opts the request out of the engine's speculative
decoding (``SPECULATIVE_DESCRIPTION``).
Structured outputs (``response_format``; chat's ``tools``, ``tool_choice`` and
``parallel_tool_calls``) are read by ``openai/structured.py`` and ``chat/tool_params.py``, whose 400s
name the field; completions take ``response_format`` too, as an extension.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from loramux.platform.api.openai.params import Prompts
from loramux.platform.services.adapter_mix import MAX_ABS_WEIGHT, MixPart

MAX_N = 16  # choices per request
SPECULATIVE_DESCRIPTION = (
    "loramux extension: whether the engine may speculate for this request when the server "
    "runs speculative decoding (LORAMUX_ENGINE_SPECULATIVE_METHOD). The output is the same "
    "either way (greedy: token for token; sampled: the same distribution) and only the "
    "emitted tokens are billed; false opts out, e.g. to measure the plain decoding speed. "
    "Requests with structured outputs never speculate."
)


ADAPTERS_DESCRIPTION = (
    "loramux extension: compose these adapters, each delta times its weight (PEFT's "
    "add_weighted_adapter with combination_type cat), with `model` naming the base model. "
    "Each `name` names an adapter as `model` would alone (`name`, `name@3`, "
    "`owner/name`...). Clients that can set only `model` send it as `a*0.7+b*0.3`."
)


class AdapterPart(BaseModel):
    """One adapter of a composition and its weight."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=400)
    weight: float = Field(ge=-MAX_ABS_WEIGHT, le=MAX_ABS_WEIGHT, allow_inf_nan=False)


class Composable(BaseModel):
    """A request whose ``model`` may be composed of adapters (``services/adapter_mix.py``)."""

    adapters: list[AdapterPart] | None = Field(
        default=None, min_length=1, max_length=64, description=ADAPTERS_DESCRIPTION
    )

    def mix_parts(self) -> list[MixPart] | None:
        if self.adapters is None:
            return None
        return [MixPart(part.name, part.weight) for part in self.adapters]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class SamplingFields(BaseModel):
    """The sampling fields every inference API here takes (the Responses API too)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    stream: bool = False
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    # the tenant's id for its end user: stored on the usage record and exported with it
    user: str | None = None
    # loramux: seconds this request may take in all; it can only shorten the tenant's
    # default and the server's maximum (services/deadlines.py).
    timeout: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    speculative: bool = Field(default=True, description=SPECULATIVE_DESCRIPTION)
    # read only to be refused (openai.params.check_no_priority), so not in /openapi.json
    priority: SkipJsonSchema[Any] = None


class _Sampling(SamplingFields):
    """What completions and chat share beyond that."""

    n: int = Field(default=1, ge=1, le=MAX_N)
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    # OpenAI's {"token id": bias}: read by openai.params.logit_bias_of (400s name the key)
    logit_bias: dict[str, float] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class AdapterCompletionRequest(_Sampling):
    """``POST /v1/adapters/{name}/completions``: a completion without ``model``.

    ``prompt`` is one prompt (text or token ids) or a batch of them; ``echo``, ``best_of``
    and ``suffix`` are read by ``openai/params.py``."""

    prompt: Prompts
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    # extension: openai/structured.py reads it as chat's
    response_format: dict[str, Any] | None = None


class CompletionRequest(AdapterCompletionRequest, Composable):
    """``POST /v1/completions``."""

    model: str


class ChatMessage(BaseModel):
    """One message; ``chat/tool_messages.py`` renders those of tool calls (an assistant's
    ``tool_calls``, a ``tool`` message's result for ``tool_call_id``)."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @property
    def text(self) -> str:
        """The content as text (the text parts of a list joined)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(str(part.get("text", "")) for part in content)
        return content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template wants it."""
        return {"role": self.role, "content": self.text}


class ChatCompletionRequest(_Sampling, Composable):
    """``POST /v1/chat/completions``."""

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
