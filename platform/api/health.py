"""Liveness and readiness.

``GET /healthz`` answers as long as the process serves HTTP (liveness: restart me if not).
``GET /readyz`` also checks what serving needs — the database, the adapter store and the
engine — and answers 503 naming the failed checks (readiness: send me no traffic yet).

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


_CHECKS: dict[str, Callable[[PlatformContext], None]] = {
    "database": _check_database,
    "store": _check_store,
    "engine": _check_engine,
}

# What an unexpected failure of each check is reported as.
_GENERIC_REASONS = {
    "database": "the database did not answer",
    "store": "the adapter store did not answer",
    "engine": "the engine did not answer",
}


@router.get("/readyz")
def readyz(context: ContextDep) -> JSONResponse:
    checks: dict[str, dict] = {}
    for name, check in _CHECKS.items():
        try:
            check(context)
        except _CheckFailed as exc:
            checks[name] = {"status": "failed", "error": str(exc)}
        except Exception as exc:  # any failure means not ready: report it, don't crash
            logger.warning("readiness check %r failed: %s: %s", name, type(exc).__name__, exc)
            reason = f"{_GENERIC_REASONS[name]} (details in the platform's log)"
            checks[name] = {"status": "failed", "error": reason}
        else:
            checks[name] = {"status": "ok"}
    ready = all(check["status"] == "ok" for check in checks.values())
    body = {"status": "ready" if ready else "unavailable", "checks": checks}
    return JSONResponse(body, status_code=200 if ready else 503)
