"""Request body size caps, enforced before a route reads more than the cap.

An ASGI middleware: a declared ``Content-Length`` over the cap is refused at once; a body
without one (chunked) is counted as it is received and refused the moment it passes the
cap. Either way the client gets 413 with an OpenAI-style error body. Some routes have a
cap of their own (adapter uploads: a larger one, the configured upload limit).
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loramux.platform.api.errors import error_response

DEFAULT_MAX_BODY_BYTES = 1024 * 1024
"""The cap on JSON request bodies (1 MiB): prompts are text, far below it."""

UPLOAD_ROUTE = ("POST", "/v1/adapters")


class _BodyTooLarge(Exception):
    """Raised into the app from ``receive`` once a streamed body passes the cap."""


class BodyLimitMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        route_limits: Mapping[tuple[str, str], int] | None = None,
    ):
        """``route_limits`` maps (method, path without trailing slash) to a route's own cap."""
        limits = dict(route_limits or {})
        if min([max_body_bytes, *limits.values()]) <= 0:
            raise ValueError("body limits must be positive")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.route_limits = {
            (method.upper(), path.rstrip("/")): limit for (method, path), limit in limits.items()
        }

    @staticmethod
    def _too_large_response(limit: int):
        return error_response(
            413, f"Request body too large: the limit is {limit} bytes.", "request_too_large"
        )

    def _declared_length(self, scope: Scope) -> int | None:
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return None  # malformed: the server rejects it; count the bytes anyway
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = (scope["method"], scope["path"].rstrip("/"))
        limit = self.route_limits.get(route, self.max_body_bytes)
        declared = self._declared_length(scope)
        if declared is not None and declared > limit:
            await self._too_large_response(limit)(scope, receive, send)
            return

        received = 0
        exceeded = False
        response_started = False

        async def counting_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    exceeded = True
                    raise _BodyTooLarge()
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal response_started
            # Once the body was cut off, whatever the app answers (it may turn the error
            # into a 400 "could not parse the body") is replaced by the 413 below.
            if exceeded:
                return
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except _BodyTooLarge:
            pass
        except Exception:
            if not exceeded:
                raise
        if exceeded and not response_started:
            await self._too_large_response(limit)(scope, receive, send)
