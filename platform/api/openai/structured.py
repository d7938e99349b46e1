"""OpenAI's structured-output fields read into the engine's specs, with the 400s of bad shapes.

- ``response_format`` (chat; completions too, as an extension): ``{"type": "text"}`` (the
  default: no constraint), ``{"type": "json_object"}`` -> :class:`JsonObject`, or
  ``{"type": "json_schema", "json_schema": {"name", "description"?, "schema", "strict"?}}``
  -> :class:`JsonSchema`.
- The Responses API's ``text.format``: the same kinds, with the schema's fields beside
  ``type`` (``{"type": "json_schema", "name", "schema", "strict"?}``).

``strict`` defaults to false, as in OpenAI: a schema keyword or ``format`` the grammar
cannot enforce is then ignored (best effort) and the rest enforced; with ``strict: true``
it is a 400. ``name`` is required and must match OpenAI's pattern (1-64 letters, digits,
``_`` or ``-``); it names the schema only (nothing is generated from it). A schema is a JSON
object; ``schema`` is required (a schema-less ``json_schema`` would be ``json_object``).

Every bad value is a 400 naming the field, a number in a schema too: past 2^53 - 1 in
magnitude the engine's spec refuses it (the grammar compiler reads numbers as 64-bit
floats), with its JSON pointer (``response_format.json_schema.schema: /properties/n/minimum
is ...``). :func:`check_structured` compiles the spec
without a tokenizer (``check_spec``, about a millisecond) so that a schema which cannot be
enforced is refused before admission; the engine's own compile stays the final word (its
refusal is a 400 as well).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from loramux.engine import (
    GrammarError,
    JsonObject,
    JsonSchema,
    StructuredSpec,
    check_spec,
)
from loramux.platform.errors import Invalid

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for schema and function names
FORMAT_KINDS = ("text", "json_object", "json_schema")


def invalid(message: str) -> Invalid:
    """The 400 of a structured-output field (``code`` as for other unservable requests)."""
    return Invalid(message, code="invalid_request")


def response_format_spec(value: Any, where: str = "response_format") -> StructuredSpec | None:
    """The spec a chat or completions ``response_format`` asks for (None: plain text)."""
    if value is None:
        return None
    kind = _kind(value, where)
    if kind == "json_schema":
        body = value.get("json_schema")
        if not isinstance(body, Mapping):
            raise invalid(
                f"{where}.json_schema is required with type json_schema: an object with "
                f"name and schema, got {shown(body)}"
            )
        return json_schema_spec(body, f"{where}.json_schema")
    return JsonObject() if kind == "json_object" else None


def text_format_spec(text: Any) -> StructuredSpec | None:
    """The spec of a Responses API ``text`` field's ``format`` (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, Mapping):
        raise invalid(f"text must be an object, got {shown(text)}")
    value = text.get("format")
    if value is None:
        return None
    kind = _kind(value, "text.format")
    if kind == "json_schema":
        return json_schema_spec(value, "text.format")
    return JsonObject() if kind == "json_object" else None


def json_schema_spec(body: Mapping[str, Any], where: str) -> JsonSchema:
    """A ``json_schema`` object (``name``, ``schema``, ``strict``, ``description``)."""
    name = body.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise invalid(f"{where}.name must be 1-64 letters, digits, '_' or '-', got {shown(name)}")
    description = body.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid(f"{where}.description must be a string, got {shown(description)}")
    schema = body.get("schema")
    if not isinstance(schema, Mapping):
        raise invalid(f"{where}.schema is required: a JSON schema object, got {shown(schema)}")
    strict = body.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(f"{where}.strict must be true or false, got {shown(strict)}")
    try:
        return JsonSchema(dict(schema), strict=bool(strict))
    except GrammarError as exc:  # not JSON, over the size limit, or a number out of range
        raise invalid(f"{where}.schema: {exc}") from None


def check_structured(spec: StructuredSpec | None, where: str | None = None) -> None:
    """400 naming the problem when ``spec`` cannot be compiled (run it off the event loop:
    a large schema takes a while). ``where``: the field the spec came in, when it is not
    chat's ``response_format`` (the Responses API's ``text.format``)."""
    if spec is None:
        return
    name = f"{where}.schema" if where and isinstance(spec, JsonSchema) else where
    try:
        check_spec(spec, name)
    except ImportError:
        return  # no grammar library in this process (remote engines): the engine checks
    except GrammarError as exc:
        raise invalid(str(exc)) from None


def _kind(value: Any, where: str) -> str:
    if not isinstance(value, Mapping):
        raise invalid(f"{where} must be an object with a type, got {shown(value)}")
    kind = value.get("type")
    if kind not in FORMAT_KINDS:
        raise invalid(f"{where}.type must be one of {', '.join(FORMAT_KINDS)}; got {shown(kind)}")
    return kind


def shown(value: Any, limit: int = 80) -> str:
    """A value as an error message quotes it (cut short: a body may be huge)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
