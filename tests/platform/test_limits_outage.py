"""Limits when their Redis is down: a limits error instead of a Redis one, the fail-open
and fail-closed policies, and hold releases that outlive the outage."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from loramux.platform.limits import (
    LimitsUnavailable,
    MemoryRateLimiter,
    RedisRateLimiter,
    TenantBudget,
    TenantLimits,
)
from tests.fixtures.services import RestartableRedis, private_redis

LIMITS = {"requests_per_minute": 10, "tokens_per_minute": 1000}


@pytest.fixture
def server() -> Iterator[RestartableRedis]:
    with private_redis() as running:
        yield running


@pytest.fixture
def limiter(server) -> Iterator[RedisRateLimiter]:
    made = RedisRateLimiter.from_url(server.url)
    yield made
    made.close()


def test_an_unreachable_redis_raises_a_limits_error_and_is_counted(server, limiter):
    server.stop()
    with pytest.raises(LimitsUnavailable) as raised:
        limiter.try_acquire("k", 1, capacity=5, refill_per_second=1)
    assert isinstance(raised.value.__cause__, redis.ConnectionError)
    with pytest.raises(LimitsUnavailable):
        limiter.hold("k", "h", 5, ttl_s=60)
    assert limiter.failures == 2
    server.start()  # the same limiter reaches it again: no restart of the process
    assert limiter.try_acquire("k", 1, capacity=5, refill_per_second=1).allowed
    assert limiter.failures == 2


def test_a_redis_error_that_is_no_outage_is_not_hidden(server, limiter):
    redis.Redis.from_url(server.url).set(limiter.key("k"), "not a hash")
    with pytest.raises(redis.ResponseError):  # a bug, not an outage: no policy applies
        limiter.try_acquire("k", 1, capacity=5, refill_per_second=1)
    assert limiter.failures == 0


def test_fail_closed_raises_and_fail_open_passes_unchecked(server, limiter):
    server.stop()
    with pytest.raises(LimitsUnavailable):
        TenantLimits(limiter).check_request("t", tokens_needed=10, **LIMITS)
    decision = TenantLimits(limiter, fail_open=True).check_request("t", tokens_needed=10, **LIMITS)
    assert (decision.allowed, decision.enforced) == (True, False)
    # Impossible requests and tenants without limits never need Redis: same answer as ever.
    impossible = TenantLimits(limiter).check_request("t", tokens_needed=5000, **LIMITS)
    assert not impossible.allowed and impossible.impossible
    unlimited = TenantLimits(limiter).check_request(
        "t", requests_per_minute=None, tokens_per_minute=None, tokens_needed=10
    )
    assert (unlimited.allowed, unlimited.enforced) == (True, True)


def test_fail_open_budget_counts_the_spend_alone(server, limiter):
    server.stop()
    with pytest.raises(LimitsUnavailable):
        TenantBudget(limiter).try_hold("t", 10, budget=100, spent=lambda: 0)
    budget = TenantBudget(limiter, fail_open=True)
    passed = budget.try_hold("t", 10, budget=100, spent=lambda: 90)
    assert (passed.allowed, passed.spent, passed.held, passed.hold) == (True, 90, 0, None)
    assert not budget.try_hold("t", 11, budget=100, spent=lambda: 90).allowed
    assert not budget.try_hold("t", 0, budget=100, spent=lambda: 100).allowed
    assert budget.held("t") == 0


def test_a_release_refused_by_an_outage_is_sent_once_redis_is_back(server, limiter):
    budget = TenantBudget(limiter)
    hold = budget.try_hold("t", 10, budget=100, spent=lambda: 0).hold
    assert hold is not None and budget.held("t") == 10
    server.stop()
    with pytest.raises(LimitsUnavailable):
        budget.release(hold)
    assert limiter.pending_releases == 1
    server.start()  # its append-only file kept the hold
    assert redis.Redis.from_url(server.url).hlen(limiter.key(budget.key("t"))) == 1
    assert budget.held("t") == 0  # the next operation sent the release first
    assert limiter.pending_releases == 0


def test_a_hold_is_released_when_reading_the_spend_fails():
    limiter = MemoryRateLimiter()
    budget = TenantBudget(limiter)

    def database_down() -> int:
        raise ConnectionError("database down")

    with pytest.raises(ConnectionError):
        budget.try_hold("t", 10, budget=100, spent=database_down)
    assert budget.held("t") == 0
