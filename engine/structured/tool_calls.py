"""The tool-call output format: what the model writes to call tools, and how it is read.

One answer holds at most one block, a JSON array of calls between two tags, last::

    <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>

* ``tool_choice: required`` — the whole answer is the block: one or more calls (exactly one
  without ``parallel_tool_calls``), each ``name`` one of the tools and its ``arguments``
  valid against that tool's parameter schema.
* a named function — the whole answer is the block with exactly one call of it.
* ``auto`` — free text with no ``<tool_call>`` in it, *or* such text followed by the block.
  The grammar lets the model write anything until it writes the opening tag; from there the
  call is forced to be valid and nothing may follow the closing tag. So a text answer costs
  no constraint, and a call, once begun, is always parseable.

The tags are plain text for SmolLM2 (not special tokens), so the chat route must tell the
model the format: :func:`format_instructions` is the system-prompt text for it. The array
inside one tag (rather than a tag per call) keeps parallel calls one JSON value.
:func:`parse_tool_output` turns an answer into the text content and the calls, with each
call's arguments as JSON text (OpenAI's ``function.arguments``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from loramux.engine.structured.spec import Tool, ToolCalls, ToolChoice

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def _rebase_refs(schema: Any, prefix: str) -> Any:
    """``schema`` with every local ``$ref`` ("#/...") moved under ``prefix``: a tool's
    parameter schema refers to its own root, which here sits inside the call array."""
    if isinstance(schema, dict):
        out = {}
        for key, value in schema.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                out[key] = "#" + prefix + value[1:]
            else:
                out[key] = _rebase_refs(value, prefix)
        return out
    if isinstance(schema, list):
        return [_rebase_refs(item, prefix) for item in schema]
    return schema


def _call_schema(tool: Tool, where: str) -> dict[str, Any]:
    """One call of ``tool``; ``where`` is the JSON pointer of this schema in the array's."""
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.name},
            "arguments": _rebase_refs(tool.parameters, f"{where}/properties/arguments"),
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def calls_schema(spec: ToolCalls) -> dict[str, Any]:
    """The JSON schema of the array between the tags, for ``spec``'s tools and choice."""
    if spec.choice is ToolChoice.NAMED:
        tools = [t for t in spec.tools if t.name == spec.function]
    else:
        tools = list(spec.tools)
    if len(tools) == 1:
        items = _call_schema(tools[0], "/items")
    else:
        items = {"anyOf": [_call_schema(t, f"/items/anyOf/{i}") for i, t in enumerate(tools)]}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if spec.choice is ToolChoice.NAMED or not spec.parallel:
        schema["maxItems"] = 1
    return schema


def format_instructions(spec: ToolCalls) -> str:
    """The system-prompt text that tells the model the tools and this format."""
    tools = [
        {"name": t.name, "parameters": t.parameters}
        for t in spec.tools
        if spec.choice is not ToolChoice.NAMED or t.name == spec.function
    ]
    how = {
        ToolChoice.AUTO: "Answer in plain text, or call tools",
        ToolChoice.REQUIRED: "Call one or more of the tools",
        ToolChoice.NAMED: f"Call the function {spec.function}",
    }[spec.choice]
    many = " (one or more calls)" if spec.parallel and spec.choice is not ToolChoice.NAMED else ""
    return (
        f"You can use these tools:\n{json.dumps(tools, ensure_ascii=False)}\n"
        f"{how}. To call tools, end your answer with {OPEN}, a JSON list of calls{many} "
        f'each like {{"name": ..., "arguments": {{...}}}}, then {CLOSE}.'
    )


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # the arguments object as JSON text


@dataclass(frozen=True)
class ToolOutput:
    """An answer read as OpenAI's message: text content (None if empty) and tool calls."""

    content: str | None
    calls: tuple[ParsedToolCall, ...]


def parse_tool_output(text: str) -> ToolOutput:
    """The content before the block and the calls in it. An answer with no block, or one
    whose block does not parse (cut short by max_tokens or a stop string), is all content."""
    start = text.find(OPEN)
    if start < 0:
        return ToolOutput(text or None, ())
    end = text.find(CLOSE, start)
    if end < 0:
        return ToolOutput(text, ())
    try:
        items = json.loads(text[start + len(OPEN) : end])
    except ValueError:
        return ToolOutput(text, ())
    calls = []
    for item in items if isinstance(items, list) else [None]:
        if not (
            isinstance(item, dict)
            and isinstance(item.get("name"), str)
            and isinstance(item.get("arguments"), dict)
        ):
            return ToolOutput(text, ())
        arguments = json.dumps(item["arguments"], ensure_ascii=False)
        calls.append(ParsedToolCall(item["name"], arguments))
    return ToolOutput(text[:start].strip() or None, tuple(calls))
