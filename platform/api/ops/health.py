"""Liveness and readiness.

``GET /healthz`` answers as long as the process serves HTTP (liveness: restart me if not);
``GET /health`` is the same answer under vLLM's name, which load generators such as GuideLLM
check before their first request.
``GET /readyz`` checks what serving needs — the database, the adapter store, the engine
and, where one is configured, Redis — and names each check's outcome. It answers 503
(readiness: send me no traffic) when a check the platform cannot serve without fails, and
200 with status ``degraded`` when only Redis fails while rate limits fail open: Redis is
shared by every replica, so taking them all out of the load balancer for an outage that
they serve through would turn a degraded service into none.

Both answer anyone, so a failed check says which part failed and a generic reason only:
an exception's text can name endpoints, buckets, object keys, hosts or a database URL.
The details go to the platform's log, for operators.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from loramux.platform.api.deps import ContextDep
from loramux.platform.context import PlatformContext

router = APIRouter(tags=["health"])
logger = logging.getLogger(__name__)

# A well-formed key no upload can have (the digest of nothing is not all zeros): asking the
# store whether it exists is a cheap round trip that must answer False, not raise.
_ABSENT_KEY = "sha256/00/" + "0" * 64


@router.get("/healthz")
def healthz() -> dict:
    return {"status": "ok"}


@router.get("/health", summary="Health (vLLM's name for /healthz)")
def health() -> dict:
    return healthz()


def _check_database(context: PlatformContext) -> None:
    with context.sessions() as session:
        session.execute(text("SELECT 1"))


def _check_store(context: PlatformContext) -> None:
    context.store.exists(_ABSENT_KEY)  # StoreUnavailable when the backend can't answer


def _check_engine(context: PlatformContext) -> None:
    if context.engine is None:
        raise _CheckFailed("no engine is attached to this platform")
    reason = context.engine.not_ready_reason()
    if reason is not None:
        raise _CheckFailed(reason)


class _CheckFailed(Exception):
    """A readiness check's expected failure; its message (our own words, naming nothing
    private) is the reason reported."""


def _check_redis(context: PlatformContext) -> None:
    context.rate_limiter.ping()  # LimitsUnavailable when Redis does not answer


_CHECKS: dict[str, Callable[[PlatformContext], None]] = {
    "database": _check_database,
    "store": _check_store,
    "engine": _check_engine,
    "redis": _check_redis,
}


def _checks_of(context: PlatformContext) -> dict[str, bool]:
    """The checks that apply to this platform, each with whether it is required."""
    checks = {"database": True, "store": True, "engine": True}
    if context.settings.redis_url is not None:
        # Needed to serve only where limits fail closed; otherwise requests go on without
        # rate limits (and remote mode routes from the last registry read).
        checks["redis"] = not context.settings.limits_fail_open
    return checks


# What an unexpected failure of each check is reported as.
_GENERIC_REASONS = {
    "database": "the database did not answer",
    "store": "the adapter store did not answer",
    "engine": "the engine did not answer",
    "redis": "Redis did not answer",
}


@router.get("/readyz")
def readyz(context: ContextDep) -> JSONResponse:
    checks: dict[str, dict] = {}
    unavailable = degraded = False
    for name, required in _checks_of(context).items():
        try:
            _CHECKS[name](context)
        except _CheckFailed as exc:
            checks[name] = {"status": "failed", "error": str(exc), "required": required}
        except Exception as exc:  # any failure means not ready: report it, don't crash
            logger.warning("readiness check %r failed: %s: %s", name, type(exc).__name__, exc)
            reason = f"{_GENERIC_REASONS[name]} (details in the platform's log)"
            checks[name] = {"status": "failed", "error": reason, "required": required}
        else:
            checks[name] = {"status": "ok"}
            continue
        unavailable = unavailable or required
        degraded = True
    status = "unavailable" if unavailable else "degraded" if degraded else "ready"
    return JSONResponse(
        {"status": status, "checks": checks}, status_code=503 if unavailable else 200
    )
