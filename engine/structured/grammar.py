"""A spec as an llguidance grammar, and the check that it compiles (no tokenizer needed).

JSON whitespace is bounded: at each place JSON allows whitespace, at most one line break
and 16 spaces or tabs (llguidance's default allows any amount, and a small model stuck on
newlines would fill max_tokens with them). ``json.dumps`` output, compact or indented a few
levels, still passes. The whitespace and the strictness are set as overrides, so a schema's
own ``x-guidance`` cannot loosen them.
"""

from __future__ import annotations

import json
import re
from typing import Any

from loramux.engine.structured.errors import GrammarError
from loramux.engine.structured.spec import (
    JsonObject,
    JsonSchema,
    Regex,
    StructuredSpec,
    ToolCalls,
    ToolChoice,
)
from loramux.engine.structured.tool_calls import CLOSE, OPEN, calls_schema

# A line of the grammar source ("12 | start: ...") and a position in it ("at 1(8): ").
_SOURCE_EXCERPT = re.compile(r"\d+ \|")
_POSITION = re.compile(r"^at \d+\(\d+\): ")

JSON_WHITESPACE = r"[\x20\x09]{1,16}|\x0D?\x0A[\x20\x09]{0,16}"


def _matcher_class():
    import llguidance  # on first use, so that specs and parsing work without the library

    return llguidance.LLMatcher


def _options(strict: bool) -> dict[str, Any]:
    # lenient: keywords and formats llguidance does not implement are ignored, not errors.
    return {"whitespace_pattern": JSON_WHITESPACE, "lenient": not strict}


def _json_grammar(schema: dict[str, Any], strict: bool) -> str:
    return _matcher_class().grammar_from_json_schema(schema, overrides=_options(strict))


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a valid Lark string literal


def _tool_grammar(spec: ToolCalls) -> str:
    strict = all(t.strict for t in spec.tools)
    schema = {"x-guidance": _options(strict), **calls_schema(spec)}
    block = f"{_lark_string(OPEN)} %json {json.dumps(schema)} {_lark_string(CLOSE)}"
    if spec.choice is not ToolChoice.AUTO:
        return _matcher_class().grammar_from_lark(f"start: {block}\n")
    # TEXT: anything without the opening tag. head: the shortest text that ends with it
    # (lazy), after which only a valid block may follow. The tag has no regex
    # metacharacters, so it stands in the regexes as it is.
    tag = OPEN
    lark = "\n".join(
        [
            "start: TEXT | head body",
            f"head[lazy]: /(?s:.*){tag}/",
            f"body: %json {json.dumps(schema)} {_lark_string(CLOSE)}",
            f"TEXT: /(?s:.*)/ & ~/(?s:.*){tag}(?s:.*)/",
        ]
    )
    return _matcher_class().grammar_from_lark(lark + "\n")


def grammar_for(spec: StructuredSpec) -> str:
    """``spec``'s llguidance grammar (checked only when it compiles)."""
    match spec:
        case JsonObject():
            return _json_grammar({"type": "object"}, strict=True)
        case JsonSchema(schema=schema, strict=strict):
            return _json_grammar(schema, strict)
        case Regex(pattern=pattern):
            return _matcher_class().grammar_from_regex(pattern)
        case ToolCalls():
            return _tool_grammar(spec)
    raise TypeError(f"not a structured-output spec: {spec!r}")


def describe(spec: StructuredSpec) -> str:
    """How an error names the spec: the request field it came from."""
    match spec:
        case JsonObject():
            return "response_format json_object"
        case JsonSchema():
            return "response_format json_schema"
        case Regex():
            return "regex"
        case ToolCalls():
            return "tools"
    raise TypeError(f"not a structured-output spec: {spec!r}")


def check_spec(spec: StructuredSpec, name: str | None = None) -> None:
    """Raise GrammarError if ``spec`` does not compile: the API can answer 400 before the
    request reaches an engine (the engine's compile says the same). ``name``: the request
    field the error names (``describe(spec)`` by default; the Responses API's is
    ``text.format``)."""
    if isinstance(spec, ToolCalls):
        check_tool_parameters(spec)
    _raise_if_invalid(grammar_for(spec), name or describe(spec))


def check_tool_parameters(spec: ToolCalls) -> None:
    """Raise GrammarError naming the first strict tool whose parameters do not compile
    (the combined grammar's error would not say which tool)."""
    for tool in spec.tools:
        if tool.strict:
            grammar = _json_grammar(tool.parameters, strict=True)
            _raise_if_invalid(grammar, f"tool {tool.name!r} parameters")


def _raise_if_invalid(grammar: str, what: str) -> None:
    message = _matcher_class().validate_grammar(grammar)
    if message:
        raise GrammarError(f"{what} cannot be enforced: {first_lines(message)}")


def first_lines(message: str, limit: int = 400) -> str:
    """An llguidance error on one line, without what only describes our generated grammar:
    the parser state it dumps, the grammar source excerpt and the position in it."""
    kept = []
    for line in message.splitlines():
        stripped = line.strip()
        if stripped.startswith("<state>") or _SOURCE_EXCERPT.match(stripped):
            break
        if stripped:
            kept.append(stripped)
    text = _POSITION.sub("", " ".join(kept), count=1)
    return text if len(text) <= limit else text[: limit - 3] + "..."
