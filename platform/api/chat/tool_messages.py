"""Chat messages as the chat template gets them, with tools: instructions, calls, results.

SmolLM2's template (ChatML), like many, knows nothing of tools: it renders each message's
role and text content. So tools are written into the messages themselves, in the format
the grammar enforces (``loramux.engine.structured.tool_calls``):

- With a tool-call spec, the tools and the call format (``format_instructions``) are added
  to the system message: appended to the first message when it is a system message, else
  as a new system message first (which replaces the template's default system prompt).
- An assistant message with ``tool_calls`` is its text content, then the calls as the same
  ``<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>`` block the model writes
  (arguments that are not JSON are kept as the string they are).
- ``tool`` messages (the results) become a user turn, each result in a
  ``<tool_response>{"name": ..., "content": ...}</tool_response>`` block (the function's
  name found by its ``tool_call_id`` among the earlier calls); consecutive results share
  one turn, so roles still alternate for templates that insist on it. Every template
  accepts the user role, which not all accept ``tool``.

A malformed ``tool_calls`` entry is a 400 naming it (``messages[2].tool_calls[0]``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from loramux.engine import TOOL_CALL_CLOSE as CLOSE
from loramux.engine import TOOL_CALL_OPEN as OPEN
from loramux.engine import ToolCalls, format_instructions
from loramux.platform.api.openai.schemas import ChatMessage
from loramux.platform.errors import Invalid

RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"


def template_messages(
    messages: Sequence[ChatMessage], tools: ToolCalls | None
) -> list[dict[str, Any]]:
    """The request's messages for the chat template (see the module docstring)."""
    names: dict[str, str] = {}  # tool_call_id -> function name, from the assistant's calls
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if message.role == "tool":
            result = _result(message, names)
            if out and out[-1].get("results"):  # the previous turn holds results too
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "results": True})
        elif message.role == "assistant" and message.tool_calls:
            out.append({"role": "assistant", "content": _calls(message, f"messages[{i}]", names)})
        else:
            out.append(message.for_template())
    for turn in out:
        turn.pop("results", None)
    if tools is not None:
        _instruct(out, format_instructions(tools))
    return out


def _instruct(messages: list[dict[str, Any]], instructions: str) -> None:
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        first["content"] = (
            f"{first['content']}\n\n{instructions}" if first["content"] else instructions
        )
    else:
        messages.insert(0, {"role": "system", "content": instructions})


def _calls(message: ChatMessage, where: str, names: dict[str, str]) -> str:
    """The assistant's text, then its calls as the block the model writes."""
    calls = []
    for j, call in enumerate(message.tool_calls or []):
        function = call.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not name:
            raise Invalid(
                f"{where}.tool_calls[{j}].function.name is required (the function called)",
                code="invalid_messages",
            )
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            with contextlib.suppress(ValueError):  # not JSON: shown as the string it is
                arguments = json.loads(arguments)
        calls.append({"name": name, "arguments": arguments})
        if isinstance(call.get("id"), str):
            names[call["id"]] = name
    block = OPEN + json.dumps(calls, ensure_ascii=False) + CLOSE
    text = message.text.strip()
    return f"{text}\n{block}" if text else block


def _result(message: ChatMessage, names: dict[str, str]) -> str:
    result: dict[str, Any] = {}
    name = message.name or names.get(message.tool_call_id or "")
    if name:
        result["name"] = name
    result["content"] = message.text
    return RESPONSE_OPEN + json.dumps(result, ensure_ascii=False) + RESPONSE_CLOSE
