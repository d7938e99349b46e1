"""``POST /v1/responses`` (and per adapter) with the official ``openai`` client: text in and
out, instructions, message-list input, incomplete answers, the typed event stream, usage
and billing as chat's, deadlines, and the features refused with a 400."""

from __future__ import annotations

import json
import time

import openai
import pytest

from tests.platform.api.conftest import (
    assert_openai_error,
    speculation_totals,
    store_ready_adapter,
    usage_rows,
)
from tests.platform.api.slowed_platform import tenant_headers

HELLO = "Say hello."
STREAM_EVENTS_START = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
STREAM_EVENTS_END = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def _chat(client, model: str, messages: list[dict], max_tokens: int):
    return client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0
    )


def test_a_response_is_chat_underneath(make_client, server, context, base):
    client, tenant_id = make_client()
    chat = _chat(client, base, [{"role": "user", "content": HELLO}], 8)
    response = client.responses.create(
        model=base, input=HELLO, max_output_tokens=8, temperature=0, user="alice"
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == base and response.store is False
    assert response.output_text == chat.choices[0].message.content
    message = response.output[0]
    assert (message.type, message.role) == ("message", "assistant")
    assert message.content[0].type == "output_text"
    finished = chat.choices[0].finish_reason
    assert response.status == ("completed" if finished == "stop" else "incomplete")
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert response.user == "alice" and response.max_output_tokens == 8

    # Billed like chat: one record under the response's id, with its user.
    rows = {row["request_id"]: row for row in usage_rows(server, context, tenant_id)}
    assert rows[response.id]["completion_tokens"] == usage.output_tokens
    assert rows[response.id]["user"] == "alice"


def test_instructions_and_message_lists_render_as_chat(make_client, base):
    client, _ = make_client()
    system = "You answer in French."
    chat = _chat(
        client,
        base,
        [
            {"role": "system", "content": system},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Bonjour"},
            {"role": "user", "content": HELLO},
        ],
        6,
    )
    response = client.responses.create(
        model=base,
        instructions=system,
        input=[
            {"role": "user", "content": "Hi"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Bonjour"}],
            },
            {"role": "user", "content": [{"type": "input_text", "text": HELLO}]},
        ],
        max_output_tokens=6,
        temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.instructions == system
    # developer is rendered as system
    as_developer = client.responses.create(
        model=base,
        input=[{"role": "developer", "content": system}, {"role": "user", "content": HELLO}],
        max_output_tokens=4,
        temperature=0,
    )
    with_instructions = client.responses.create(
        model=base, instructions=system, input=HELLO, max_output_tokens=4, temperature=0
    )
    assert as_developer.output_text == with_instructions.output_text


def test_running_out_of_tokens_is_incomplete(make_client, base):
    client, _ = make_client()
    response = client.responses.create(
        model=base, input=HELLO, max_output_tokens=3, extra_body={"ignore_eos": True}
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3
    assert response.output[0].status == "incomplete"


def test_the_stream_has_the_responses_events_in_order(make_client, base):
    client, _ = make_client()
    whole = client.responses.create(model=base, input=HELLO, max_output_tokens=8, temperature=0)
    events = list(
        client.responses.create(
            model=base, input=HELLO, max_output_tokens=8, temperature=0, stream=True
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:4] == STREAM_EVENTS_START
    assert kinds[-4:-1] == STREAM_EVENTS_END
    assert kinds[-1] == (
        "response.completed" if whole.status == "completed" else "response.incomplete"
    )
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert deltas and kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert [event.sequence_number for event in events] == list(range(len(events)))

    text = "".join(event.delta for event in deltas)
    assert text == whole.output_text
    assert events[-4].text == text and events[-3].part.text == text
    assert events[-2].item.content[0].text == text
    final = events[-1].response
    assert final.output_text == text and final.id == events[0].response.id
    assert events[0].response.status == "in_progress"
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens

    # The wire form: each event named on its SSE event line, no [DONE].
    raw = client.responses.with_raw_response.create(
        model=base, input=HELLO, max_output_tokens=2, stream=True
    )
    body = raw.http_response.read().decode()
    blocks = [block for block in body.split("\n\n") if block]
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert event_line == f"event: {json.loads(data_line.removeprefix('data: '))['type']}"
    assert "[DONE]" not in body


def test_per_adapter_by_model_and_by_path(make_client, context, make_adapter, base):
    client, tenant_id = make_client()
    adapter_dir = make_adapter(context.base_model.path, rank=4, seed=5, std=0.2)
    store_ready_adapter(context, tenant_id, "answers", adapter_dir)
    messages = [{"role": "user", "content": HELLO}]
    expected = _chat(client, "answers", messages, 6).choices[0].message.content
    assert expected != _chat(client, base, messages, 6).choices[0].message.content

    by_model = client.responses.create(
        model="answers", input=HELLO, max_output_tokens=6, temperature=0
    )
    assert by_model.output_text == expected and by_model.model == "answers"
    by_path = client.post(
        "/adapters/answers/responses",
        body={"input": HELLO, "max_output_tokens": 6, "temperature": 0},
        cast_to=object,
    )
    assert by_path["output"][0]["content"][0]["text"] == expected
    other, _ = make_client()
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model="answers", input=HELLO)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools are not"),
        ({"tool_choice": "required"}, "tool_choice 'required' is not supported"),
        ({"previous_response_id": "resp_123"}, "previous_response_id is not supported"),
        ({"background": True}, "background is not supported"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x"}}},
            "text.format.schema is required",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            r"input\[0\].content\[0\] of type 'input_image' is not supported",
        ),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "messages only"),
        ({"input": [{"role": "robot", "content": "hi"}]}, r"input\[0\].role must be one of"),
        ({"input": []}, "input is empty"),
        ({"max_output_tokens": 0}, "max_output_tokens must be >= 1"),
        ({"temperature": -1}, "temperature must be >= 0"),
        ({"user": "u" * 257}, "at most 256"),
    ],
)
def test_unsupported_and_bad_fields_are_400s(make_client, base, fields, message):
    client, _ = make_client()
    body = {"model": base, "input": HELLO, "max_output_tokens": 2, **fields}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match=message):
            client.post("/responses", body={**body, "stream": stream}, cast_to=object)


def test_harmless_fields_are_accepted(make_client, base):
    client, _ = make_client()
    response = client.responses.create(
        model=base,
        input=HELLO,
        max_output_tokens=2,
        store=True,
        tool_choice="auto",
        parallel_tool_calls=False,
        truncation="disabled",
        metadata={"job": "eval-7"},
        text={"format": {"type": "text"}},
    )
    assert response.store is False  # nothing is stored, whatever was asked
    assert response.metadata == {"job": "eval-7"}


def test_a_response_past_its_deadline_is_billed_as_sent(slowed_platform):
    client, context = slowed_platform()
    tenant_id, headers = tenant_headers(client, context)
    body = {
        "model": context.base_model.model_id,
        "input": HELLO,
        "max_output_tokens": 400,
        "ignore_eos": True,
        "timeout": 0.6,
    }
    started = time.monotonic()
    late = client.post("/v1/responses", json=body, headers=headers)
    assert late.status_code == 504, late.text
    assert late.json()["error"]["code"] == "deadline_exceeded"
    partial = late.json()["partial"]
    assert partial["object"] == "response" and partial["status"] == "incomplete"

    streamed = client.post("/v1/responses", json={**body, "stream": True}, headers=headers)
    assert time.monotonic() - started < 2 * 0.6 + 2.0
    events = [
        json.loads(block.split("\ndata: ", 1)[1])
        for block in streamed.text.split("\n\n")
        if block.startswith("event: ")
    ]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "deadline_exceeded"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "deadline_exceeded"
    sent = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert sent and failed["output"][0]["content"][0]["text"] == sent

    admin = {"Authorization": f"Bearer {context.admin_token}"}
    report = client.get(
        "/admin/usage", params={"tenant_id": tenant_id, "group_by": "request"}, headers=admin
    ).json()
    billed = {row["request_id"]: row for row in report["rows"]}
    assert failed["id"] in billed and billed[failed["id"]]["finish_reason"] == "deadline"
    assert failed["usage"]["output_tokens"] == billed[failed["id"]]["completion_tokens"] > 0


def test_speculative_false_opts_a_response_out_streamed_or_not(speculating):
    """``speculative: false`` (an extension, as in chat) on an engine that speculates: no
    proposals for it, streamed or not; the same text and usage as the default's."""
    client, context = speculating
    _, headers = tenant_headers(client, context)
    body = {
        "model": context.base_model.model_id,
        "input": "one two three one two three one two",
        "max_output_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
    }

    def post(**extra):
        response = client.post("/v1/responses", json={**body, **extra}, headers=headers)
        assert response.status_code == 200, response.text
        return response

    plain = post(speculative=False).json()
    stream = post(speculative=False, stream=True).text
    [last] = [  # 24 tokens of 24: incomplete, for max_output_tokens
        json.loads(line.removeprefix("data: "))
        for line in stream.splitlines()
        if line.startswith("data: ") and '"response.incomplete"' in line
    ]
    assert speculation_totals(client, context)["proposed_tokens"] == 0
    fast = post().json()
    assert speculation_totals(client, context)["proposed_tokens"] > 0
    text = fast["output"][0]["content"][0]["text"]
    assert plain["output"][0]["content"][0]["text"] == text
    assert last["response"]["output"][0]["content"][0]["text"] == text
    billed = ("input_tokens", "output_tokens")
    assert [plain["usage"][k] for k in billed] == [fast["usage"][k] for k in billed]
    assert fast["usage"]["output_tokens"] == 24


def test_a_speculative_that_is_not_a_boolean_is_refused_by_name(client, context):
    _, headers = tenant_headers(client, context)
    for value in ("no", 1, None):
        for stream in (False, True):
            response = client.post(
                "/v1/responses",
                json={
                    "model": context.base_model.model_id,
                    "input": HELLO,
                    "stream": stream,
                    "speculative": value,
                },
                headers=headers,
            )
            error = assert_openai_error(response, 422)
            assert error["message"].startswith("speculative: "), error
