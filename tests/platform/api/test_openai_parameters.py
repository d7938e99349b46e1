"""OpenAI's request fields that tools send beyond the chat basics: ``user`` (stored with the
usage record and exported), ``suffix`` (refused), ``best_of`` and ``logit_bias``; each
through the official ``openai`` client, streamed and not, and with its bad values."""

from __future__ import annotations

import csv
import io

import httpx
import openai
import pytest

from tests.platform.api.conftest import usage_rows

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Say hello."}]


# --- user ----------------------------------------------------------------------------------


def test_user_is_stored_on_the_usage_record_and_exported(make_client, server, context, base):
    client, tenant_id = make_client()
    plain = client.completions.create(model=base, prompt=PROMPT, max_tokens=2, user="alice")
    chat = client.chat.completions.create(
        model=base, messages=MESSAGES, max_tokens=2, user="bob@example.com"
    )
    for _ in client.completions.create(
        model=base, prompt=PROMPT, max_tokens=2, user="carol", stream=True
    ):
        pass
    client.completions.create(model=base, prompt=PROMPT, max_tokens=2)  # none sent

    rows = usage_rows(server, context, tenant_id)
    by_request = {row["request_id"]: row["user"] for row in rows}
    assert by_request[plain.id] == "alice" and by_request[chat.id] == "bob@example.com"
    assert sorted(by_request.values(), key=str) == sorted(
        ["alice", "bob@example.com", "carol", None], key=str
    )

    admin = {"Authorization": f"Bearer {context.admin_token}"}
    exported = httpx.get(
        f"{server.url}/admin/usage",
        params={"tenant_id": tenant_id, "group_by": "request", "format": "csv"},
        headers=admin,
    )
    lines = list(csv.DictReader(io.StringIO(exported.text)))
    assert sorted(line["user"] for line in lines) == ["", "alice", "bob@example.com", "carol"]


def test_a_user_over_256_characters_is_a_400(make_client, base):
    client, _ = make_client()
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="user is 257 characters long"):
            client.completions.create(
                model=base, prompt=PROMPT, max_tokens=2, user="u" * 257, stream=stream
            )
        with pytest.raises(openai.BadRequestError, match="at most 256"):
            client.chat.completions.create(
                model=base, messages=MESSAGES, max_tokens=2, user="u" * 257, stream=stream
            )
    assert client.completions.create(model=base, prompt=PROMPT, max_tokens=1, user="u" * 256)


# --- priority ------------------------------------------------------------------------------


def test_a_priority_per_request_is_a_400_saying_the_operator_sets_it(make_client, base):
    # Other unknown fields are ignored (clients send fields a server may not know); this one
    # would look as if it had worked.
    client, _ = make_client()
    refused = "priority cannot be set per request: .* the operator sets"
    for stream in (False, True):
        extra = {"priority": 9}
        with pytest.raises(openai.BadRequestError, match=refused):
            client.completions.create(
                model=base, prompt=PROMPT, max_tokens=1, stream=stream, extra_body=extra
            )
        with pytest.raises(openai.BadRequestError, match=refused):
            client.chat.completions.create(
                model=base, messages=MESSAGES, max_tokens=1, stream=stream, extra_body=extra
            )
        with pytest.raises(openai.BadRequestError, match=refused):
            client.responses.create(
                model=base, input="Hi", max_output_tokens=1, stream=stream, extra_body=extra
            )
    unknown = {"no_such_field": 1}
    assert client.completions.create(model=base, prompt=PROMPT, max_tokens=1, extra_body=unknown)


# --- suffix --------------------------------------------------------------------------------


def test_a_suffix_is_refused_clearly_and_an_empty_one_accepted(make_client, base):
    client, _ = make_client()
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="suffix is not supported: "):
            client.completions.create(
                model=base, prompt=PROMPT, suffix="}", max_tokens=2, stream=stream
            )
    assert client.completions.create(model=base, prompt=PROMPT, suffix="", max_tokens=1)
    assert client.completions.create(model=base, prompt=PROMPT, suffix=None, max_tokens=1)


# --- best_of -------------------------------------------------------------------------------


def _candidates(client, base, prompt, count: int, **fields) -> list[tuple[str, float, int]]:
    """The ``count`` candidates best_of draws (seeded: seed, seed + 1, ...): text, total
    log-probability, tokens."""
    result = client.completions.create(model=base, prompt=prompt, n=count, logprobs=0, **fields)
    return [
        (c.text, sum(c.logprobs.token_logprobs), len(c.logprobs.tokens)) for c in result.choices
    ]


def test_best_of_returns_the_candidates_of_highest_total_logprob(make_client, base):
    client, _ = make_client()
    fields = {"max_tokens": 6, "temperature": 1.5, "seed": 11}
    candidates = _candidates(client, base, PROMPT, 5, **fields)
    ranked = sorted(candidates, key=lambda c: -c[1])

    one = client.completions.create(model=base, prompt=PROMPT, best_of=5, **fields)
    assert [c.text for c in one.choices] == [ranked[0][0]]
    assert one.choices[0].logprobs is None  # ranked by logprobs, shown only when asked
    # Every candidate was generated, and is billed.
    assert one.usage.completion_tokens == sum(c[2] for c in candidates)

    two = client.completions.create(model=base, prompt=PROMPT, n=2, best_of=5, logprobs=1, **fields)
    assert [(c.index, c.text) for c in two.choices] == [(0, ranked[0][0]), (1, ranked[1][0])]
    totals = [sum(c.logprobs.token_logprobs) for c in two.choices]
    assert totals == pytest.approx([ranked[0][1], ranked[1][1]])

    # In a batch, each prompt gets its own best n, indexed prompt-major.
    other = "Once upon a time"
    best_other = max(_candidates(client, base, other, 3, **fields), key=lambda c: c[1])[0]
    batch = client.completions.create(model=base, prompt=[PROMPT, other], n=1, best_of=3, **fields)
    best_first = max(candidates[:3], key=lambda c: c[1])[0]
    assert [c.text for c in batch.choices] == [best_first, best_other]


def test_best_of_bounds_and_streaming(make_client, base):
    client, _ = make_client()
    with pytest.raises(openai.BadRequestError, match="best_of=3 cannot be streamed"):
        client.completions.create(model=base, prompt=PROMPT, best_of=3, stream=True)
    bad = [({"best_of": 1, "n": 2}, r"best_of must be in \[n, 16\]"), ({"best_of": 17}, "16")]
    for fields, message in bad:
        with pytest.raises(openai.BadRequestError, match=message):
            client.completions.create(model=base, prompt=PROMPT, max_tokens=1, **fields)
    # Equal to n (or null) is plain sampling: it streams.
    chunks = list(
        client.completions.create(
            model=base, prompt=PROMPT, n=2, best_of=2, max_tokens=2, stream=True
        )
    )
    assert {c.index for chunk in chunks for c in chunk.choices} == {0, 1}
    assert client.completions.create(model=base, prompt=PROMPT, best_of=None, max_tokens=1)


# --- logit_bias ----------------------------------------------------------------------------


def test_logit_bias_steers_completions_and_chat(make_client, base, context):
    client, _ = make_client()
    token = context.engine.tokenizer(" banana")["input_ids"][-1]
    forced = client.completions.create(
        model=base, prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={str(token): 100}
    )
    assert forced.choices[0].text == context.engine.tokenizer.decode([token] * 3)
    # Streamed alike.
    streamed = "".join(
        chunk.choices[0].text
        for chunk in client.completions.create(
            model=base,
            prompt=PROMPT,
            max_tokens=3,
            temperature=0,
            logit_bias={str(token): 100},
            stream=True,
        )
        if chunk.choices
    )
    assert streamed == forced.choices[0].text

    # Chat: banning the greedy first token changes it.
    greedy = client.chat.completions.create(
        model=base, messages=MESSAGES, max_tokens=1, temperature=0, logprobs=True
    )
    first = greedy.choices[0].message.content
    first_id = context.engine.tokenizer(first, add_special_tokens=False)["input_ids"][0]
    banned = client.chat.completions.create(
        model=base,
        messages=MESSAGES,
        max_tokens=1,
        temperature=0,
        logit_bias={str(first_id): -100},
    )
    assert banned.choices[0].message.content != first


def test_bad_logit_bias_is_a_400_naming_the_key(make_client, base):
    client, _ = make_client()
    cases = [
        ({"abc": 1}, "logit_bias key 'abc' is not a token id"),
        ({"1.5": 1}, "logit_bias key '1.5' is not a token id"),
        ({"-3": 1}, "logit_bias key '-3' is not a token id"),
        ({"7": 100.5}, r"logit_bias\['7'\] is 100.5; a bias must be in \[-100, 100\]"),
        ({"7": -101}, r"logit_bias\['7'\] is -101"),
        ({"49152": 1}, "logit_bias key '49152' is not a token id of this model"),
    ]
    for stream in (False, True):
        for bias, message in cases:
            with pytest.raises(openai.BadRequestError, match=message):
                client.completions.create(
                    model=base, prompt=PROMPT, max_tokens=1, logit_bias=bias, stream=stream
                )
            with pytest.raises(openai.BadRequestError, match=message):
                client.chat.completions.create(
                    model=base, messages=MESSAGES, max_tokens=1, logit_bias=bias, stream=stream
                )
    with pytest.raises(openai.UnprocessableEntityError, match="logit_bias"):
        client.completions.create(model=base, prompt=PROMPT, logit_bias={"7": "high"})
    assert client.completions.create(model=base, prompt=PROMPT, max_tokens=1, logit_bias={})
