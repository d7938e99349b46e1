"""OpenAI's structured-output fields read into the engine's specs (no server, no model):
``response_format`` and ``text.format``, ``tools`` / ``tool_choice`` /
``parallel_tool_calls``, their 400s naming the field, and the early compile check."""

from __future__ import annotations

import pytest

from loramux.engine.structured import JsonObject, JsonSchema, Tool, ToolCalls, ToolChoice
from loramux.platform.api.chat.tool_params import check_tools, tool_spec
from loramux.platform.api.openai.structured import (
    check_structured,
    response_format_spec,
    text_format_spec,
)
from loramux.platform.errors import Invalid

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _refused(call, *args) -> str:
    with pytest.raises(Invalid) as refused:
        call(*args)
    assert refused.value.code == "invalid_request"
    return str(refused.value)


# --- response_format -----------------------------------------------------------------------


def test_response_formats_map_onto_specs():
    assert response_format_spec(None) is None
    assert response_format_spec({"type": "text"}) is None
    assert response_format_spec({"type": "json_object"}) == JsonObject()
    spec = response_format_spec(
        {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    )
    assert spec == JsonSchema(PERSON, strict=False)  # OpenAI's default: not strict
    assert spec.schema == PERSON
    strict = {"name": "person-1_x", "schema": PERSON, "strict": True, "description": "who"}
    assert response_format_spec({"type": "json_schema", "json_schema": strict}).strict is True


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({}, "response_format.type must be one of text, json_object, json_schema; got None"),
        ({"type": "xml"}, "response_format.type must be one of"),
        ({"type": "json_schema"}, "response_format.json_schema is required"),
        ({"type": "json_schema", "json_schema": "x"}, "response_format.json_schema is required"),
        (
            {"type": "json_schema", "json_schema": {"schema": PERSON}},
            "response_format.json_schema.name must be 1-64 letters",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "a b", "schema": PERSON}},
            "response_format.json_schema.name must be 1-64 letters, digits, '_' or '-', got 'a b'",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": PERSON}},
            "response_format.json_schema.name must be",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "p"}},
            "response_format.json_schema.schema is required",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "p", "schema": [1]}},
            "response_format.json_schema.schema is required: a JSON schema object",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "p", "schema": {}, "strict": "yes"}},
            "response_format.json_schema.strict must be true or false",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "p", "schema": {}, "description": 3}},
            "response_format.json_schema.description must be a string",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "p", "schema": {"x": float("nan")}}},
            "response_format.json_schema.schema: json_schema.schema is not JSON",
        ),
    ],
)
def test_bad_response_formats_are_400s_naming_the_field(value, message):
    assert message in _refused(response_format_spec, value)


def test_text_format_is_the_responses_api_shape():
    assert text_format_spec(None) is None
    assert text_format_spec({}) is None
    assert text_format_spec({"format": {"type": "text"}}) is None
    assert text_format_spec({"format": {"type": "json_object"}}) == JsonObject()
    form = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    assert text_format_spec({"format": form}) == JsonSchema(PERSON, strict=True)
    assert "text.format.schema is required" in _refused(
        text_format_spec, {"format": {"type": "json_schema", "name": "x"}}
    )
    assert "text.format.name must be" in _refused(
        text_format_spec, {"format": {"type": "json_schema", "schema": {}}}
    )
    assert "text.format.type must be one of" in _refused(text_format_spec, {"format": {}})


def test_a_schema_that_cannot_be_enforced_is_a_400_naming_the_problem():
    check_structured(None)
    check_structured(JsonObject())
    check_structured(JsonSchema(PERSON, strict=True))
    unknown = {"type": "object", "properties": {"c": {"type": "string", "format": "colour"}}}
    check_structured(JsonSchema(unknown, strict=False))  # not strict: the format is ignored
    message = _refused(check_structured, JsonSchema(unknown, strict=True))
    assert "colour" in message and "response_format json_schema" in message
    missing = {"$ref": "#/$defs/missing"}
    assert "/$defs/missing" in _refused(check_structured, JsonSchema(missing, strict=True))


def test_a_number_out_of_the_grammars_range_is_a_400_naming_the_field():
    # 2**70 used to reach the grammar library, whose ValueError was a 500 (issue 33).
    big = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 2**70}}}
    chat = {"type": "json_schema", "json_schema": {"name": "n", "schema": big}}
    message = _refused(response_format_spec, chat)
    assert message.startswith(
        "response_format.json_schema.schema: /properties/n/minimum is 1180591620717411303424; "
        "every number in a schema must be within -9007199254740991 to 9007199254740991"
    ), message
    form = {"type": "json_schema", "name": "n", "schema": {"enum": [1, -(2**64)]}}
    message = _refused(text_format_spec, {"format": form})
    assert message.startswith("text.format.schema: /enum/1 is -18446744073709551616;"), message
    tool = {"type": "function", "function": {"name": "f", "parameters": {"maxItems": 2**70}}}
    message = _refused(tool_spec, [WEATHER, tool], "auto", None)
    assert message.startswith("tools[1].function.parameters: /maxItems is "), message


def test_the_responses_api_names_text_format_in_compile_errors():
    unknown = {"type": "object", "properties": {"c": {"type": "string", "format": "colour"}}}
    message = _refused(check_structured, JsonSchema(unknown, strict=True), "text.format")
    assert message.startswith("text.format.schema cannot be enforced:"), message
    assert "colour" in message and "response_format" not in message


# --- tools -------------------------------------------------------------------------------


def test_tools_and_tool_choice_map_onto_a_tool_calls_spec():
    auto = tool_spec([WEATHER, TIME], None, None)
    assert auto == ToolCalls(
        (Tool("get_weather", WEATHER["function"]["parameters"]), Tool("get_time")),
        ToolChoice.AUTO,
    )
    assert auto.parallel is True and auto.tools[1].parameters["properties"] == {}
    assert tool_spec([WEATHER], "auto", None).choice is ToolChoice.AUTO
    required = tool_spec([WEATHER, TIME], "required", False)
    assert (required.choice, required.parallel) == (ToolChoice.REQUIRED, False)
    named = tool_spec([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, True)
    assert (named.choice, named.function) == (ToolChoice.NAMED, "get_time")
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    assert tool_spec([strict], "required", None).tools[0].strict is True


def test_no_tool_call_is_no_spec():
    assert tool_spec(None, None, None) is None
    assert tool_spec([], "auto", None) is None
    assert tool_spec(None, "none", True) is None
    assert tool_spec([WEATHER], "none", None) is None  # known, but not to be called


@pytest.mark.parametrize(
    ("tools", "choice", "parallel", "message"),
    [
        (None, "required", None, "tool_choice 'required' needs tools"),
        (None, {"type": "function", "function": {"name": "f"}}, None, "needs tools"),
        ([WEATHER], "sometimes", None, "tool_choice must be one of none, auto, required"),
        ([WEATHER], {"type": "function"}, None, "tool_choice.function.name must name"),
        ([WEATHER], {"type": "custom", "name": "x"}, None, "tool_choice must be one of"),
        (
            [WEATHER],
            {"type": "function", "function": {"name": "get_time"}},
            None,
            "tool_choice names function 'get_time', which is not among the tools (get_weather)",
        ),
        ([WEATHER, "x"], "auto", None, "tools[1] must be an object"),
        ([{"type": "custom", "name": "x"}], "auto", None, "tools[0].type must be 'function'"),
        ([{"type": "function"}], "auto", None, "tools[0].function is required"),
        (
            [{"type": "function", "function": {"name": "get weather"}}],
            "auto",
            None,
            "tools[0].function.name must be 1-64 letters",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
            "auto",
            None,
            "tools[0].function.parameters must be a JSON schema object",
        ),
        (
            [{"type": "function", "function": {"name": "f", "strict": 1}}],
            "auto",
            None,
            "tools[0].function.strict must be true or false",
        ),
        (
            [{"type": "function", "function": {"name": "f", "description": 1}}],
            "auto",
            None,
            "tools[0].function.description must be a string",
        ),
        ([WEATHER, WEATHER], "auto", None, "tool names must be unique; repeated: get_weather"),
        ([WEATHER], "required", "yes", "parallel_tool_calls must be true or false"),
        # tool_choice none does not excuse a malformed tool
        ([{"type": "function"}], "none", None, "tools[0].function is required"),
    ],
)
def test_bad_tools_are_400s_naming_the_field(tools, choice, parallel, message):
    assert message in _refused(tool_spec, tools, choice, parallel)


def test_a_tool_whose_parameters_cannot_be_compiled_is_named():
    bad = {"type": "object", "properties": {"when": {"type": "string", "format": "colour"}}}
    broken = {"type": "function", "function": {"name": "paint", "parameters": bad, "strict": True}}
    spec = tool_spec([WEATHER, broken], "auto", None)
    message = _refused(check_tools, spec)
    assert message.startswith("tools[1] (function 'paint'):"), message
    assert "colour" in message
    dangling = {"type": "object", "properties": {"x": {"$ref": "#/$defs/gone"}}}
    lenient = {"type": "function", "function": {"name": "gone", "parameters": dangling}}
    message = _refused(check_tools, tool_spec([lenient, WEATHER], "required", None))
    assert message.startswith("tools[0] (function 'gone'):") and "$defs/gone" in message
    check_tools(tool_spec([WEATHER, TIME], "required", None))
