"""Request body size caps, enforced before a route reads more than the cap.

An ASGI middleware: a declared ``Content-Length`` over the cap is refused at once; a body
without one (chunked) is counted as it is received and refused the moment it passes the
cap. Either way the client gets 413 with an OpenAI-style error body. Some routes are exempt
because they enforce their own, larger cap while streaming (adapter uploads).
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loramux.platform.api.errors import error_response

DEFAULT_MAX_BODY_BYTES = 1024 * 1024
"""The cap on JSON request bodies (1 MiB): prompts are text, far below it."""

# (method, path) pairs with their own streaming cap; the path without a trailing slash.
DEFAULT_EXEMPT_ROUTES: frozenset[tuple[str, str]] = frozenset({("POST", "/v1/adapters")})


class _BodyTooLarge(Exception):
    """Raised into the app from ``receive`` once a streamed body passes the cap."""


class BodyLimitMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        exempt: Iterable[tuple[str, str]] = DEFAULT_EXEMPT_ROUTES,
    ):
        if max_body_bytes <= 0:
            raise ValueError("max_body_bytes must be positive")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.exempt = frozenset((method.upper(), path.rstrip("/")) for method, path in exempt)

    def _too_large_response(self):
        return error_response(
            413,
            f"Request body too large: the limit is {self.max_body_bytes} bytes.",
            "request_too_large",
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
        if scope["type"] != "http" or ((scope["method"], scope["path"].rstrip("/")) in self.exempt):
            await self.app(scope, receive, send)
            return
        declared = self._declared_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._too_large_response()(scope, receive, send)
            return

        received = 0
        exceeded = False
        response_started = False

        async def counting_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
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
            await self._too_large_response()(scope, receive, send)
