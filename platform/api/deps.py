"""FastAPI dependencies: the platform context and who is calling."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from loramux.platform.api.errors import APIError
from loramux.platform.context import PlatformContext


def get_context(request: Request) -> PlatformContext:
    return request.app.state.context


ContextDep = Annotated[PlatformContext, Depends(get_context)]


def bearer_token(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(
            401,
            "Missing bearer token: send `Authorization: Bearer <api key or admin token>`.",
            code="missing_api_key",
        )
    return token.strip()


BearerDep = Annotated[str, Depends(bearer_token)]


def require_admin(context: ContextDep, token: BearerDep) -> None:
    # Timing-safe: the comparison takes as long whatever prefix matches.
    if not hmac.compare_digest(token.encode(), context.admin_token.encode()):
        raise APIError(401, "Invalid admin token.", code="invalid_api_key")


AdminDep = Annotated[None, Depends(require_admin)]
