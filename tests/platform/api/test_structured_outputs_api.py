"""Structured outputs over HTTP on the real SmolLM2: ``response_format`` json_object and
json_schema (strict) on chat, with an adapter, streamed, with ``n > 1`` and a stop string;
the official client's ``chat.completions.parse`` with a pydantic model; ``text.format`` on
/v1/responses (and ``responses.parse``); ``response_format`` on /v1/completions; the 400s
of bad values; each request billed once, as any other."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest
from pydantic import BaseModel

from tests.platform.api.smollm2_served import ADAPTER, Served, served

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 20},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
EXTRACT = [
    {
        "role": "user",
        "content": "Alice is 31 and lives in Paris. Reply with a JSON object with her name, "
        "age and city only.",
    }
]
PERSON_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}


class Person(BaseModel):
    name: str
    age: int
    city: str


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory, smollm2_dir, make_adapter) -> Iterator[Served]:
    adapter_dir = make_adapter(smollm2_dir, rank=8, targets=("q_proj", "v_proj"), seed=3)
    with served(tmp_path_factory.mktemp("structured"), smollm2_dir, adapter_dir) as running:
        yield running


def _chat(smollm2: Served, **fields):
    body = {"model": smollm2.base, "messages": EXTRACT, "max_tokens": 60, "temperature": 0}
    return smollm2.client.chat.completions.create(**{**body, **fields})


def _billed_once(smollm2: Served, response) -> None:
    row = smollm2.usage_rows()[response.id]
    assert row["prompt_tokens"] == response.usage.prompt_tokens
    assert row["completion_tokens"] == response.usage.completion_tokens


def test_json_object_answers_parse(smollm2):
    response = _chat(smollm2, response_format={"type": "json_object"})
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)
    _billed_once(smollm2, response)


@pytest.mark.parametrize("model", ["base", ADAPTER])
def test_strict_json_schema_answers_validate(smollm2, model):
    response = _chat(
        smollm2, model=smollm2.base if model == "base" else model, response_format=PERSON_FORMAT
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    _billed_once(smollm2, response)


def test_a_streamed_json_schema_answer_is_the_same_answer(smollm2):
    whole = _chat(smollm2, response_format=PERSON_FORMAT)
    stream = _chat(
        smollm2,
        response_format=PERSON_FORMAT,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage, request_id = "", None, None, None
    for chunk in stream:
        request_id = chunk.id
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert (text, finish) == (whole.choices[0].message.content, "stop")
    jsonschema.validate(json.loads(text), PERSON)
    row = smollm2.usage_rows()[request_id]
    assert row["completion_tokens"] == usage.completion_tokens == whole.usage.completion_tokens


def test_every_choice_of_n_follows_the_schema(smollm2):
    response = _chat(smollm2, response_format=PERSON_FORMAT, n=2, temperature=0.8, seed=5)
    assert len(response.choices) == 2
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    _billed_once(smollm2, response)


def test_a_stop_string_cuts_the_document_short(smollm2):
    response = _chat(smollm2, response_format=PERSON_FORMAT, stop=['"age"'])
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert '"age"' not in choice.message.content
    assert choice.message.content.lstrip().startswith("{")
    with pytest.raises(ValueError):
        json.loads(choice.message.content)  # cut before its end, as asked


def test_the_official_client_parses_into_a_pydantic_model(smollm2):
    for completions in (smollm2.client.chat.completions, smollm2.client.beta.chat.completions):
        parsed = completions.parse(
            model=smollm2.base,
            messages=EXTRACT,
            response_format=Person,
            max_tokens=60,
            temperature=0,
        )
        person = parsed.choices[0].message.parsed
        assert isinstance(person, Person) and person.name
    with smollm2.client.chat.completions.stream(
        model=ADAPTER, messages=EXTRACT, response_format=Person, max_tokens=60, temperature=0
    ) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Person)


def test_responses_text_format(smollm2):
    text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    response = smollm2.client.responses.create(
        model=smollm2.base, input=EXTRACT, text=text, max_output_tokens=60, temperature=0
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), PERSON)
    assert response.text.format.type == "json_schema"
    _, output = response.usage.input_tokens, response.usage.output_tokens
    assert smollm2.usage_rows()[response.id]["completion_tokens"] == output

    events = list(
        smollm2.client.responses.create(
            model=smollm2.base,
            input=EXTRACT,
            text=text,
            max_output_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == response.output_text

    parsed = smollm2.client.responses.parse(
        model=smollm2.base, input=EXTRACT, text_format=Person, max_output_tokens=60, temperature=0
    )
    assert isinstance(parsed.output_parsed, Person)

    json_object = smollm2.client.responses.create(
        model=ADAPTER,
        input=EXTRACT,
        text={"format": {"type": "json_object"}},
        max_output_tokens=60,
        temperature=0,
    )
    assert isinstance(json.loads(json_object.output_text), dict)


def test_completions_take_response_format_too(smollm2):
    prompt = "Alice is 31 years old and lives in Paris. As JSON: "
    response = smollm2.client.completions.create(
        model=smollm2.base,
        prompt=[prompt, "Bob, 40, Rome. As JSON: "],
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": PERSON_FORMAT},
    )
    assert len(response.choices) == 2
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), PERSON)
    _billed_once(smollm2, response)


UNKNOWN_FORMAT = {
    "type": "object",
    "properties": {"c": {"type": "string", "format": "colour"}},
}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type must be one of"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema is required"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
            "response_format.json_schema.schema is required",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "no spaces", "schema": PERSON},
                }
            },
            "response_format.json_schema.name must be 1-64 letters",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "c", "schema": UNKNOWN_FORMAT, "strict": True},
                }
            },
            "colour",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "c", "schema": {"$ref": "#/$defs/gone"}},
                }
            },
            "/$defs/gone",
        ),
    ],
)
def test_bad_response_formats_are_400s_naming_the_problem(smollm2, fields, message):
    body = {"model": smollm2.base, "messages": EXTRACT, "max_tokens": 4, **fields}
    for path, shaped in (
        ("/chat/completions", body),
        ("/completions", {"model": smollm2.base, "prompt": "x", "max_tokens": 4, **fields}),
    ):
        for stream in (False, True):
            response = smollm2.post(path, {**shaped, "stream": stream})
            assert response.status_code == 400, response.text
            assert message in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("form", "message"),
    [
        ({"type": "yaml"}, "text.format.type must be one of"),
        ({"type": "json_schema", "schema": PERSON}, "text.format.name must be 1-64 letters"),
        ({"type": "json_schema", "name": "p"}, "text.format.schema is required"),
        ({"type": "json_schema", "name": "c", "schema": UNKNOWN_FORMAT, "strict": True}, "colour"),
    ],
)
def test_bad_text_formats_are_400s_naming_the_problem(smollm2, form, message):
    for stream in (False, True):
        body = {"model": smollm2.base, "input": "x", "text": {"format": form}, "stream": stream}
        response = smollm2.post("/responses", body)
        assert response.status_code == 400, response.text
        assert message in response.json()["error"]["message"]
