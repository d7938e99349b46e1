"""What a request asks its output to be: the structured-output specs.

Four kinds, each a small immutable value checked on construction (a malformed one raises
:class:`GrammarError` naming the field):

* :class:`JsonObject` — any JSON object (OpenAI ``response_format: json_object``).
* :class:`JsonSchema` — a JSON value valid against ``schema`` (``response_format:
  json_schema``). ``strict=True``: a keyword or ``format`` the grammar cannot enforce is an
  error when it compiles; ``strict=False``: such keywords are ignored, the rest enforced
  (OpenAI's non-strict mode is best effort too). Properties come in the schema's order.
* :class:`Regex` — text the whole of which matches ``pattern`` (Rust ``regex`` syntax;
  vLLM's ``regex`` structured output, not in OpenAI's API).
* :class:`ToolCalls` — chat ``tools`` with ``tool_choice`` ``auto``, ``required`` or a named
  function; the output format is :mod:`loramux.engine.structured.tool_calls`'. ``tool_choice:
  none`` (or no tools) is no spec at all.

``spec_to_json`` / ``spec_from_json`` carry a spec over the engine wire; ``spec_key`` is the
canonical JSON the compiler caches by. Key order is kept in it, not sorted: a schema's
property order is the order the output must follow, so two orders are two grammars.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from loramux.engine.structured.errors import GrammarError

MAX_SPEC_CHARS = 256_000
"""The longest spec (its canonical JSON) a request may bring: the grammar's size and its
compile time grow with it, and one request must not stall the engine's compiles."""

MAX_SCHEMA_NUMBER = 2**53 - 1
"""The largest magnitude of a number anywhere in a schema (I-JSON's interoperable integers,
RFC 7493). llguidance reads a schema's numbers as 64-bit floats: past 2**53 it enforces a
bound or a ``const`` other than the one written, past 64 bits it raises a plain ValueError,
and an integer ``const`` or ``enum`` near -2**63 crashes the process."""

# OpenAI's rule for function names.
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _canonical(value: Any, what: str) -> str:
    """``value`` as compact JSON, key order kept; refused if it is not JSON or too long."""
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise GrammarError(f"{what} is not JSON: {exc}") from None
    if len(text) > MAX_SPEC_CHARS:
        raise GrammarError(f"{what} is {len(text)} characters long; at most {MAX_SPEC_CHARS}")
    return text


def _schema_copy(value: Any, what: str) -> dict[str, Any]:
    """A private copy of a JSON schema object (the caller's dict may change later), its
    numbers checked (``MAX_SCHEMA_NUMBER``)."""
    if not isinstance(value, Mapping):
        raise GrammarError(f"{what} must be a JSON schema object, got {type(value).__name__}")
    copy = json.loads(_canonical(dict(value), what))
    _check_numbers(copy)
    return copy


def _check_numbers(schema: dict[str, Any]) -> None:
    """GrammarError at the first number in ``schema`` beyond ``MAX_SCHEMA_NUMBER``, named by
    its JSON pointer (RFC 6901) so that the caller can prefix the field the schema came in."""
    stack: list[tuple[str, Any]] = [("", schema)]  # depth first, in document order
    while stack:
        pointer, value = stack.pop()
        if isinstance(value, dict):
            items = [(_pointer_step(key), item) for key, item in value.items()]
        elif isinstance(value, list):
            items = [(str(index), item) for index, item in enumerate(value)]
        else:
            if _beyond_range(value):
                raise GrammarError(
                    f"{pointer} is {_shown_number(value)}; every number in a schema must be "
                    f"within -{MAX_SCHEMA_NUMBER} to {MAX_SCHEMA_NUMBER} (2^53 - 1: the grammar "
                    "compiler reads numbers as 64-bit floats, exact up to there)"
                )
            continue
        stack.extend((f"{pointer}/{step}", item) for step, item in reversed(items))


def _pointer_step(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _beyond_range(value: Any) -> bool:
    # bool is an int in Python, and not a number in JSON.
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and abs(value) > MAX_SCHEMA_NUMBER


def _shown_number(value: int | float, limit: int = 40) -> str:
    text = repr(value)  # an int has at most 4300 digits here: json.dumps refused longer ones
    digits = len(text.lstrip("-"))
    return text if len(text) <= limit else f"{text[:12]}... ({digits} digits)"


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise GrammarError(f"{name} must be a bool, got {value!r}")
    return value


@dataclass(frozen=True)
class JsonObject:
    """Any JSON object."""


@dataclass(frozen=True)
class JsonSchema:
    """A JSON value valid against ``schema``."""

    # A dict is unhashable: left out of the hash (equal specs still hash equal).
    schema: dict[str, Any] = field(hash=False)
    strict: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "schema", _schema_copy(self.schema, "json_schema.schema"))
        _flag("json_schema.strict", self.strict)


@dataclass(frozen=True)
class Regex:
    """Text the whole of which matches ``pattern``."""

    pattern: str

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern:
            raise GrammarError(f"regex must be a non-empty string, got {self.pattern!r}")
        _canonical(self.pattern, "regex")


@dataclass(frozen=True)
class Tool:
    """One function the model may call: its name and its parameters' JSON schema."""

    name: str
    parameters: dict[str, Any] = field(default_factory=lambda: dict(_NO_PARAMETERS), hash=False)
    strict: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _TOOL_NAME.fullmatch(self.name):
            raise GrammarError(
                f"tool name must be 1-64 letters, digits, '_' or '-', got {self.name!r}"
            )
        what = f"tool {self.name!r} parameters"
        object.__setattr__(self, "parameters", _schema_copy(self.parameters, what))
        _flag(f"tool {self.name!r} strict", self.strict)


class ToolChoice(enum.Enum):
    AUTO = "auto"  # text, or tool calls
    REQUIRED = "required"  # one or more tool calls, of any of the tools
    NAMED = "named"  # exactly one call, of ``ToolCalls.function``


@dataclass(frozen=True)
class ToolCalls:
    """Chat tools: which functions exist, whether and which the model must call.

    ``parallel`` (OpenAI's ``parallel_tool_calls``): several calls in one answer; otherwise
    at most one. A named choice is always exactly one call of that function.
    """

    tools: tuple[Tool, ...]
    choice: ToolChoice = ToolChoice.AUTO
    function: str | None = None
    parallel: bool = True

    def __post_init__(self) -> None:
        tools = tuple(self.tools) if isinstance(self.tools, list | tuple) else None
        if not tools or not all(isinstance(t, Tool) for t in tools):
            raise GrammarError("tools must be a non-empty list of Tool")
        names = [t.name for t in tools]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise GrammarError(f"tool names must be unique; repeated: {', '.join(twice)}")
        object.__setattr__(self, "tools", tools)
        if not isinstance(self.choice, ToolChoice):
            raise GrammarError(f"tool choice must be a ToolChoice, got {self.choice!r}")
        if self.choice is ToolChoice.NAMED and self.function not in names:
            raise GrammarError(
                f"tool_choice names function {self.function!r}, which is not among the "
                f"tools ({', '.join(names)})"
            )
        if self.choice is not ToolChoice.NAMED and self.function is not None:
            raise GrammarError(f"function is only for a named tool choice, not {self.choice}")
        _flag("parallel_tool_calls", self.parallel)


StructuredSpec = JsonObject | JsonSchema | Regex | ToolCalls
"""What one request's output must be (None on a request: unconstrained)."""


def spec_to_json(spec: StructuredSpec) -> dict[str, Any]:
    """The spec as a JSON object, which ``spec_from_json`` reads back."""
    match spec:
        case JsonObject():
            return {"type": "json_object"}
        case JsonSchema(schema=schema, strict=strict):
            return {"type": "json_schema", "schema": schema, "strict": strict}
        case Regex(pattern=pattern):
            return {"type": "regex", "pattern": pattern}
        case ToolCalls():
            return {
                "type": "tool_calls",
                "tools": [
                    {"name": t.name, "parameters": t.parameters, "strict": t.strict}
                    for t in spec.tools
                ],
                "choice": spec.choice.value,
                "function": spec.function,
                "parallel": spec.parallel,
            }
    raise TypeError(f"not a structured-output spec: {spec!r}")


def spec_from_json(raw: Any) -> StructuredSpec:
    """A spec from ``spec_to_json``'s form; a malformed one raises GrammarError."""
    if not isinstance(raw, Mapping):
        raise GrammarError(f"a structured-output spec must be a JSON object, got {raw!r}")
    try:
        kind = raw["type"]
        if kind == "json_object":
            return JsonObject()
        if kind == "json_schema":
            return JsonSchema(raw["schema"], strict=raw.get("strict", True))
        if kind == "regex":
            return Regex(raw["pattern"])
        if kind == "tool_calls":
            tools = tuple(
                Tool(t["name"], t.get("parameters", _NO_PARAMETERS), strict=t.get("strict", False))
                for t in raw["tools"]
            )
            choice = raw.get("choice", "auto")
            if choice not in {c.value for c in ToolChoice}:
                allowed = ", ".join(c.value for c in ToolChoice)
                raise GrammarError(f"tool choice must be one of {allowed}, got {choice!r}")
            choice = ToolChoice(choice)
            return ToolCalls(tools, choice, raw.get("function"), raw.get("parallel", True))
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, GrammarError):
            raise
        raise GrammarError(f"malformed structured-output spec: {exc!r}") from None
    raise GrammarError(f"unknown structured-output type {raw.get('type')!r}")


def spec_key(spec: StructuredSpec) -> str:
    """The spec's canonical JSON: equal specs, equal keys; property order kept."""
    return _canonical(spec_to_json(spec), "structured-output spec")
