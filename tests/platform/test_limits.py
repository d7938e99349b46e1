"""Token-bucket limits: both backends (memory, real Redis) against the same expectations."""

from __future__ import annotations

import math
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis

from loramux.platform.limits import (
    LimitDecision,
    LimitKind,
    MemoryRateLimiter,
    RateLimiter,
    RedisRateLimiter,
    TenantBudget,
    TenantLimits,
    build_rate_limiter,
)

T0 = 1_000.0  # an injected clock reading (seconds)


def _unique_prefix() -> str:
    return f"loramux:test:{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(params=["memory", "redis"])
def make_limiter(request: pytest.FixtureRequest) -> Iterator[Callable[[], RateLimiter]]:
    """A factory of limiters that share one store: the same process, or the same Redis prefix."""
    if request.param == "memory":
        shared = MemoryRateLimiter()
        yield lambda: shared
        return
    url = request.getfixturevalue("redis_url")
    prefix = _unique_prefix()
    made: list[RedisRateLimiter] = []

    def make() -> RateLimiter:
        made.append(RedisRateLimiter.from_url(url, prefix=prefix))
        return made[-1]

    yield make
    for limiter in made:
        limiter.close()


@pytest.fixture
def limiter(make_limiter: Callable[[], RateLimiter]) -> RateLimiter:
    return make_limiter()


def _level(limiter: RateLimiter, key: str, capacity: float, rate: float, now: float) -> float:
    """The bucket's level, read by acquiring nothing."""
    return limiter.try_acquire(key, 0, capacity=capacity, refill_per_second=rate, now=now).remaining


# --------------------------------------------------------------------------------------------
# RateLimiter, both backends
# --------------------------------------------------------------------------------------------


def test_capacity_is_respected_exactly(limiter):
    outcomes = [
        limiter.try_acquire("k", 1, capacity=5, refill_per_second=2, now=T0) for _ in range(6)
    ]
    assert [o.allowed for o in outcomes] == [True] * 5 + [False]
    assert [o.remaining for o in outcomes[:5]] == pytest.approx([4, 3, 2, 1, 0])
    assert all(o.retry_after_seconds == 0 for o in outcomes[:5])
    denied = outcomes[-1]
    assert denied.retry_after_seconds == pytest.approx(0.5)  # 1 token at 2/s
    assert not denied.impossible


def test_fractional_amounts(limiter):
    take = lambda: limiter.try_acquire("k", 2.5, capacity=6, refill_per_second=1, now=T0)  # noqa: E731
    assert take().allowed and take().allowed
    denied = take()
    assert not denied.allowed
    assert denied.remaining == pytest.approx(1.0)
    assert denied.retry_after_seconds == pytest.approx(1.5)


def test_denied_request_debits_nothing(limiter):
    kw = {"capacity": 3, "refill_per_second": 0.001, "now": T0}
    assert limiter.try_acquire("k", 2, **kw).allowed
    assert not limiter.try_acquire("k", 2, **kw).allowed
    assert limiter.try_acquire("k", 1, **kw).allowed  # the failed 2 did not take the last one
    assert not limiter.try_acquire("k", 1, **kw).allowed


def test_refill_over_injected_time_matches_retry_after(limiter):
    kw = {"capacity": 10, "refill_per_second": 2}
    assert limiter.try_acquire("k", 10, now=T0, **kw).allowed
    early = limiter.try_acquire("k", 1, now=T0 + 0.4, **kw)  # 0.8 tokens back
    assert not early.allowed
    assert early.remaining == pytest.approx(0.8)
    assert early.retry_after_seconds == pytest.approx(0.1)
    on_time = limiter.try_acquire("k", 1, now=T0 + 0.4 + early.retry_after_seconds, **kw)
    assert on_time.allowed
    assert on_time.remaining == pytest.approx(0.0, abs=1e-6)
    # the refill never goes above capacity, however long the bucket sits idle
    assert _level(limiter, "k", 10, 2, T0 + 3600) == pytest.approx(10)


def test_refill_over_real_time(limiter):
    """No injected clock: the backend's own (Redis TIME for Redis, monotonic in memory)."""
    kw = {"capacity": 2, "refill_per_second": 20}  # a token every 50 ms
    assert limiter.try_acquire("real", 2, **kw).allowed
    denied = limiter.try_acquire("real", 1, **kw)
    assert not denied.allowed
    assert 0 < denied.retry_after_seconds <= 0.051
    time.sleep(denied.retry_after_seconds + 0.02)
    assert limiter.try_acquire("real", 1, **kw).allowed
    time.sleep(0.12)  # full again: both tokens back, not more
    assert limiter.try_acquire("real", 2, **kw).allowed
    assert not limiter.try_acquire("real", 1, **kw).allowed


def test_amount_above_capacity_is_impossible(limiter):
    result = limiter.try_acquire("k", 6, capacity=5, refill_per_second=1, now=T0)
    assert not result.allowed
    assert result.impossible
    assert math.isinf(result.retry_after_seconds)
    assert result.remaining == pytest.approx(5)
    assert limiter.try_acquire("k", 5, capacity=5, refill_per_second=1, now=T0).allowed


def test_refund_caps_at_capacity(limiter):
    kw = {"capacity": 5, "refill_per_second": 0.001, "now": T0}
    assert limiter.try_acquire("k", 3, **kw).remaining == pytest.approx(2)
    assert limiter.refund("k", 1, **kw) == pytest.approx(3)
    assert limiter.refund("k", 100, **kw) == pytest.approx(5)
    assert limiter.refund("fresh", 100, **kw) == pytest.approx(5)
    allowed = [limiter.try_acquire("k", 1, **kw).allowed for _ in range(6)]
    assert allowed == [True] * 5 + [False]


def test_buckets_are_independent_per_key(limiter):
    kw = {"capacity": 1, "refill_per_second": 0.001, "now": T0}
    assert limiter.try_acquire("a", 1, **kw).allowed
    assert not limiter.try_acquire("a", 1, **kw).allowed
    assert limiter.try_acquire("b", 1, **kw).allowed


@pytest.mark.parametrize(
    ("amount", "capacity", "rate"),
    [(-1, 5, 1), (1, 0, 1), (1, -5, 1), (1, 5, 0), (1, 5, -1), (math.nan, 5, 1), (1, math.inf, 1)],
)
def test_invalid_arguments_are_rejected(limiter, amount, capacity, rate):
    with pytest.raises(ValueError):
        limiter.try_acquire("k", amount, capacity=capacity, refill_per_second=rate)
    with pytest.raises(ValueError):
        limiter.refund("k", amount, capacity=capacity, refill_per_second=rate)


def test_replicas_share_buckets(make_limiter):
    """Two limiter instances (two platform replicas) see one bucket per key."""
    first, second = make_limiter(), make_limiter()
    kw = {"capacity": 4, "refill_per_second": 0.001}
    assert [first.try_acquire("shared", 1, **kw).allowed for _ in range(2)] == [True, True]
    assert [second.try_acquire("shared", 1, **kw).allowed for _ in range(2)] == [True, True]
    assert not first.try_acquire("shared", 1, **kw).allowed
    assert not second.try_acquire("shared", 1, **kw).allowed
    second.refund("shared", 1, **kw)
    assert first.try_acquire("shared", 1, **kw).allowed


def test_concurrent_acquires_never_overspend(make_limiter):
    """8 threads (each with its own limiter instance) race for 50 tokens: exactly 50 pass."""
    threads_n, tries, capacity = 8, 25, 50
    limiters = [make_limiter() for _ in range(threads_n)]
    barrier = threading.Barrier(threads_n)
    allowed = [0] * threads_n

    def hammer(i: int) -> None:
        barrier.wait()
        for _ in range(tries):
            if limiters[i].try_acquire("hot", 1, capacity=capacity, refill_per_second=1e-6).allowed:
                allowed[i] += 1

    workers = [threading.Thread(target=hammer, args=(i,)) for i in range(threads_n)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=20)
    assert sum(allowed) == capacity


def test_concurrent_acquires_on_one_instance(limiter):
    """The same, all threads on one instance (one lock / one connection pool)."""
    allowed = []
    barrier = threading.Barrier(8)

    def hammer() -> None:
        barrier.wait()
        for _ in range(20):
            result = limiter.try_acquire("hot1", 1, capacity=50, refill_per_second=1e-6)
            allowed.append(result.allowed)

    workers = [threading.Thread(target=hammer) for _ in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=20)
    assert allowed.count(True) == 50
    assert len(allowed) == 160


# --------------------------------------------------------------------------------------------
# Backend specifics
# --------------------------------------------------------------------------------------------


def test_redis_keys_expire_once_full_again(redis_client):
    limiter = RedisRateLimiter(redis_client, prefix=_unique_prefix())
    key = limiter.key("idle")
    kw = {"capacity": 2, "refill_per_second": 20}  # full again 50 ms after spending one token
    assert limiter.try_acquire("idle", 1, **kw).allowed
    ttl_ms = redis_client.pttl(key)
    assert 0 < ttl_ms <= 51
    time.sleep(0.1)
    assert redis_client.exists(key) == 0
    # a refund that fills the bucket removes the key at once
    assert limiter.try_acquire("idle", 1, **kw).allowed
    assert redis_client.exists(key) == 1
    limiter.refund("idle", 1, **kw)
    assert redis_client.exists(key) == 0
    # and a denied request never creates one
    assert limiter.try_acquire("never", 3, **kw).impossible
    assert redis_client.exists(limiter.key("never")) == 0


def test_redis_ttl_covers_the_time_to_refill(redis_client):
    limiter = RedisRateLimiter(redis_client, prefix=_unique_prefix())
    limiter.try_acquire("slow", 30, capacity=60, refill_per_second=1)  # 30 s to refill
    assert 29_000 < redis_client.pttl(limiter.key("slow")) <= 30_000


def test_redis_script_is_reloaded_after_flush(redis_client):
    limiter = RedisRateLimiter(redis_client, prefix=_unique_prefix())
    kw = {"capacity": 3, "refill_per_second": 0.001, "now": T0}
    assert limiter.try_acquire("k", 1, **kw).allowed
    redis_client.script_flush()  # as after a Redis restart: EVALSHA answers NOSCRIPT
    assert limiter.try_acquire("k", 1, **kw).remaining == pytest.approx(1)


def test_redis_works_with_decoded_responses(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        limiter = RedisRateLimiter(client, prefix=_unique_prefix())
        result = limiter.try_acquire("k", 1.5, capacity=2, refill_per_second=1, now=T0)
        assert result.allowed and result.remaining == pytest.approx(0.5)
    finally:
        client.close()


def test_memory_forgets_full_buckets():
    limiter = MemoryRateLimiter(sweep_every=5)
    kw = {"capacity": 2, "refill_per_second": 1}
    limiter.try_acquire("a", 1, now=T0, **kw)
    limiter.try_acquire("b", 1, now=T0, **kw)
    assert len(limiter) == 2
    limiter.refund("a", 1, now=T0, **kw)  # full again: forgotten at once
    assert len(limiter) == 1
    # "b" refilled while idle; the next sweep (every 5th write) drops it
    limiter.try_acquire("c", 1, now=T0 + 10, **kw)
    assert len(limiter) == 2
    limiter.try_acquire("c", 1, now=T0 + 10, **kw)
    assert len(limiter) == 1


def test_memory_uses_its_clock():
    clock = [T0]
    limiter = MemoryRateLimiter(clock=lambda: clock[0])
    kw = {"capacity": 1, "refill_per_second": 4}
    assert limiter.try_acquire("k", 1, **kw).allowed
    assert limiter.try_acquire("k", 1, **kw).retry_after_seconds == pytest.approx(0.25)
    clock[0] += 0.25
    assert limiter.try_acquire("k", 1, **kw).allowed


def test_build_rate_limiter(redis_url):
    memory = build_rate_limiter(None)
    assert isinstance(memory, MemoryRateLimiter)
    remote = build_rate_limiter(redis_url)
    try:
        assert isinstance(remote, RedisRateLimiter)
        key = f"build-{uuid.uuid4().hex}"
        assert remote.try_acquire(key, 1, capacity=1, refill_per_second=1e-3).allowed
        assert not remote.try_acquire(key, 1, capacity=1, refill_per_second=1e-3).allowed
    finally:
        remote.close()


# --------------------------------------------------------------------------------------------
# TenantLimits
# --------------------------------------------------------------------------------------------


def test_requests_per_minute(limiter):
    limits = TenantLimits(limiter)
    kw = {"requests_per_minute": 3, "tokens_per_minute": None, "tokens_needed": 10, "now": T0}
    assert [limits.check_request("t1", **kw).allowed for _ in range(3)] == [True] * 3
    denied = limits.check_request("t1", **kw)
    assert not denied.allowed
    assert denied.limit is LimitKind.REQUESTS_PER_MINUTE
    assert denied.retry_after == pytest.approx(20)  # 3/min: one request back every 20 s
    assert denied.retry_after_header == "20"
    assert "3 requests per minute" in denied.reason
    assert limits.check_request("t2", **kw).allowed  # another tenant, another bucket
    assert limits.check_request("t1", **{**kw, "now": T0 + 20}).allowed


def test_tokens_per_minute(limiter):
    limits = TenantLimits(limiter)
    kw = {"requests_per_minute": None, "tokens_per_minute": 600}  # 10 tokens/s
    assert limits.check_request("t", tokens_needed=550, now=T0, **kw).allowed
    denied = limits.check_request("t", tokens_needed=100, now=T0, **kw)
    assert not denied.allowed
    assert denied.limit is LimitKind.TOKENS_PER_MINUTE
    assert denied.retry_after == pytest.approx(5)  # 50 tokens missing at 10/s
    assert "600 tokens per minute" in denied.reason
    limits.refund_tokens("t", tokens_per_minute=600, tokens=50, now=T0)  # unused reservation
    assert limits.check_request("t", tokens_needed=100, now=T0, **kw).allowed


def test_failed_token_check_refunds_the_request(limiter):
    limits = TenantLimits(limiter)
    kw = {"requests_per_minute": 2, "tokens_per_minute": 100, "now": T0}
    assert limits.check_request("t", tokens_needed=80, **kw).allowed  # rpm 1 left, tpm 20
    denied = limits.check_request("t", tokens_needed=80, **kw)  # rpm passes, tpm fails
    assert denied.limit is LimitKind.TOKENS_PER_MINUTE
    assert limits.check_request("t", tokens_needed=20, **kw).allowed  # the rpm token came back
    assert limits.check_request("t", tokens_needed=0, **kw).limit is LimitKind.REQUESTS_PER_MINUTE


def test_no_partial_debit_property(limiter):
    """Random requests at a frozen clock: allowed debits both buckets, denied neither."""
    limits = TenantLimits(limiter)
    rng = random.Random(1234)
    rpm, tpm = 7, 500
    rpm_key = TenantLimits.bucket_key("p", LimitKind.REQUESTS_PER_MINUTE)
    tpm_key = TenantLimits.bucket_key("p", LimitKind.TOKENS_PER_MINUTE)
    levels = lambda: (  # noqa: E731
        _level(limiter, rpm_key, rpm, rpm / 60, T0),
        _level(limiter, tpm_key, tpm, tpm / 60, T0),
    )
    seen = set()
    for _ in range(40):
        needed = rng.choice([0, 1, 30, 90, 200, 499, 501])
        before = levels()
        decision = limits.check_request(
            "p", requests_per_minute=rpm, tokens_per_minute=tpm, tokens_needed=needed, now=T0
        )
        after = levels()
        if decision.allowed:
            assert after == pytest.approx((before[0] - 1, before[1] - needed))
        else:
            assert after == pytest.approx(before)
        seen.add((decision.allowed, decision.limit, decision.impossible))
    assert (True, None, False) in seen
    assert (False, LimitKind.REQUESTS_PER_MINUTE, False) in seen
    assert (False, LimitKind.TOKENS_PER_MINUTE, True) in seen


def test_impossible_request_touches_nothing(limiter):
    limits = TenantLimits(limiter)
    decision = limits.check_request(
        "t", requests_per_minute=1, tokens_per_minute=100, tokens_needed=101, now=T0
    )
    assert not decision.allowed and decision.impossible
    assert decision.limit is LimitKind.TOKENS_PER_MINUTE
    assert math.isinf(decision.retry_after)
    assert decision.retry_after_header is None
    assert "can never pass" in decision.reason
    # the single request of the minute is still there
    assert limits.check_request(
        "t", requests_per_minute=1, tokens_per_minute=100, tokens_needed=100, now=T0
    ).allowed


def test_zero_limit_denies(limiter):
    limits = TenantLimits(limiter)
    decision = limits.check_request(
        "t", requests_per_minute=0, tokens_per_minute=None, tokens_needed=0
    )
    assert decision.impossible and decision.limit is LimitKind.REQUESTS_PER_MINUTE
    decision = limits.check_request(
        "t", requests_per_minute=None, tokens_per_minute=0, tokens_needed=0
    )
    assert decision.impossible and decision.limit is LimitKind.TOKENS_PER_MINUTE


def test_none_limits_are_unlimited(limiter):
    limits = TenantLimits(limiter)
    for _ in range(200):
        decision = limits.check_request(
            "t", requests_per_minute=None, tokens_per_minute=None, tokens_needed=10**9
        )
        assert decision == LimitDecision(allowed=True, retry_after=0.0)
    limits.refund_tokens("t", tokens_per_minute=None, tokens=5)  # a no-op


def test_negative_limits_are_rejected(limiter):
    limits = TenantLimits(limiter)
    with pytest.raises(ValueError):
        limits.check_request("t", requests_per_minute=-1, tokens_per_minute=None, tokens_needed=1)
    with pytest.raises(ValueError):
        limits.check_request("t", requests_per_minute=None, tokens_per_minute=10, tokens_needed=-1)


def test_retry_after_header_rounds_up():
    assert LimitDecision(False, 0.2, "x").retry_after_header == "1"
    assert LimitDecision(False, 2.0, "x").retry_after_header == "2"
    assert LimitDecision(False, 2.001, "x").retry_after_header == "3"
    assert LimitDecision(True, 0.0).retry_after_header is None


# --------------------------------------------------------------------------------------------
# Holds and the monthly budget, both backends
# --------------------------------------------------------------------------------------------


def test_holds_add_up_release_and_lapse(limiter):
    assert limiter.hold("h", "a", 10, ttl_s=60, now=T0) == 10
    assert limiter.hold("h", "b", 5, ttl_s=30, now=T0) == 15
    assert limiter.hold("h", "a", 12, ttl_s=60, now=T0) == 17  # the same id replaces
    assert limiter.held("other", now=T0) == 0
    assert limiter.release("h", "a", now=T0 + 1) == 5
    assert limiter.release("h", "a", now=T0 + 1) == 5  # twice: nothing more
    assert limiter.held("h", now=T0 + 29) == 5
    assert limiter.held("h", now=T0 + 30) == 0  # lapsed: a dead process's holds free themselves
    with pytest.raises(ValueError):
        limiter.hold("h", "c", 1, ttl_s=0)


def test_budget_counts_spent_held_and_the_request(limiter):
    budget = TenantBudget(limiter)
    first = budget.try_hold("t", 60, budget=100, spent=lambda: 30)
    assert first.allowed and (first.spent, first.held) == (30, 0)
    refused = budget.try_hold("t", 11, budget=100, spent=lambda: 30)  # 30 + 60 + 11 > 100
    assert not refused.allowed and refused.held == 60
    assert budget.held("t") == 60  # the refused one holds nothing
    assert budget.try_hold("t", 10, budget=100, spent=lambda: 30).allowed  # exactly 100
    assert not budget.try_hold("t", 0, budget=100, spent=lambda: 100).allowed  # spent it all
    budget.release(first.hold)
    assert budget.held("t") == 10


def test_parallel_budget_holds_never_overshoot(make_limiter):
    """Eight threads (each its own limiter on the shared store) hold 10 each of a budget of
    45 with nothing spent: exactly four pass."""
    budgets = [TenantBudget(make_limiter()) for _ in range(8)]
    barrier = threading.Barrier(8)
    passed = []

    def request(i: int) -> None:
        barrier.wait()
        passed.append(budgets[i].try_hold("hot", 10, budget=45, spent=lambda: 0).allowed)

    workers = [threading.Thread(target=request, args=(i,)) for i in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=20)
    assert passed.count(True) == 4
