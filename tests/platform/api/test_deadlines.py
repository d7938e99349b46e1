"""Deadlines over HTTP: a request past its deadline ends wherever it is, with a clear error,
its engine memory freed and exactly the tokens it sent billed.

The engine's steps are slowed by a fixed sleep (``slow_steps``) so that a request is
reliably queued, prefilling or decoding when its deadline passes on the tiny model.
"""

from __future__ import annotations

import json
import time

import pytest

from loramux.platform.services.deadlines import (
    REQUEST_TIMEOUT,
    SERVER_MAXIMUM,
    TENANT_DEFAULT,
    request_deadline,
)
from loramux.platform.services.metering import Meter
from tests.platform.api.slowed_platform import (
    completion,
    engine_idle,
    post_in_background,
    sse_events,
    tenant_headers,
)

# --- which limit sets the deadline -------------------------------------------------------


def test_the_deadline_is_the_shortest_limit_and_a_request_can_only_shorten_it():
    assert request_deadline(600, None, None, admitted_at=0).source == SERVER_MAXIMUM
    tenant = request_deadline(600, 30, None, admitted_at=0)
    assert (tenant.seconds, tenant.source, tenant.expires_at) == (30, TENANT_DEFAULT, 30)
    shorter = request_deadline(600, 30, 5, admitted_at=10)
    assert (shorter.seconds, shorter.source, shorter.expires_at) == (5, REQUEST_TIMEOUT, 15)
    longer = request_deadline(600, 30, 900, admitted_at=0)  # asking for more changes nothing
    assert (longer.seconds, longer.source) == (30, TENANT_DEFAULT)
    assert request_deadline(600, None, 900, admitted_at=0).source == SERVER_MAXIMUM
    with pytest.raises(ValueError):
        request_deadline(600, None, 0)


# --- ended wherever it is -----------------------------------------------------------------


def test_a_stream_past_its_deadline_ends_with_an_error_event_and_bills_what_it_sent(
    slowed_platform,
):
    client, context = slowed_platform()
    _, headers = tenant_headers(client, context)
    started = time.monotonic()
    response = client.post(
        "/v1/completions",
        json=completion(
            context,
            max_tokens=500,
            ignore_eos=True,
            stream=True,
            timeout=0.6,
            logprobs=0,
            stream_options={"include_usage": True},
        ),
        headers=headers,
    )
    elapsed = time.monotonic() - started
    assert response.status_code == 200
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    error = next(e["error"] for e in events[:-1] if isinstance(e, dict) and "error" in e)
    assert (
        error["code"] == "deadline_exceeded" and "0.6 s (the request's timeout)" in error["message"]
    )
    chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
    sent = sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in chunks)
    assert 0 < sent < 500
    assert elapsed < 0.6 + 1.0  # ended at the deadline, not after 500 steps (10 s)
    usage = next(e["usage"] for e in events if isinstance(e, dict) and e.get("usage"))
    record = Meter(context.sessions).stored(chunks[0]["id"])
    assert record is not None and record.finish_reason == "deadline"
    assert record.completion_tokens == usage["completion_tokens"] == sent
    engine_idle(context)
    metrics = client.get("/metrics").text
    assert 'loramux_requests_expired_total{state="generating"' in metrics


def test_a_non_streamed_request_past_its_deadline_gets_504_with_what_it_is_billed_for(
    slowed_platform,
):
    client, context = slowed_platform()
    _, headers = tenant_headers(client, context)
    response = client.post(
        "/v1/completions",
        json=completion(context, max_tokens=500, ignore_eos=True, timeout=0.5, logprobs=0),
        headers=headers,
    )
    assert response.status_code == 504, response.text
    body = response.json()
    assert body["error"]["code"] == "deadline_exceeded"
    assert body["error"]["type"] == "server_error"
    partial = body["partial"]
    tokens = len(partial["choices"][0]["logprobs"]["tokens"])
    assert 0 < tokens < 500
    assert partial["usage"]["completion_tokens"] == tokens
    record = Meter(context.sessions).stored(partial["id"])
    assert record is not None and record.completion_tokens == tokens
    assert record.finish_reason == "deadline"
    engine_idle(context)


def test_a_request_expires_while_queued_and_is_not_billed(slowed_platform):
    client, context = slowed_platform(max_num_seqs=1)
    _, headers = tenant_headers(client, context)
    blocker = post_in_background(
        client,
        "/v1/completions",
        json=completion(context, max_tokens=60, ignore_eos=True),
        headers=headers,
    )
    time.sleep(0.3)  # the blocker holds the only slot
    response = client.post(
        "/v1/completions", json=completion(context, max_tokens=5, timeout=0.4), headers=headers
    )
    assert response.status_code == 504, response.text
    assert "before its first token" in response.json()["error"]["message"]
    assert response.json()["partial"]["usage"]["completion_tokens"] == 0
    assert Meter(context.sessions).stored(response.json()["partial"]["id"]) is None
    blocker.join(30)
    engine_idle(context)
    assert 'loramux_requests_expired_total{state="queued"' in client.get("/metrics").text


def test_a_request_expires_while_prefilling_and_pays_for_its_prefill(slowed_platform):
    # Chunks of 8 tokens, one per 20 ms step: a prompt of ~300 tokens takes ~0.8 s to prefill.
    client, context = slowed_platform(max_num_batched_tokens=8, max_prefill_chunk=8)
    tenant_id, headers = tenant_headers(client, context)
    prompt = " ".join(["lighthouse"] * 300)
    response = client.post(
        "/v1/completions",
        json={
            "model": context.base_model.model_id,
            "prompt": prompt,
            "max_tokens": 4,
            "timeout": 0.3,
            "stream": True,
        },
        headers=headers,
    )
    assert response.status_code == 504, response.text  # a stream's 200 waits for a token
    assert "before its first token" in response.json()["error"]["message"]
    computed = [done + n for step in context.engine.engine.executor.step_log for _, done, n in step]
    assert 8 <= max(computed) < 300  # it was part-way through its prompt
    engine_idle(context)
    # Nothing reached the client, but the engine's work is billed: the prompt it prefilled.
    admin = {"Authorization": f"Bearer {context.admin_token}"}
    params = {"tenant_id": tenant_id, "group_by": "request"}
    rows = client.get("/admin/usage", params=params, headers=admin).json()["rows"]
    assert len(rows) == 1, rows
    record = Meter(context.sessions).stored(rows[0]["request_id"])
    assert (record.prompt_tokens, record.completion_tokens) == (max(computed), 0)
    assert record.finish_reason == "deadline"


def test_the_tenant_default_applies_and_a_longer_request_timeout_does_not_lift_it(slowed_platform):
    client, context = slowed_platform()
    tenant_id, headers = tenant_headers(client, context)
    admin = {"Authorization": f"Bearer {context.admin_token}"}
    patched = client.patch(
        f"/admin/tenants/{tenant_id}", json={"request_timeout_s": 0.4}, headers=admin
    )
    assert patched.status_code == 200 and patched.json()["request_timeout_s"] == 0.4
    for extra in ({}, {"timeout": 60}):
        response = client.post(
            "/v1/completions",
            json=completion(context, max_tokens=500, ignore_eos=True, **extra),
            headers=headers,
        )
        assert response.status_code == 504, response.text
        assert "0.4 s (the tenant's default)" in response.json()["error"]["message"]
    cleared = client.patch(
        f"/admin/tenants/{tenant_id}", json={"request_timeout_s": None}, headers=admin
    )
    assert cleared.json()["request_timeout_s"] is None
    response = client.post(
        "/v1/completions", json=completion(context, max_tokens=8), headers=headers
    )
    assert response.status_code == 200


def test_the_server_maximum_applies_to_everyone(slowed_platform):
    client, context = slowed_platform(request_timeout_s=0.4)
    _, headers = tenant_headers(client, context)
    response = client.post(
        "/v1/completions",
        json=completion(context, max_tokens=500, ignore_eos=True, timeout=100),
        headers=headers,
    )
    assert response.status_code == 504
    assert "(the server's maximum)" in response.json()["error"]["message"]


@pytest.mark.parametrize("timeout", [0, -1, "5", float("inf")])
def test_a_bad_timeout_is_refused(slowed_platform, timeout):
    client, context = slowed_platform()
    _, headers = tenant_headers(client, context)
    body = json.dumps(completion(context, timeout=timeout)).replace("Infinity", "1e999")
    response = client.post(
        "/v1/completions",
        content=body,
        headers={**headers, "Content-Type": "application/json"},
    )
    assert response.status_code == 422, response.text
    assert "timeout" in response.text


@pytest.mark.parametrize("field,value", [("request_timeout_s", 0), ("max_queued_requests", 0)])
def test_the_admin_api_refuses_bad_tenant_deadlines_and_queue_limits(slowed_platform, field, value):
    client, context = slowed_platform()
    tenant_id, _ = tenant_headers(client, context)
    admin = {"Authorization": f"Bearer {context.admin_token}"}
    response = client.patch(f"/admin/tenants/{tenant_id}", json={field: value}, headers=admin)
    assert response.status_code == 422 and field in response.text
