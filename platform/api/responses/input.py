"""A Responses API request read into chat messages, refusing what this server does not do.

``instructions`` becomes a system message before the input; a string ``input`` is one user
message; a message's content parts of type ``input_text`` / ``output_text`` (or ``text``)
are joined. The ``developer`` role is rendered as ``system`` (the chat template knows no
other). Every refusal is a 400 naming the field (``responses/schemas.py`` lists them).
``text.format`` is read by ``openai.structured.text_format_spec``.
"""

from __future__ import annotations

from typing import Any

from loramux.platform.api.responses.schemas import AdapterResponseRequest, InputMessage
from loramux.platform.errors import Invalid

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
NO_TOOL = frozenset({"none", "auto"})  # tool choices that need no tool


def _unsupported(message: str) -> Invalid:
    return Invalid(message, code="invalid_request")


def check_supported(body: AdapterResponseRequest) -> None:
    """400 for the features this server does not offer on /v1/responses."""
    if body.tools:
        raise _unsupported(
            "tools are not supported on /v1/responses: this server answers with text only"
        )
    choice = body.tool_choice
    if choice is not None and not (isinstance(choice, str) and choice in NO_TOOL):
        raise _unsupported(
            f"tool_choice {choice!r} is not supported: there are no tools on "
            "/v1/responses (only 'none' or 'auto' are accepted)"
        )
    if body.previous_response_id is not None or body.conversation is not None:
        field = "previous_response_id" if body.previous_response_id is not None else "conversation"
        raise _unsupported(
            f"{field} is not supported: responses are not stored, so there is nothing to "
            "continue. Send the whole conversation as input."
        )
    if body.background:
        raise _unsupported("background is not supported: send the request and wait, or stream")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise Invalid(
            f"max_output_tokens must be >= 1, got {body.max_output_tokens}",
            code="invalid_sampling_parameters",
        )


def messages_of(body: AdapterResponseRequest) -> list[dict[str, Any]]:
    """The request as chat-template messages: instructions first, then the input."""
    messages = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        messages.extend(_message(item, f"input[{i}]") for i, item in enumerate(body.input))
    if not messages:
        raise Invalid(
            "input is empty: send a string or at least one message", code="invalid_prompt"
        )
    return messages


def _message(item: InputMessage, where: str) -> dict[str, Any]:
    if item.type not in (None, "message"):
        raise _unsupported(f"{where} of type {item.type!r} is not supported: messages only")
    role = ROLES.get(item.role or "")
    if role is None:
        raise Invalid(
            f"{where}.role must be one of {sorted(ROLES)}, got {item.role!r}",
            code="invalid_messages",
        )
    content = item.content
    if isinstance(content, list):
        content = "".join(_text(part, f"{where}.content[{j}]") for j, part in enumerate(content))
    return {"role": role, "content": content or ""}


def _text(part: dict[str, Any], where: str) -> str:
    kind = part.get("type")
    text = part.get("text")
    if kind not in TEXT_PARTS or not isinstance(text, str):
        raise _unsupported(
            f"{where} of type {kind!r} is not supported: content parts must be input_text "
            "or output_text with a text"
        )
    return text
