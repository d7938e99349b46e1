"""Request bodies of the Responses API (``POST /v1/responses``, per adapter too): text in,
text or JSON out.

As in ``openai/schemas.py``, only JSON types are checked here (a wrong type is a 422);
``responses/input.py`` reads the values and refuses, with a 400 naming the field, what this
server does not do. Unknown fields are ignored. Of OpenAI's fields:

- served: ``input`` (a string, or a list of messages whose content is a string or
  ``input_text`` / ``output_text`` parts), ``instructions``, ``max_output_tokens``,
  ``temperature``, ``top_p``, ``stream``, ``user``, ``metadata`` (returned as sent),
  ``text.format`` (``text``, ``json_object``, or ``json_schema`` with ``name``, ``schema``
  and ``strict``: structured outputs as chat's ``response_format``, read by
  ``openai/structured.py``; returned as sent), and loramux's ``timeout``, ``speculative``
  and sampling extensions as in chat (``extra_body``);
- refused (400): ``tools`` (non-empty), a ``tool_choice`` that requires a tool,
  ``previous_response_id`` and ``conversation`` (no response is stored to continue),
  ``background: true``, input items other than messages and content parts other than
  text, and ``priority`` (a tenant's priority is the operator's to set, as in chat);
- accepted and ignored, as harmless: ``store`` (nothing is stored: the response says
  ``"store": false``, and there is no route to retrieve it), ``parallel_tool_calls``,
  ``truncation``, ``include``, ``reasoning``, ``service_tier``, ``prompt_cache_key``,
  ``safety_identifier``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from loramux.platform.api.openai.schemas import Composable, SamplingFields


class InputMessage(BaseModel):
    """One item of a list ``input``: a message (``type`` ``message`` or left out)."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: str | None = None
    role: str | None = None
    content: str | list[dict[str, Any]] | None = None


class AdapterResponseRequest(SamplingFields):
    """``POST /v1/adapters/{name}/responses``: a response without ``model``; the sampling
    fields (``stream``, ``temperature``, ``top_p``, ``user``, loramux's extensions) are
    chat's."""

    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    # read only to be refused (or ignored where harmless): see the module docstring
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    store: bool | None = None
    text: dict[str, Any] | None = None


class ResponseRequest(AdapterResponseRequest, Composable):
    """``POST /v1/responses``: ``model`` names the base model or one of the caller's
    adapters."""

    model: str
