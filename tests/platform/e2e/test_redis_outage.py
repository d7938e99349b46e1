"""A Redis outage: the test's own redis-server stops mid-run, then starts again.

Tenants with a rate limit and a budget get what ``LORAMUX_LIMITS_FAIL_OPEN`` says: served
without their rate limits and budget holds (fail-open, the default; the budget still
checked against the database), or a JSON 503 ``limits_unavailable`` (fail-closed); never
a 500 or plain text. A tenant without limits is served either way. Requests running when
Redis goes finish for their clients; their budget holds, which Redis keeps across its
restart (append-only file, as in production), are released as soon as it answers again.
Service resumes without a platform restart, and every usage row equals what its client
received.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loramux.platform.limits import RedisRateLimiter, TenantBudget
from loramux.platform.settings import Settings
from tests.fixtures.services import RestartableRedis, private_redis
from tests.platform.e2e.conftest import Platform, start_platform
from tests.platform.e2e.outage_calls import (
    Call,
    assert_billed_as_delivered,
    start_running,
    usage_rows,
)

LONG = 480  # tokens: about 2.5 s of the tiny model, far longer than stopping Redis takes


@pytest.fixture
def redis_server() -> Iterator[RestartableRedis]:
    with private_redis() as server:
        yield server


@pytest.fixture(params=[True, False], ids=["fail-open", "fail-closed"])
def platform(
    request, tmp_path, tiny_model_dir, postgres_database_url, redis_server
) -> Iterator[Platform]:
    settings = Settings(
        data_dir=tmp_path,
        model=str(tiny_model_dir),
        database_url=postgres_database_url,
        redis_url=redis_server.url,
        limits_fail_open=request.param,
    )
    with start_platform(settings) as running:
        yield running


def test_a_redis_outage_answers_as_documented_and_loses_nothing(platform, redis_server):
    fail_open = platform.context.settings.limits_fail_open
    limiter = platform.context.rate_limiter
    assert isinstance(limiter, RedisRateLimiter)
    budget = TenantBudget(limiter)
    prices = {"input_price_per_mtok": 1.0, "output_price_per_mtok": 2.0}
    limited = platform.new_tenant(
        requests_per_minute=1000, tokens_per_minute=1_000_000, monthly_budget_usd=10.0, **prices
    )
    unlimited = platform.new_tenant(**prices)
    # $0.000001 cannot pay for any prompt: refused by the budget, with or without holds
    broke = platform.new_tenant(monthly_budget_usd=0.000001, **prices)
    calls: list[Call] = []

    def send(tenant, *, stream: bool) -> Call:
        calls.append(Call(platform, tenant, stream=stream).run())
        return calls[-1]

    def served(tenant) -> None:
        for stream in (False, True):
            call = send(tenant, stream=stream)
            assert call.status == 200 and call.done and call.error is None, call
            assert call.delivered == call.max_tokens

    def refused(tenant, status: int, code: str) -> None:
        for stream in (False, True):
            call = send(tenant, stream=stream)
            assert (call.status, call.content_type) == (status, "application/json"), call
            assert call.error["code"] == code and call.error["message"], call

    # --- before ---------------------------------------------------------------------------
    served(limited)
    served(unlimited)
    refused(broke, 402, "budget_exceeded")

    # --- Redis stops while a stream and a non-streamed request run --------------------------
    running = [Call(platform, limited, stream=s, max_tokens=LONG) for s in (True, False)]
    threads = start_running(running)
    assert budget.held(limited.id) > 0  # both hold their maximum cost
    redis_server.stop()
    assert not any(call.done for call in running), "they ended before the outage began"
    for thread in threads:
        thread.join(timeout=60)
    for call in running:  # finished for their clients; their holds wait for Redis
        assert call.status == 200 and call.done and call.error is None, call
        assert (call.delivered, call.finish_reason) == (LONG, "length"), call
    assert limiter.pending_releases == 2

    # --- during the outage -------------------------------------------------------------------
    if fail_open:
        served(limited)
        refused(broke, 402, "budget_exceeded")  # the database's spend still counts
    else:
        refused(limited, 503, "limits_unavailable")
        refused(broke, 503, "limits_unavailable")
        assert "try again" in calls[-1].error["message"]
    served(unlimited)
    assert redis_server.url.split("//")[1] not in str([c.body for c in calls])  # no internals

    # --- Redis is back: the same platform serves and limits again ----------------------------
    failures = limiter.failures
    assert failures > 0
    redis_server.start()
    served(limited)
    served(unlimited)
    refused(broke, 402, "budget_exceeded")
    assert limiter.failures == failures  # every limit and hold reached Redis again
    assert limiter.pending_releases == 0
    assert budget.held(limited.id) == 0  # nothing left held (Redis kept them: released)

    calls.extend(running)
    for tenant in (limited, unlimited, broke):
        assert_billed_as_delivered(platform, tenant, calls)
    delivered = sum(call.delivered for call in calls)
    billed = sum(
        row.completion_tokens for t in (limited, unlimited) for row in usage_rows(platform, t)
    )
    statuses = sorted(call.status for call in calls)
    print(
        f"fail_open={fail_open}: {len(calls)} requests, statuses {statuses}; "
        f"delivered {delivered} tokens, billed {billed}"
    )
