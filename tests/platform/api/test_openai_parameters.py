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
