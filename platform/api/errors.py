"""OpenAI-style error bodies: ``{"error": {"message", "type", "code"}}`` for every failure."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

from loramux.platform.api.error_codes import ERROR_CODES, HTTP_EXCEPTION_CODES, error_detail
from loramux.platform.errors import (
    Conflict,
    Invalid,
    NotFound,
    PlatformError,
    QuotaExceeded,
    Unavailable,
)
from loramux.platform.services.metering import database_unavailable

logger = logging.getLogger(__name__)

DATABASE_UNAVAILABLE_RETRY_AFTER_S = 5


class ErrorDetail(BaseModel):
    message: str = Field(description="What went wrong and what to do about it.")
    type: str = Field(description="OpenAI's error type, e.g. `invalid_request_error`.")
    code: str | None = Field(description="A stable machine-readable code, e.g. `model_not_found`.")


class ErrorBody(BaseModel):
    """The body of every error response (the OpenAPI document declares it per status)."""

    error: ErrorDetail


class APIError(Exception):
    """Raised by routes and dependencies for what only HTTP knows (authentication, a
    request the engine refused); services raise ``loramux.platform.errors`` instead."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        code: str,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.headers = headers


def error_response(
    status_code: int, message: str, code: str, headers: dict | None = None
) -> JSONResponse:
    """The JSON error response; ``code`` is one of ``error_codes.ERROR_CODES``."""
    body = {"error": error_detail(status_code, message, code)}
    return JSONResponse(body, status_code=status_code, headers=headers)


# The status of a platform error whose code is not in the table (a bug: logged).
_KIND_STATUS: dict[type[PlatformError], int] = {
    NotFound: 404,
    Conflict: 409,
    Invalid: 400,
    QuotaExceeded: 429,
    Unavailable: 503,
}


def platform_error_status(exc: PlatformError) -> int:
    """The HTTP status of a service's error: its code's, from ``ERROR_CODES``."""
    known = ERROR_CODES.get(exc.code)
    if known is not None:
        return known.status
    logger.error("error code %r is not in ERROR_CODES; answered by its kind", exc.code)
    return next((s for kind, s in _KIND_STATUS.items() if isinstance(exc, kind)), 500)


def platform_error_response(exc: PlatformError) -> JSONResponse:
    headers = None if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
    return error_response(platform_error_status(exc), exc.message, exc.code, headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(PlatformError)
    async def _platform_error(_: Request, exc: PlatformError) -> JSONResponse:
        return platform_error_response(exc)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status_code, exc.message, exc.code, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        code = HTTP_EXCEPTION_CODES.get(exc.status_code, "malformed_request")
        return error_response(exc.status_code, message, code, getattr(exc, "headers", None))

    async def _database_error(request: Request, exc: Exception) -> JSONResponse:
        # The database is down or restarting: a 503 the client may retry, not a 500. Any
        # other database error is a bug and stays one (re-raised: a 500 and a traceback).
        if not database_unavailable(exc):
            raise exc
        logger.warning(
            "database unavailable during %s %s: %s", request.method, request.url.path, exc
        )
        return error_response(
            503,
            "The database is unavailable right now (restarting or unreachable); try again "
            "in a few seconds.",
            "database_unavailable",
            {"Retry-After": str(DATABASE_UNAVAILABLE_RETRY_AFTER_S)},
        )

    app.add_exception_handler(DBAPIError, _database_error)
    app.add_exception_handler(PoolTimeoutError, _database_error)

    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback after this answer; the client gets the envelope.
        return error_response(
            500,
            "The platform failed on this request (a bug: its log has the details).",
            "internal_error",
        )

    app.add_exception_handler(Exception, _unexpected)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            where = ".".join(str(part) for part in err.get("loc", ()) if part != "body")
            problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        return error_response(422, "; ".join(problems) or "invalid request", "invalid_parameters")
