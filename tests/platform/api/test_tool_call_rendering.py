"""Tool calls in and out of the chat template, without a server: the messages of a
conversation with tools (instructions, an assistant's calls, tool results), the streamed
answer split into content and calls the way its response reads, and the chat render's
events and choices."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from loramux.engine import FinishReason, RequestOutput
from loramux.engine.structured import Tool, ToolCalls, ToolChoice, parse_tool_output
from loramux.platform.api.chat.tool_messages import template_messages
from loramux.platform.api.chat.tool_render import (
    ToolCallSplitter,
    ToolChatRender,
    _held_back,
    finish_reason,
)
from loramux.platform.api.openai.schemas import ChatMessage
from loramux.platform.errors import Invalid
from loramux.platform.services.inference_job import Choice

SPEC = ToolCalls((Tool("get_weather"),), ToolChoice.REQUIRED)
CALLS = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'


def _messages(*raw: dict) -> list[ChatMessage]:
    return [ChatMessage(**m) for m in raw]


def test_the_tools_go_into_the_system_message():
    plain = template_messages(_messages({"role": "user", "content": "hi"}), None)
    assert plain == [{"role": "user", "content": "hi"}]
    added = template_messages(_messages({"role": "user", "content": "hi"}), SPEC)
    assert added[0]["role"] == "system" and "get_weather" in added[0]["content"]
    assert "<tool_call>" in added[0]["content"] and added[1:] == plain
    system = {"role": "system", "content": "Be brief."}
    joined = template_messages(_messages(system, {"role": "user", "content": "hi"}), SPEC)
    assert len(joined) == 2
    assert (
        joined[0]["content"].startswith("Be brief.\n\n") and "get_weather" in joined[0]["content"]
    )


def test_calls_and_results_render_as_the_model_writes_and_reads_them(tokenizer):
    conversation = _messages(
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "not json"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "25 C"}]},
        {"role": "assistant", "content": "Paris 18 C, Rome 25 C."},
    )
    rendered = template_messages(conversation, None)
    assert [m["role"] for m in rendered] == ["user", "assistant", "user", "assistant"]
    calls = rendered[1]["content"]
    assert calls.startswith("<tool_call>") and calls.endswith("</tool_call>")
    assert json.loads(calls[len("<tool_call>") : -len("</tool_call>")]) == [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_weather", "arguments": "not json"},
    ]
    results = rendered[2]["content"].split("\n")  # both results in one user turn
    assert [
        json.loads(r.removeprefix("<tool_response>").removesuffix("</tool_response>"))
        for r in results
    ] == [
        {"name": "get_weather", "content": "18 C"},
        {"name": "get_weather", "content": "25 C"},
    ]
    # SmolLM2's template takes it all.
    text = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\n<tool_response>" in text and calls in text


def test_an_assistant_text_comes_before_its_calls():
    message = {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
    }
    rendered = template_messages(_messages(message), None)[0]["content"]
    assert rendered == 'Let me check.\n<tool_call>[{"name": "f", "arguments": {}}]</tool_call>'
    assert parse_tool_output(rendered).content == "Let me check."


def test_a_call_without_a_function_name_is_a_400():
    message = {"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}
    with pytest.raises(Invalid, match=r"messages\[1\].tool_calls\[0\].function.name"):
        template_messages(_messages({"role": "user", "content": "x"}, message), None)


# --- the stream's split ------------------------------------------------------------------

ANSWERS = [
    CALLS,
    "Sure, checking.\n" + CALLS,
    "Sure, checking." + CALLS,
    "Sure.  \n\n" + CALLS + "ignored after the block",
    'First <tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": [1]}}]</tool_call>',
    "Plain text, no calls at all.",
    "Text ending in a partial tag <tool_",
    "Text ending with spaces   ",
    'A block cut short <tool_call>[{"name": "get_weather", "argu',
    "A block that is not JSON <tool_call>[oops]</tool_call> and more",
    "Less-than signs < and <tool and <tool_cal> are text",
    "",
]


def _pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(max(len(text) - 1, 0), rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("answer", ANSWERS)
def test_a_streamed_answer_splits_as_its_response_reads(answer):
    expected = parse_tool_output(answer)
    rng = random.Random(answer)
    for pieces in [[answer], list(answer), *(_pieces(answer, rng) for _ in range(20))]:
        splitter = ToolCallSplitter()
        content, calls = "", []
        for piece in pieces:
            shown, complete = splitter.feed(piece)
            content += shown
            calls.extend(complete)
        content += splitter.end()
        assert (content or None, tuple(calls)) == (expected.content, expected.calls), pieces


def test_text_that_may_start_the_tag_is_held_back_and_no_more():
    assert _held_back("Hello") == 0
    assert _held_back("Hello <") == 2
    assert _held_back("Hello\n<tool_ca") == len("\n<tool_ca")
    assert _held_back("Hello  ") == 2
    assert _held_back("a <b") == 0
    splitter = ToolCallSplitter()
    assert splitter.feed("Hi <t") == ("Hi", ())
    assert splitter.feed("ea") == (" <tea", ())


def test_calls_finish_with_tool_calls_only_when_the_answer_stopped():
    output = parse_tool_output(CALLS)
    assert finish_reason("stop", output) == "tool_calls"
    assert finish_reason("length", parse_tool_output(CALLS[:-3])) == "length"
    assert finish_reason("stop", parse_tool_output("text")) == "stop"
    assert finish_reason("abort", output) == "abort"


# --- the render ------------------------------------------------------------------------------


def _render(sequences: int) -> ToolChatRender:
    job = SimpleNamespace(
        request_id="chatcmpl-1",
        created=0,
        target=SimpleNamespace(model="m"),
        params=[None] * sequences,
    )
    return ToolChatRender(tokenizer=None, job=job, top_logprobs=None)


def _out(piece: str, *, finished: bool = False) -> RequestOutput:
    reason = FinishReason.STOP if finished else None
    return RequestOutput("r", [], [1], piece, [1], piece, finished=finished, finish_reason=reason)


def test_a_stream_says_content_null_then_sends_content_and_each_call_whole():
    render = _render(2)
    assert [e["choices"][0]["delta"] for e in render.opening()] == [
        {"role": "assistant", "content": None},
        {"role": "assistant", "content": None},
    ]
    answer = [
        "Checking",
        " now.\n<tool",
        '_call>[{"name": "get_weather", "arg',
        'uments": {}}]',
        "</tool_call>",
    ]
    events = []
    for i, piece in enumerate(answer):
        events += render.chunks(0, _out(piece, finished=i == len(answer) - 1), None)
    events += render.chunks(1, _out("Just text.", finished=True), None)
    choices = [e["choices"][0] for e in events]
    assert [(c["index"], c["delta"], c["finish_reason"]) for c in choices] == [
        (0, {"content": "Checking"}, None),
        (0, {"content": " now."}, None),
        (
            0,
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": choices[2]["delta"]["tool_calls"][0]["id"],
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": "{}"},
                    }
                ]
            },
            "tool_calls",
        ),
        (1, {"content": "Just text."}, "stop"),
    ]
    assert choices[2]["delta"]["tool_calls"][0]["id"].startswith("call_")


def test_a_response_choice_carries_the_calls():
    render = _render(1)
    text = 'Checking now.\n<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]</tool_call>'
    choice = render.choice(0, 0, Choice(text=text, finish_reason="stop"))
    message = choice["message"]
    assert (message["content"], choice["finish_reason"]) == ("Checking now.", "tool_calls")
    assert [(c["type"], c["function"]) for c in message["tool_calls"]] == [
        ("function", {"name": "a", "arguments": '{"x": 1}'}),
        ("function", {"name": "b", "arguments": "{}"}),
    ]
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    cut = render.choice(0, 0, Choice(text=text[:40], finish_reason="length"))
    assert cut["message"] == {"role": "assistant", "content": text[:40]}
    assert cut["finish_reason"] == "length"
