"""Chat ``tools``, ``tool_choice`` and ``parallel_tool_calls`` read into a ToolCalls spec.

- ``tools``: a list of ``{"type": "function", "function": {"name", "description"?,
  "parameters"?, "strict"?}}``. ``parameters`` is the arguments' JSON schema (left out: a
  function without parameters); ``strict`` (default false, as OpenAI's) makes a keyword
  the grammar cannot enforce a 400 rather than ignored. Other tool types are refused.
- ``tool_choice``: ``"none"`` (no spec: the model answers in text and is not told of the
  tools), ``"auto"`` (the default with tools: text, or text then calls), ``"required"``
  (one or more calls) or ``{"type": "function", "function": {"name": ...}}`` (exactly one
  call of it). ``required`` or a named function without tools is a 400, as is a name that
  is not among the tools.
- ``parallel_tool_calls`` (default true): several calls in one answer; false, at most one.

Every bad value is a 400 naming the field (``tools[2].function.name``; a number out of the
grammar's range, ``tools[0].function.parameters: /properties/n/maximum is ...``). A tool whose
parameters cannot be compiled is a 400 naming the tool (:func:`check_tools`, off the
event loop).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loramux.engine import GrammarError, Tool, ToolCalls, ToolChoice, check_spec
from loramux.platform.api.openai.structured import NAME, invalid, shown

CHOICES = ("none", "auto", "required")


def tool_spec(tools: Any, tool_choice: Any, parallel: Any) -> ToolCalls | None:
    """The request's tool-call spec, or None when it asks for no tool call."""
    choice, function = _choice(tool_choice)
    if not tools:
        if choice in (ToolChoice.REQUIRED, ToolChoice.NAMED):
            raise invalid(
                f"tool_choice {shown(tool_choice)} needs tools: send the functions in "
                "tools, or tool_choice 'none' or 'auto'"
            )
        return None
    if not isinstance(tools, list):
        raise invalid(f"tools must be a list of function tools, got {shown(tools)}")
    read = tuple(_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    if choice is None:  # tool_choice "none": the tools are known, none may be called
        return None
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid(f"parallel_tool_calls must be true or false, got {shown(parallel)}")
    names = [t.name for t in read]
    if choice is ToolChoice.NAMED and function not in names:
        raise invalid(
            f"tool_choice names function {function!r}, which is not among the tools "
            f"({', '.join(names)})"
        )
    try:
        return ToolCalls(read, choice, function, True if parallel is None else parallel)
    except GrammarError as exc:  # e.g. two tools of one name
        raise invalid(f"tools: {exc}") from None


def check_tools(spec: ToolCalls) -> None:
    """400 when the tools' grammar cannot be compiled, naming the tool at fault (the whole
    grammar's error would not say which one): each tool is tried alone only then."""
    try:
        check_spec(spec)
    except ImportError:
        return  # no grammar library in this process (remote engines): the engine checks
    except GrammarError as whole:
        for i, tool in enumerate(spec.tools):
            try:
                check_spec(ToolCalls((tool,), ToolChoice.REQUIRED))
            except GrammarError as exc:
                raise invalid(f"tools[{i}] (function {tool.name!r}): {exc}") from None
        raise invalid(str(whole)) from None


def _choice(value: Any) -> tuple[ToolChoice | None, str | None]:
    """``tool_choice`` as (choice, function name); choice None for ``"none"``."""
    if value is None or value == "auto":
        return ToolChoice.AUTO, None
    if value == "none":
        return None, None
    if value == "required":
        return ToolChoice.REQUIRED, None
    if isinstance(value, Mapping) and value.get("type") == "function":
        function = value.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not name:
            raise invalid(
                f"tool_choice.function.name must name one of the tools, got {shown(name)}"
            )
        return ToolChoice.NAMED, name
    raise invalid(
        f"tool_choice must be one of {', '.join(CHOICES)} or "
        f'{{"type": "function", "function": {{"name": ...}}}}; got {shown(value)}'
    )


def _tool(value: Any, where: str) -> Tool:
    if not isinstance(value, Mapping):
        raise invalid(f"{where} must be an object, got {shown(value)}")
    if value.get("type") != "function":
        raise invalid(
            f"{where}.type must be 'function' (the only tools served), got "
            f"{shown(value.get('type'))}"
        )
    function = value.get("function")
    if not isinstance(function, Mapping):
        raise invalid(f"{where}.function is required: an object with a name")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise invalid(
            f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {shown(name)}"
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid(f"{where}.function.description must be a string")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(f"{where}.function.strict must be true or false, got {shown(strict)}")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise invalid(
            f"{where}.function.parameters must be a JSON schema object, got {shown(parameters)}"
        )
    try:
        if parameters is None:
            return Tool(name, strict=bool(strict))
        return Tool(name, dict(parameters), strict=bool(strict))
    except GrammarError as exc:  # not JSON, over the size limit, or a number out of range
        raise invalid(f"{where}.function.parameters: {exc}") from None
