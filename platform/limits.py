"""Per-tenant rate limits as token buckets: in memory (embedded default) or shared in Redis.

The maths
---------
A bucket has a ``capacity`` C (tokens) and refills continuously at ``r`` tokens per second.
Its state is the level ``L`` it held at the instant ``t0`` it was last written. At time ``t``
the level is

    L(t) = min(C, L + (t - t0) · r)            (a bucket never written, or expired, is full)

A request that needs ``a`` tokens passes iff ``L(t) >= a``; the bucket is then debited
(``L <- L(t) - a``, ``t0 <- t``). Otherwise nothing changes and the request can pass after

    retry_after = (a - L(t)) / r               (rounded up to the millisecond)

seconds, assuming nobody else spends tokens meanwhile. A request with ``a > C`` can never pass:
it is reported as ``impossible`` with ``retry_after = inf``. A refund of ``a`` tokens sets
``L <- min(C, L(t) + a)``: a reservation returned, never pushing the bucket above its capacity.

Over any window of ``T`` seconds a bucket lets through at most ``C + r·T`` tokens: bursts up to
``C``, a sustained rate of ``r``. For "N per minute" limits, ``C = N`` and ``r = N / 60``.

A bucket is full again ``(C - L) / r`` seconds after its last write; from then on it is the same
as no bucket at all. The Redis backend therefore sets the key's expiry to that time (and deletes
the key when an operation leaves it full) so idle tenants cost no memory; the memory backend
drops full buckets the same way, sweeping now and then.

Holds
-----
The same store keeps *holds*: amounts set aside under a key until released, each under
its own id, for what a limit must count while it is in use rather than after (a monthly
budget's running requests: :class:`TenantBudget`). ``hold`` adds one and returns the key's
total held, this one included, in one atomic step; ``release`` drops one. Every hold
lapses ``ttl_s`` after it was taken, so the holds of a process that died without
releasing them free themselves.

Backends
--------
:class:`MemoryRateLimiter` keeps buckets in a dict under a lock (one process: the embedded
default). :class:`RedisRateLimiter` runs the same maths in one Lua script per operation, atomic
on the server, with the time taken from Redis ``TIME``, so every platform replica sharing the
Redis shares the buckets and no replica's clock skew matters.

:class:`TenantLimits` applies a tenant's requests/minute and tokens/minute limits to one request
with no partial debit: when one bucket passes and the other does not, the one that passed is
refunded. Its :class:`LimitDecision` carries what an HTTP 429 needs (``Retry-After``, a message).
:class:`TenantBudget` holds each running request's maximum cost against the tenant's monthly
budget, so parallel requests cannot all pass one check and overshoot together.

Outages
-------
Only Redis can be out of reach. Its operations then raise :class:`LimitsUnavailable`
(never a ``redis`` error), and the policy the limits were built with decides. Fail-closed
(``fail_open=False``) lets it propagate: the platform refuses the request (503
``limits_unavailable``). Fail-open lets the request through with its rate limits
unchecked (``LimitDecision.enforced`` is False) and checks its budget against what the
database says was spent, without a hold: requests running at once during the outage
do not see each other, so together they may pass the budget by at most their maximum
costs. Either way the outage is logged. A hold release that cannot reach Redis is kept
and sent again before the limiter's next operation that reaches it, so a request that
ended during an outage does not keep its hold once Redis is back (the hold's lapse after
``ttl_s`` is the backstop, e.g. for a process that dies first).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import redis

RETRY_AFTER_RESOLUTION_S = 0.001
"""``retry_after_seconds`` is rounded up to a multiple of this (Redis expiry works in ms too)."""

_EPSILON = 1e-9
"""Slack on "level >= amount" so float rounding of a refill never refuses a whole token."""

MAX_PENDING_RELEASES = 10_000
"""Hold releases kept through a Redis outage (beyond that the oldest are dropped: they
lapse after their TTL anyway)."""

logger = logging.getLogger(__name__)


class LimitsUnavailable(RuntimeError):
    """The limits' store (Redis) could not be reached; what the operation did is unknown."""


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Acquired:
    """Outcome of :meth:`RateLimiter.try_acquire`."""

    allowed: bool
    retry_after_seconds: float  # 0 when allowed; inf when impossible; else seconds, ms-rounded up
    remaining: float  # the bucket's level after this call (after the debit when allowed)
    impossible: bool = False  # amount > capacity: it will never pass, however long one waits


class LimitKind(enum.StrEnum):
    """Which of a tenant's limits a decision is about."""

    REQUESTS_PER_MINUTE = "requests_per_minute"
    TOKENS_PER_MINUTE = "tokens_per_minute"


@dataclass(frozen=True, slots=True)
class LimitDecision:
    """Outcome of :meth:`TenantLimits.check_request`: allowed, or why not and when to retry."""

    allowed: bool
    retry_after: float  # seconds; 0 when allowed, inf when the request can never pass
    reason: str | None = None  # a message for the client when denied
    limit: LimitKind | None = None  # the limit that denied it
    impossible: bool = False  # denied whatever the wait (needs more than the limit's capacity)
    enforced: bool = True  # False: allowed unchecked (store unreachable, fail-open): no debit

    @property
    def retry_after_header(self) -> str | None:
        """The HTTP ``Retry-After`` value (whole seconds, at least 1), or None when not useful."""
        if self.allowed or self.impossible:
            return None
        return str(max(1, math.ceil(self.retry_after - _EPSILON)))


def _round_up(seconds: float) -> float:
    """``seconds`` rounded up to :data:`RETRY_AFTER_RESOLUTION_S` (tiny float noise ignored)."""
    steps = math.ceil(seconds / RETRY_AFTER_RESOLUTION_S - _EPSILON)
    return max(steps, 1) * RETRY_AFTER_RESOLUTION_S


def _check_bucket(capacity: float, refill_per_second: float) -> None:
    if not (math.isfinite(capacity) and capacity > 0):
        raise ValueError(f"capacity must be a positive finite number, got {capacity!r}")
    if not (math.isfinite(refill_per_second) and refill_per_second > 0):
        raise ValueError(
            f"refill_per_second must be a positive finite number, got {refill_per_second!r}"
        )


def _check_amount(amount: float) -> None:
    if not (math.isfinite(amount) and amount >= 0):
        raise ValueError(f"amount must be a non-negative finite number, got {amount!r}")


# --------------------------------------------------------------------------------------------
# The interface
# --------------------------------------------------------------------------------------------


class RateLimiter(ABC):
    """Token buckets addressed by key. Subclasses store the state; the maths is shared.

    ``now`` (seconds) is for tests: leave it None in production so the backend's own clock is
    used (``time.monotonic`` in memory, Redis ``TIME`` in Redis). One bucket must always see
    the same kind of clock.
    """

    def try_acquire(
        self,
        key: str,
        amount: float,
        *,
        capacity: float,
        refill_per_second: float,
        now: float | None = None,
    ) -> Acquired:
        """Debit ``amount`` tokens from bucket ``key`` if it holds that many; else debit nothing."""
        _check_bucket(capacity, refill_per_second)
        _check_amount(amount)
        allowed, level = self._take(key, amount, capacity, refill_per_second, now)
        if allowed:
            return Acquired(allowed=True, retry_after_seconds=0.0, remaining=level)
        if amount > capacity:
            return Acquired(False, retry_after_seconds=math.inf, remaining=level, impossible=True)
        wait = _round_up((amount - level) / refill_per_second)
        return Acquired(allowed=False, retry_after_seconds=wait, remaining=level)

    def refund(
        self,
        key: str,
        amount: float,
        *,
        capacity: float,
        refill_per_second: float,
        now: float | None = None,
    ) -> float:
        """Give ``amount`` tokens back to bucket ``key`` (capped at ``capacity``); return its level."""
        _check_bucket(capacity, refill_per_second)
        _check_amount(amount)
        return self._give(key, amount, capacity, refill_per_second, now)

    def hold(
        self, key: str, hold_id: str, amount: float, *, ttl_s: float, now: float | None = None
    ) -> float:
        """Set ``amount`` aside under ``key`` as ``hold_id`` (replacing a hold of that id)
        until released or ``ttl_s`` from now; the key's total held, this one included."""
        _check_amount(amount)
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise ValueError(f"ttl_s must be a positive finite number, got {ttl_s!r}")
        return self._hold(key, hold_id, amount, ttl_s, now)

    def release(self, key: str, hold_id: str, *, now: float | None = None) -> float:
        """Drop the hold ``hold_id`` under ``key`` (gone already: nothing); the total left."""
        return self._hold(key, hold_id, None, None, now)

    def held(self, key: str, *, now: float | None = None) -> float:
        """The total of the live holds under ``key``."""
        return self._hold(key, None, None, None, now)

    def close(self) -> None:  # noqa: B027 - a no-op unless the backend holds a connection
        """Release what the limiter holds (connections). A no-op by default."""

    def ping(self) -> None:  # noqa: B027 - memory is always there
        """Return if the limiter's store answers; :class:`LimitsUnavailable` if not."""

    @abstractmethod
    def _hold(
        self,
        key: str,
        hold_id: str | None,
        amount: float | None,
        ttl_s: float | None,
        now: float | None,
    ) -> float:
        """Atomically: drop lapsed holds; with an ``amount``, set hold ``hold_id``; with
        only a ``hold_id``, drop it. -> the total of the holds left under ``key``."""

    @abstractmethod
    def _take(
        self, key: str, amount: float, capacity: float, rate: float, now: float | None
    ) -> tuple[bool, float]:
        """Atomically: refill, then debit ``amount`` if the level allows. -> (allowed, level)."""

    @abstractmethod
    def _give(
        self, key: str, amount: float, capacity: float, rate: float, now: float | None
    ) -> float:
        """Atomically: refill, then add ``amount`` (capped at ``capacity``). -> level."""


# --------------------------------------------------------------------------------------------
# In memory
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Bucket:
    level: float  # tokens held at `updated_at`
    updated_at: float  # clock seconds of the last write
    full_at: float  # clock seconds when it will be full again (then it can be forgotten)


class MemoryRateLimiter(RateLimiter):
    """Buckets in a dict, one lock around every operation: for a single process.

    Full buckets are forgotten (a missing bucket is a full one): at once when an operation
    leaves a bucket full, and by a sweep every ``sweep_every`` writes for buckets that filled
    up while idle, so memory stays proportional to the tenants active in the last refill time.
    """

    def __init__(
        self, *, clock: Callable[[], float] = time.monotonic, sweep_every: int = 1024
    ) -> None:
        if sweep_every < 1:
            raise ValueError(f"sweep_every must be >= 1, got {sweep_every}")
        self._clock = clock
        self._sweep_every = sweep_every
        self._writes = 0
        self._buckets: dict[str, _Bucket] = {}
        self._holds: dict[str, dict[str, tuple[float, float]]] = {}  # key -> id -> (amount, until)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """How many buckets are held (those not known to be full)."""
        with self._lock:
            return len(self._buckets)

    def _level(self, key: str, capacity: float, rate: float, now: float) -> float:
        bucket = self._buckets.get(key)
        if bucket is None:
            return capacity
        elapsed = max(0.0, now - bucket.updated_at)
        return min(capacity, bucket.level + elapsed * rate)

    def _store(self, key: str, level: float, capacity: float, rate: float, now: float) -> None:
        if level >= capacity:
            self._buckets.pop(key, None)
        else:
            self._buckets[key] = _Bucket(level, now, now + (capacity - level) / rate)
        self._writes += 1
        if self._writes % self._sweep_every == 0:
            idle = [k for k, b in self._buckets.items() if b.full_at <= now]
            for k in idle:
                del self._buckets[k]

    def _take(
        self, key: str, amount: float, capacity: float, rate: float, now: float | None
    ) -> tuple[bool, float]:
        with self._lock:
            t = self._clock() if now is None else now
            level = self._level(key, capacity, rate, t)
            if level + _EPSILON < amount:
                return False, level  # nothing written: the old state still describes the bucket
            level = max(0.0, level - amount)
            self._store(key, level, capacity, rate, t)
            return True, level

    def _give(
        self, key: str, amount: float, capacity: float, rate: float, now: float | None
    ) -> float:
        with self._lock:
            t = self._clock() if now is None else now
            level = min(capacity, self._level(key, capacity, rate, t) + amount)
            self._store(key, level, capacity, rate, t)
            return level

    def _hold(
        self,
        key: str,
        hold_id: str | None,
        amount: float | None,
        ttl_s: float | None,
        now: float | None,
    ) -> float:
        with self._lock:
            t = self._clock() if now is None else now
            holds = {
                i: (a, until) for i, (a, until) in self._holds.get(key, {}).items() if until > t
            }
            if hold_id is not None:
                if amount is None:
                    holds.pop(hold_id, None)
                else:
                    assert ttl_s is not None
                    holds[hold_id] = (amount, t + ttl_s)
            if holds:
                self._holds[key] = holds
            else:
                self._holds.pop(key, None)
            return sum(a for a, _ in holds.values())


# --------------------------------------------------------------------------------------------
# In Redis
# --------------------------------------------------------------------------------------------

# One script for both operations. KEYS[1]: the bucket, a hash {level, ts}.
# ARGV: capacity, refill per second, amount, now in seconds ('' = Redis TIME),
#       mode ('take' debits if the level allows; 'give' refunds).
# Returns {allowed (0/1), level as a string}: Lua numbers returned to Redis become integers,
# so the level travels as text ("%.17g" round-trips a double).
_BUCKET_LUA = """
if redis.replicate_commands then redis.replicate_commands() end
local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local amount = tonumber(ARGV[3])
local now
if ARGV[4] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  now = tonumber(ARGV[4])
end

local level = capacity
local state = redis.call('HMGET', KEYS[1], 'level', 'ts')
if state[1] and state[2] then
  local elapsed = math.max(0, now - tonumber(state[2]))
  level = math.min(capacity, tonumber(state[1]) + elapsed * rate)
end

local allowed = 1
if ARGV[5] == 'take' then
  if level + 1e-9 < amount then
    allowed = 0
  else
    level = math.max(0, level - amount)
  end
else
  level = math.min(capacity, level + amount)
end

if allowed == 1 then
  -- ms until full again; a full bucket is the same as no key at all
  local ms_to_full = math.min(math.ceil((capacity - level) / rate * 1000), 1e12)
  if ms_to_full <= 0 then
    redis.call('DEL', KEYS[1])
  else
    redis.call('HSET', KEYS[1], 'level', string.format('%.17g', level),
               'ts', string.format('%.17g', now))
    redis.call('PEXPIRE', KEYS[1], string.format('%d', ms_to_full))
  end
end
return {allowed, string.format('%.17g', level)}
"""


# Holds: KEYS[1] is a hash {hold id: "amount until"} (until: server seconds).
# ARGV: hold id ('' = none), amount ('' = release the hold), ttl seconds, now ('' = Redis TIME).
# Drops lapsed holds, applies the change, keeps the key until its last hold lapses, and
# returns the total held as a string.
_HOLDS_LUA = """
if redis.replicate_commands then redis.replicate_commands() end
local now
if ARGV[4] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  now = tonumber(ARGV[4])
end
local total = 0
local last = 0
local entries = redis.call('HGETALL', KEYS[1])
for i = 1, #entries, 2 do
  local amount, expires = string.match(entries[i + 1], '^(%S+) (%S+)$')
  amount, expires = tonumber(amount), tonumber(expires)
  if expires <= now or (entries[i] == ARGV[1] and ARGV[1] ~= '') then
    redis.call('HDEL', KEYS[1], entries[i])
  else
    total = total + amount
    last = math.max(last, expires)
  end
end
if ARGV[1] ~= '' and ARGV[2] ~= '' then
  local amount = tonumber(ARGV[2])
  local expires = now + tonumber(ARGV[3])
  redis.call('HSET', KEYS[1], ARGV[1],
             string.format('%.17g', amount) .. ' ' .. string.format('%.17g', expires))
  total = total + amount
  last = math.max(last, expires)
end
if last > 0 then
  redis.call('PEXPIRE', KEYS[1], math.max(1, math.ceil((last - now) * 1000)))
end
return string.format('%.17g', total)
"""


class RedisRateLimiter(RateLimiter):
    """Buckets in Redis, each operation one atomic Lua script timed by the server's clock.

    Every replica pointing at the same Redis (and ``prefix``) shares the buckets. The script is
    sent by SHA (``EVALSHA``) and loaded on ``NOSCRIPT``, e.g. after a Redis restart. When
    Redis cannot be reached an operation raises :class:`LimitsUnavailable` (counted in
    ``failures``): whether to fail open or closed is the caller's call. A release that
    failed so is sent again before the next operation.
    """

    def __init__(
        self, client: redis.Redis, *, prefix: str = "loramux:rl:", owns_client: bool = False
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._owns_client = owns_client
        self._script = client.register_script(_BUCKET_LUA)
        self._holds_script = client.register_script(_HOLDS_LUA)
        self.failures = 0  # operations that could not reach Redis, since this limiter was made
        # (Redis key, hold id) of releases an outage stopped, oldest first
        self._pending_releases: dict[tuple[str, str], None] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, *, prefix: str = "loramux:rl:") -> RedisRateLimiter:
        """A limiter with its own client for ``url``, closed by :meth:`close`."""
        return cls(redis.Redis.from_url(url), prefix=prefix, owns_client=True)

    def key(self, key: str) -> str:
        """The Redis key that holds bucket ``key``."""
        return f"{self._prefix}{key}"

    def close(self) -> None:
        if self._owns_client:
            self._client.close()

    def ping(self) -> None:
        try:
            self._client.ping()
        except _UNREACHABLE as exc:
            with self._lock:
                self.failures += 1
            raise LimitsUnavailable(f"Redis is unreachable: {exc}") from exc

    @property
    def pending_releases(self) -> int:
        """Hold releases an outage stopped, not sent yet."""
        return len(self._pending_releases)

    def _call(self, script, redis_key: str, args: list[str]):
        """Run ``script`` on ``redis_key`` (pending releases first); LimitsUnavailable when
        Redis cannot be reached (a Lua or usage error is a bug: it propagates as it is)."""
        try:
            self._send_pending_releases()
            return script(keys=[redis_key], args=args)
        except _UNREACHABLE as exc:
            with self._lock:
                self.failures += 1
            raise LimitsUnavailable(f"Redis is unreachable: {exc}") from exc

    def _keep_release(self, redis_key: str, hold_id: str) -> None:
        with self._lock:
            self._pending_releases[(redis_key, hold_id)] = None
            while len(self._pending_releases) > MAX_PENDING_RELEASES:
                del self._pending_releases[next(iter(self._pending_releases))]

    def _send_pending_releases(self) -> None:
        """Send the releases an outage stopped, oldest first; a Redis error propagates
        (what is left stays pending). Releasing twice is harmless: hold ids are unique."""
        while self._pending_releases:
            with self._lock:
                if not self._pending_releases:
                    return
                redis_key, hold_id = next(iter(self._pending_releases))
            self._holds_script(keys=[redis_key], args=[hold_id, "", "", ""])
            with self._lock:
                self._pending_releases.pop((redis_key, hold_id), None)

    def _run(
        self, mode: str, key: str, amount: float, capacity: float, rate: float, now: float | None
    ) -> tuple[bool, float]:
        args = [repr(float(capacity)), repr(float(rate)), repr(float(amount))]
        args += ["" if now is None else repr(float(now)), mode]
        allowed, level = self._call(self._script, self.key(key), args)
        return bool(int(allowed)), float(level)

    def _take(
        self, key: str, amount: float, capacity: float, rate: float, now: float | None
    ) -> tuple[bool, float]:
        return self._run("take", key, amount, capacity, rate, now)

    def _give(
        self, key: str, amount: float, capacity: float, rate: float, now: float | None
    ) -> float:
        return self._run("give", key, amount, capacity, rate, now)[1]

    def _hold(
        self,
        key: str,
        hold_id: str | None,
        amount: float | None,
        ttl_s: float | None,
        now: float | None,
    ) -> float:
        args = [
            hold_id or "",
            "" if amount is None else repr(float(amount)),
            "" if ttl_s is None else repr(float(ttl_s)),
            "" if now is None else repr(float(now)),
        ]
        try:
            return float(self._call(self._holds_script, self.key(key), args))
        except LimitsUnavailable:
            if hold_id is not None and amount is None:  # a release: sent once Redis answers
                self._keep_release(self.key(key), hold_id)
            raise


# Redis errors that mean "not reachable now" (down, restarting, loading its data, failed
# over to a read-only replica), as opposed to a bug in a script or a call.
_UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError)


def build_rate_limiter(redis_url: str | None) -> RateLimiter:
    """The limiter settings ask for: Redis at ``redis_url``, or in memory when it is None."""
    if redis_url is None:
        return MemoryRateLimiter()
    return RedisRateLimiter.from_url(redis_url)


# --------------------------------------------------------------------------------------------
# A tenant's limits
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _BucketSpec:
    kind: LimitKind
    key: str
    capacity: float

    @property
    def rate(self) -> float:
        return self.capacity / 60.0  # N per minute


class TenantLimits:
    """A tenant's requests/minute and tokens/minute limits, applied to one request at a time.

    ``check_request`` debits one request and ``tokens_needed`` tokens (reserve the most the
    request can use: prompt + ``max_tokens``; give back the unused part with
    :meth:`refund_tokens`), both or neither. A limit of None is unlimited; a limit of 0 denies
    everything. When the store is unreachable ``check_request`` raises
    :class:`LimitsUnavailable`, or with ``fail_open`` allows the request unchecked
    (``enforced=False``: nothing debited, so nothing to refund).
    """

    def __init__(self, limiter: RateLimiter, *, fail_open: bool = False) -> None:
        self._limiter = limiter
        self._fail_open = fail_open

    @staticmethod
    def bucket_key(tenant_id: str, kind: LimitKind) -> str:
        """The limiter key of a tenant's bucket for ``kind``."""
        suffix = "rpm" if kind is LimitKind.REQUESTS_PER_MINUTE else "tpm"
        return f"tenant:{tenant_id}:{suffix}"

    @classmethod
    def _spec(cls, tenant_id: str, kind: LimitKind, per_minute: float) -> _BucketSpec:
        if not (math.isfinite(per_minute) and per_minute >= 0):
            raise ValueError(
                f"{kind.value} must be None or a finite number >= 0, got {per_minute!r}"
            )
        return _BucketSpec(kind, cls.bucket_key(tenant_id, kind), float(per_minute))

    def check_request(
        self,
        tenant_id: str,
        *,
        requests_per_minute: float | None,
        tokens_per_minute: float | None,
        tokens_needed: float,
        now: float | None = None,
    ) -> LimitDecision:
        """Allow the request and debit both limits, or deny it and debit neither."""
        _check_amount(tokens_needed)
        wanted: list[tuple[_BucketSpec, float]] = []
        if requests_per_minute is not None:
            wanted.append(
                (self._spec(tenant_id, LimitKind.REQUESTS_PER_MINUTE, requests_per_minute), 1.0)
            )
        if tokens_per_minute is not None:
            wanted.append(
                (
                    self._spec(tenant_id, LimitKind.TOKENS_PER_MINUTE, tokens_per_minute),
                    tokens_needed,
                )
            )

        for spec, amount in wanted:  # reject what can never pass before touching any bucket
            if spec.capacity <= 0 or amount > spec.capacity:
                return _impossible(spec, amount)
        try:
            return self._take_all(wanted, now)
        except LimitsUnavailable as exc:
            if not self._fail_open:
                raise
            logger.warning(
                "limits store unreachable (%s): a request of tenant %s passes its rate "
                "limits unchecked (fail-open)",
                exc,
                tenant_id,
            )
            return LimitDecision(allowed=True, retry_after=0.0, enforced=False)

    def _take_all(
        self, wanted: list[tuple[_BucketSpec, float]], now: float | None
    ) -> LimitDecision:
        """Debit every bucket, or (one denies) refund those taken and say why."""
        taken: list[tuple[_BucketSpec, float]] = []
        for spec, amount in wanted:
            result = self._limiter.try_acquire(
                spec.key, amount, capacity=spec.capacity, refill_per_second=spec.rate, now=now
            )
            if not result.allowed:
                for done, done_amount in taken:  # no partial debit
                    self._limiter.refund(
                        done.key,
                        done_amount,
                        capacity=done.capacity,
                        refill_per_second=done.rate,
                        now=now,
                    )
                return _denied(spec, result.retry_after_seconds)
            taken.append((spec, amount))
        return LimitDecision(allowed=True, retry_after=0.0)

    def refund_tokens(
        self,
        tenant_id: str,
        *,
        tokens_per_minute: float | None,
        tokens: float,
        now: float | None = None,
    ) -> None:
        """Give back reserved tokens a request did not use (capped at the limit)."""
        if tokens_per_minute is None or tokens_per_minute <= 0 or tokens <= 0:
            return
        spec = self._spec(tenant_id, LimitKind.TOKENS_PER_MINUTE, tokens_per_minute)
        self._limiter.refund(
            spec.key, tokens, capacity=spec.capacity, refill_per_second=spec.rate, now=now
        )


def _describe(spec: _BucketSpec) -> str:
    unit = "requests" if spec.kind is LimitKind.REQUESTS_PER_MINUTE else "tokens"
    return f"{spec.capacity:g} {unit} per minute"


def _impossible(spec: _BucketSpec, amount: float) -> LimitDecision:
    if spec.capacity <= 0:
        reason = f"this tenant's {spec.kind.value} limit is 0: no requests are allowed"
    else:
        reason = (
            f"the request needs {amount:g} tokens, more than this tenant's limit of "
            f"{_describe(spec)}: it can never pass; lower max_tokens or shorten the prompt"
        )
    return LimitDecision(
        allowed=False, retry_after=math.inf, reason=reason, limit=spec.kind, impossible=True
    )


def _denied(spec: _BucketSpec, retry_after: float) -> LimitDecision:
    reason = f"rate limit of {_describe(spec)} exceeded; retry in {retry_after:.3f} s"
    return LimitDecision(allowed=False, retry_after=retry_after, reason=reason, limit=spec.kind)


# --------------------------------------------------------------------------------------------
# A tenant's monthly budget
# --------------------------------------------------------------------------------------------

BUDGET_HOLD_TTL_S = 900.0
"""A budget hold lapses after this long even if never released (its process died). A request
running longer is then covered by its journaled usage only (it is in ``spent``), so at most
its undelivered rest goes unheld."""


@dataclass(frozen=True, slots=True)
class BudgetHold:
    """One running request's maximum cost, held against its tenant's budget until released."""

    tenant_id: str
    hold_id: str
    amount: int  # micro-dollars


@dataclass(frozen=True, slots=True)
class BudgetDecision:
    """Outcome of :meth:`TenantBudget.try_hold`."""

    allowed: bool
    spent: int  # micro-dollars this month, as read after the hold was taken
    held: int  # micro-dollars held by the tenant's other running requests
    hold: BudgetHold | None = None  # when allowed: release it when the request ends


class TenantBudget:
    """A monthly budget that counts what running requests may still cost.

    A request passes iff ``spent + held + its maximum cost <= budget`` (and ``spent <
    budget``), where ``held`` is the sum of the maximum costs of the tenant's other running
    requests, on every replica sharing the store. The request's own maximum is held until
    :meth:`release`. ``spent`` includes what running requests have already journaled, so a
    request's delivered part is counted twice while it runs: the check errs on the side of
    refusing, never of overshooting.

    Race-free without a lock: the hold is taken first and ``spent`` read after it. A request
    that ends writes its usage before it releases its hold, so a concurrent check sees it in
    ``held`` (released after our hold) or in ``spent`` (released before, hence written before
    our read); and of two concurrent holds, the later one sees the earlier.
    """

    def __init__(
        self, limiter: RateLimiter, *, ttl_s: float = BUDGET_HOLD_TTL_S, fail_open: bool = False
    ) -> None:
        self._limiter = limiter
        self._ttl_s = ttl_s
        self._fail_open = fail_open

    @staticmethod
    def key(tenant_id: str) -> str:
        """The store key of a tenant's budget holds."""
        return f"tenant:{tenant_id}:budget"

    def held(self, tenant_id: str) -> int:
        """Micro-dollars held by the tenant's running requests now (fail-open, with the
        store unreachable: 0)."""
        try:
            return round(self._limiter.held(self.key(tenant_id)))
        except LimitsUnavailable:
            if not self._fail_open:
                raise
            return 0

    def try_hold(
        self, tenant_id: str, amount: int, *, budget: int, spent: Callable[[], int]
    ) -> BudgetDecision:
        """Hold ``amount`` if the budget has room for it; ``spent()`` reads this month's cost.

        With the store unreachable: :class:`LimitsUnavailable`, or with ``fail_open`` the
        budget checked against ``spent()`` alone, and no hold.
        """
        if amount < 0:
            raise ValueError(f"amount must be >= 0, got {amount}")
        hold_id = uuid.uuid4().hex
        try:
            total = self._limiter.hold(self.key(tenant_id), hold_id, amount, ttl_s=self._ttl_s)
        except LimitsUnavailable as exc:
            if not self._fail_open:
                raise
            return self._without_hold(tenant_id, amount, budget, spent(), exc)
        try:
            spent_now = spent()
        except BaseException:  # the database failed: the hold must not outlive the refusal
            with contextlib.suppress(LimitsUnavailable):
                self._limiter.release(self.key(tenant_id), hold_id)
            raise
        others = max(0, round(total) - amount)
        if spent_now >= budget or spent_now + others + amount > budget:
            self._limiter.release(self.key(tenant_id), hold_id)
            return BudgetDecision(allowed=False, spent=spent_now, held=others)
        return BudgetDecision(
            allowed=True,
            spent=spent_now,
            held=others,
            hold=BudgetHold(tenant_id=tenant_id, hold_id=hold_id, amount=amount),
        )

    def release(self, hold: BudgetHold) -> None:
        """The request ended (its usage is written): its hold goes. With the store
        unreachable: :class:`LimitsUnavailable` (the release is sent again later)."""
        self._limiter.release(self.key(hold.tenant_id), hold.hold_id)

    @staticmethod
    def _without_hold(
        tenant_id: str, amount: int, budget: int, spent_now: int, exc: LimitsUnavailable
    ) -> BudgetDecision:
        """Fail-open: the budget against this month's spend alone (no other request's
        hold is known, and this one holds nothing)."""
        logger.warning(
            "limits store unreachable (%s): a request of tenant %s is checked against its "
            "budget without holds (fail-open)",
            exc,
            tenant_id,
        )
        allowed = spent_now < budget and spent_now + amount <= budget
        return BudgetDecision(allowed=allowed, spent=spent_now, held=0)
