"""Chat tool calls over HTTP on the real SmolLM2: ``tools`` with ``tool_choice`` required,
a named function and auto, answered with ``tool_calls`` (arguments valid against the
tool's schema, finish reason ``tool_calls``), streamed as ``delta.tool_calls`` that the
official client's stream helpers accumulate to the same answer; ``parallel_tool_calls``,
``n > 1``, an adapter, a conversation carrying calls and their results, the client's
``pydantic_function_tool`` parsed, the 400s of bad values, and each request billed once."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.platform.api.smollm2_served import ADAPTER, Served, served

pytestmark = pytest.mark.slow

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 20}},
    "required": ["timezone"],
    "additionalProperties": False,
}
PARAMETERS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER_PARAMETERS,
            "strict": True,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The current time in a timezone",
            "parameters": TIME_PARAMETERS,
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: str
    unit: str


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory, smollm2_dir, make_adapter) -> Iterator[Served]:
    adapter_dir = make_adapter(smollm2_dir, rank=8, targets=("q_proj", "v_proj"), seed=4)
    with served(tmp_path_factory.mktemp("tools"), smollm2_dir, adapter_dir) as running:
        yield running


def _chat(smollm2: Served, **fields):
    body = {
        "model": smollm2.base,
        "messages": ASK,
        "tools": TOOLS,
        "max_tokens": 60,
        "temperature": 0,
    }
    return smollm2.client.chat.completions.create(**{**body, **fields})


def _valid_calls(message, names=tuple(PARAMETERS)) -> list[tuple[str, dict]]:
    """The message's calls as (name, arguments), each checked against its tool's schema."""
    assert message.tool_calls, message
    calls = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name])
        calls.append((call.function.name, arguments))
    assert len({call.id for call in message.tool_calls}) == len(calls)
    return calls


def _billed_once(smollm2: Served, response) -> None:
    row = smollm2.usage_rows()[response.id]
    assert row["prompt_tokens"] == response.usage.prompt_tokens
    assert row["completion_tokens"] == response.usage.completion_tokens


def test_required_tool_choice_answers_with_calls(smollm2):
    # One call per answer: SmolLM2 allowed several repeats its calls until max_tokens.
    response = _chat(
        smollm2, tool_choice="required", parallel_tool_calls=False, n=2, seed=3, temperature=0.8
    )
    assert len(response.choices) == 2
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert len(_valid_calls(choice.message)) == 1
    _billed_once(smollm2, response)


def test_a_named_function_is_called_once(smollm2):
    choice = {"type": "function", "function": {"name": "get_time"}}
    response = _chat(smollm2, tool_choice=choice, model=ADAPTER)
    assert response.choices[0].finish_reason == "tool_calls"
    assert [name for name, _ in _valid_calls(response.choices[0].message)] == ["get_time"]


def _accumulated(stream) -> tuple[str | None, list[dict], str | None, str]:
    """A raw stream's content, calls (by index: id, name, arguments joined), finish reason
    and request id, put together the way OpenAI's deltas add up."""
    content, calls, finish, request_id = None, {}, None, ""
    for chunk in stream:
        request_id = chunk.id
        for choice in chunk.choices:
            if choice.delta.content is not None:
                content = (content or "") + choice.delta.content
            for call in choice.delta.tool_calls or []:
                into = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                into["id"] += call.id or ""
                into["name"] += (call.function.name or "") if call.function else ""
                into["arguments"] += (call.function.arguments or "") if call.function else ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, request_id


def test_streamed_calls_accumulate_to_the_response(smollm2):
    one = {"tool_choice": "required", "parallel_tool_calls": False}
    whole = _chat(smollm2, **one).choices[0]
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]

    content, calls, finish, request_id = _accumulated(_chat(smollm2, **one, stream=True))
    assert (content, finish) == (None, "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == expected
    assert all(c["id"].startswith("call_") for c in calls)
    assert smollm2.usage_rows()[request_id]["completion_tokens"] > 0

    # The official client's stream helper builds the same message.
    with smollm2.client.chat.completions.stream(
        model=smollm2.base, messages=ASK, tools=TOOLS, **one, max_tokens=60, temperature=0
    ) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content is None
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == expected


def test_auto_answers_in_text_or_calls(smollm2):
    for messages in (ASK, [{"role": "user", "content": "Say hello to Bob."}]):
        response = _chat(smollm2, messages=messages, tool_choice="auto")
        choice = response.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            _valid_calls(choice.message)
        else:
            assert choice.finish_reason in ("stop", "length") and choice.message.content
            assert "<tool_call>" not in choice.message.content
        streamed = _accumulated(_chat(smollm2, messages=messages, tool_choice="auto", stream=True))
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        content = streamed[0].strip() if streamed[0] else None
        assert (content, [(c["name"], c["arguments"]) for c in streamed[1]], streamed[2]) == (
            choice.message.content,
            calls,
            choice.finish_reason,
        )


def test_a_conversation_with_calls_and_results_renders(smollm2):
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": "18 degrees, sunny"},
    ]
    answered = _chat(smollm2, messages=messages, max_tokens=20)
    assert answered.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # tool_choice none: the tools are known, no call is made or parsed.
    plain = _chat(smollm2, messages=messages, tool_choice="none", max_tokens=20)
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content


def test_the_official_client_parses_pydantic_function_tools(smollm2):
    completion = smollm2.client.chat.completions.parse(
        model=smollm2.base,
        messages=ASK,
        tools=[openai.pydantic_function_tool(GetWeather, name="get_weather")],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "tool_calls"
    parsed = message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, GetWeather) and parsed.city
    _billed_once(smollm2, completion)


BAD_PARAMETERS = {
    "type": "object",
    "properties": {"when": {"type": "string", "format": "colour"}},
}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "get_news"}}},
            "tool_choice names function 'get_news', which is not among the tools",
        ),
        (
            {
                "tools": [
                    *TOOLS,
                    {
                        "type": "function",
                        "function": {"name": "paint", "parameters": BAD_PARAMETERS, "strict": True},
                    },
                ]
            },
            "tools[2] (function 'paint')",
        ),
        ({"tools": [{"type": "custom", "name": "x"}]}, "tools[0].type must be 'function'"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice 'required' needs tools"),
        ({"tool_choice": "always"}, "tool_choice must be one of none, auto, required"),
        (
            {"response_format": {"type": "json_object"}},
            "response_format must be text when tools may be called",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {"role": "assistant", "tool_calls": [{"id": "c", "function": {}}]},
                ]
            },
            "messages[1].tool_calls[0].function.name is required",
        ),
    ],
)
def test_bad_tools_are_400s_naming_the_problem(smollm2, fields, message):
    body = {"model": smollm2.base, "messages": ASK, "tools": TOOLS, "max_tokens": 4, **fields}
    for stream in (False, True):
        response = smollm2.post("/chat/completions", {**body, "stream": stream})
        assert response.status_code == 400, response.text
        assert message in response.json()["error"]["message"]
