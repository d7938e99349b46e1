"""Load shedding over HTTP: queue limits answer 429 with Retry-After at once, and a request
whose predicted time to first token already passes its deadline 503 at once; both are
counted per tenant in /metrics and use none of the tenant's limits.

One sequence slot and engine steps slowed to 20 ms (``slowed_platform``) make the queue
deterministic: a long request holds the slot while others wait behind it.
"""

from __future__ import annotations

import time

from loramux.platform.services.load_shedding import MIN_SAMPLES
from tests.platform.api.slowed_platform import (
    completion,
    engine_idle,
    post_in_background,
    tenant_headers,
)

HOLD = {"max_tokens": 60, "ignore_eos": True}  # ~1.2 s of 20 ms steps


def hold_the_slot(client, context, headers):
    """A background request that takes the only slot; returns once it has its first token
    (it has left the platform's queue)."""
    thread = post_in_background(
        client, "/v1/completions", json=completion(context, **HOLD), headers=headers
    )
    load = client.app.state.load_control
    wait_for(lambda: context.engine.engine.scheduler.running and load.queued() == 0)
    return thread


def queue_behind(client, context, headers, count: int, before: int = 0):
    threads = [
        post_in_background(
            client, "/v1/completions", json=completion(context, max_tokens=2), headers=headers
        )
        for _ in range(count)
    ]
    wait_for(lambda: len(context.engine.engine.scheduler.waiting) >= before + count)
    return threads


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def shed_count(client, tenant_id: str, reason: str) -> float:
    prefix = f'loramux_requests_shed_total{{reason="{reason}",tenant="{tenant_id}"}} '
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    return 0.0


def test_a_tenant_over_its_queue_limit_gets_429_at_once_and_others_still_queue(slowed_platform):
    client, context = slowed_platform(max_num_seqs=1)
    busy_id, busy = tenant_headers(client, context, max_queued_requests=2)
    _, other = tenant_headers(client, context)
    threads = [hold_the_slot(client, context, busy)]
    threads += queue_behind(client, context, busy, 2)
    started = time.monotonic()
    response = client.post("/v1/completions", json=completion(context), headers=busy)
    assert time.monotonic() - started < 0.5  # refused at once, not after waiting
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
    assert "your queue holds 2 of at most 2" in error["message"]
    assert int(response.headers["Retry-After"]) >= 1
    assert shed_count(client, busy_id, "queue_full") == 1
    # Another tenant's queue is its own.
    threads += queue_behind(client, context, other, 1, before=2)
    # More choices than the limit could ever hold: a 400, not a wait.
    response = client.post("/v1/completions", json=completion(context, n=3), headers=busy)
    assert response.status_code == 400 and "send fewer choices" in response.text
    for thread in threads:
        thread.join(30)
    engine_idle(context)
    metrics = client.get("/metrics").text
    assert f'loramux_platform_queued_requests{{tenant="{busy_id}"}} 0.0' in metrics


def test_the_servers_queue_limit_covers_every_tenant(slowed_platform):
    client, context = slowed_platform(max_num_seqs=1, max_queued_requests=2)
    _, first = tenant_headers(client, context)
    third_id, third = tenant_headers(client, context)
    threads = [hold_the_slot(client, context, first)]
    threads += queue_behind(client, context, first, 2)
    response = client.post("/v1/completions", json=completion(context), headers=third)
    assert response.status_code == 429
    assert "the server's queue holds 2 of at most 2" in response.json()["error"]["message"]
    assert shed_count(client, third_id, "queue_full") == 1
    for thread in threads:
        thread.join(30)


def test_a_request_that_would_start_after_its_deadline_gets_503_at_once(slowed_platform):
    client, context = slowed_platform(max_num_seqs=1)
    tenant_id, headers = tenant_headers(client, context, requests_per_minute=100)
    _, urgent = tenant_headers(client, context, priority=9)
    for _ in range(MIN_SAMPLES):  # the rates are measured from served requests
        assert (
            client.post(
                "/v1/completions", json=completion(context, **HOLD), headers=headers
            ).status_code
            == 200
        )
    threads = [hold_the_slot(client, context, headers)]
    threads += queue_behind(client, context, headers, 3)
    # 3 queued ahead, each holding the slot ~1.2 s: the first token is ~3.6 s away.
    started = time.monotonic()
    response = client.post(
        "/v1/completions", json=completion(context, max_tokens=2, timeout=1.0), headers=headers
    )
    assert time.monotonic() - started < 0.5
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "deadline_unattainable"
    assert (
        "3 queued ahead" in error["message"] and "1 s (the request's timeout)" in error["message"]
    )
    assert int(response.headers["Retry-After"]) >= 2
    assert shed_count(client, tenant_id, "deadline_unattainable") == 1
    # Without a short deadline it queues; at priority 9 nothing is ahead of it.
    threads += queue_behind(client, context, headers, 1, before=3)
    response = client.post(
        "/v1/completions", json=completion(context, max_tokens=2, timeout=2.0), headers=urgent
    )
    assert response.status_code == 200, response.text
    for thread in threads:
        thread.join(30)
    engine_idle(context)
