import json

import pytest

from loramux.engine.structured import (
    ParsedToolCall,
    Tool,
    ToolCalls,
    ToolChoice,
    ToolOutput,
    format_instructions,
    parse_tool_output,
)
from loramux.engine.structured.tool_calls import CLOSE, OPEN

from .walk import walk

WEATHER = Tool(
    "get_weather",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    strict=True,
)
# Parameters with their own $defs: their refs point at the parameters' root.
BOOK = Tool(
    "book_meeting",
    {
        "$defs": {"person": {"type": "object", "properties": {"email": {"type": "string"}}}},
        "type": "object",
        "properties": {"with": {"type": "array", "items": {"$ref": "#/$defs/person"}}},
        "required": ["with"],
        "additionalProperties": False,
    },
)
TOOLS = (WEATHER, BOOK)


def block(*calls: dict) -> str:
    return OPEN + json.dumps(list(calls)) + CLOSE


PARIS = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
MEETING = {"name": "book_meeting", "arguments": {"with": [{"email": "ada@example.org"}]}}


def test_required_takes_one_or_more_valid_calls_and_nothing_else(compiler, tokenizer):
    spec = ToolCalls(TOOLS, ToolChoice.REQUIRED)
    result = walk(compiler.matcher(spec), tokenizer, block(PARIS, MEETING))
    assert result.refused_at is None and result.finished
    assert walk(compiler.matcher(spec), tokenizer, "It is sunny.").refused_at == 0


@pytest.mark.parametrize(
    "call",
    [
        {"name": "get_time", "arguments": {}},
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}},
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "book_meeting", "arguments": {"with": [{"email": 7}]}},
    ],
    ids=["unknown function", "enum", "missing argument", "through $ref"],
)
def test_a_call_that_does_not_fit_a_tool_is_refused(compiler, tokenizer, call):
    spec = ToolCalls(TOOLS, ToolChoice.REQUIRED)
    assert walk(compiler.matcher(spec), tokenizer, block(call)).refused_at is not None


def test_without_parallel_calls_a_second_call_is_refused(compiler, tokenizer):
    spec = ToolCalls(TOOLS, ToolChoice.REQUIRED, parallel=False)
    assert walk(compiler.matcher(spec), tokenizer, block(PARIS)).finished
    assert walk(compiler.matcher(spec), tokenizer, block(PARIS, MEETING)).refused_at is not None


def test_a_named_choice_takes_exactly_one_call_of_that_function(compiler, tokenizer):
    spec = ToolCalls(TOOLS, ToolChoice.NAMED, function="book_meeting")
    assert walk(compiler.matcher(spec), tokenizer, block(MEETING)).finished
    assert walk(compiler.matcher(spec), tokenizer, block(PARIS)).refused_at is not None
    assert walk(compiler.matcher(spec), tokenizer, block(MEETING, MEETING)).refused_at is not None


def test_auto_lets_the_model_answer_in_text(compiler, tokenizer):
    matcher = compiler.matcher(ToolCalls(TOOLS, ToolChoice.AUTO))
    result = walk(matcher, tokenizer, "No tool needed: it is 3 < 4, and <tool> is just text.")
    assert result.refused_at is None
    assert matcher.can_end() and not result.finished  # EOS allowed, and more text too


def test_auto_forces_a_valid_call_once_the_tag_is_written(compiler, tokenizer):
    spec = ToolCalls(TOOLS, ToolChoice.AUTO)
    assert walk(compiler.matcher(spec), tokenizer, "Let me look.\n" + block(PARIS)).finished
    assert walk(compiler.matcher(spec), tokenizer, block(PARIS, MEETING)).finished
    bad = walk(compiler.matcher(spec), tokenizer, "Sure." + OPEN + '[{"name": "get_time"')
    assert bad.refused_at is not None
    after = walk(compiler.matcher(spec), tokenizer, block(PARIS) + " done")
    assert after.refused_at is not None  # nothing may follow the block


def test_parse_reads_content_and_calls():
    text = "Checking both.\n" + block(PARIS, MEETING)
    assert parse_tool_output(text) == ToolOutput(
        "Checking both.",
        (
            ParsedToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}'),
            ParsedToolCall("book_meeting", '{"with": [{"email": "ada@example.org"}]}'),
        ),
    )
    assert parse_tool_output(block(PARIS)).content is None


@pytest.mark.parametrize(
    "text",
    [
        "Just text.",
        "Cut short " + OPEN + '[{"name": "get_weather", "argu',
        OPEN + '{"name": "get_weather", "arguments": {}}' + CLOSE,  # not a list
        OPEN + '[{"name": "get_weather"}]' + CLOSE,  # no arguments
    ],
)
def test_an_answer_without_a_parseable_block_is_all_content(text):
    assert parse_tool_output(text) == ToolOutput(text, ())


def test_the_empty_answer_has_no_content():
    assert parse_tool_output("") == ToolOutput(None, ())


def test_instructions_name_the_tools_and_the_tags():
    text = format_instructions(ToolCalls(TOOLS, ToolChoice.NAMED, function="get_weather"))
    assert OPEN in text and CLOSE in text
    assert "get_weather" in text and "book_meeting" not in text
