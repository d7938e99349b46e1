"""Request body limits, enforced as the body is received: a size cap (413) and a deadline (408).

An ASGI middleware around ``receive``. Size: a declared ``Content-Length`` over the cap is
refused at once; a body without one (chunked) is counted as it is received and refused the
moment it passes the cap. Some routes have a cap of their own (adapter uploads: a larger
one, the configured upload limit). Time: a body must arrive within its
:class:`BodyDeadline`, so a client trickling bytes (or stalling) cannot hold a connection
and a worker forever. Either way the client gets an OpenAI-style error, and the route sees
an exception from ``receive``, so its ``finally`` blocks (an upload's temporary files)
still run.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import anyio
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loramux.platform.api.errors import error_response

DEFAULT_MAX_BODY_BYTES = 1024 * 1024
"""The cap on JSON request bodies (1 MiB): prompts are text, far below it."""

UPLOAD_ROUTE = ("POST", "/v1/adapters")


@dataclass(frozen=True)
class BodyDeadline:
    """A body may take ``grace_s`` seconds, plus one more per ``min_bytes_per_s`` bytes
    received: a big upload on a slow but steady link goes through, a trickle is cut off."""

    grace_s: float
    min_bytes_per_s: float

    def __post_init__(self) -> None:
        if self.grace_s <= 0 or self.min_bytes_per_s <= 0:
            raise ValueError("a body deadline needs a positive grace and rate")

    def seconds_for(self, received: int) -> float:
        return self.grace_s + received / self.min_bytes_per_s


class _BodyCutOff(Exception):
    """Raised into the app from ``receive`` once the body passed a limit."""


class BodyLimitMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        route_limits: Mapping[tuple[str, str], int] | None = None,
        deadline: BodyDeadline | None = None,
    ):
        """``route_limits`` maps (method, path without trailing slash) to a route's own cap;
        without a ``deadline`` a body may take any time."""
        limits = dict(route_limits or {})
        if min([max_body_bytes, *limits.values()]) <= 0:
            raise ValueError("body limits must be positive")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.route_limits = {
            (method.upper(), path.rstrip("/")): limit for (method, path), limit in limits.items()
        }
        self.deadline = deadline

    @staticmethod
    def _too_large_response(limit: int) -> Response:
        return error_response(
            413, f"Request body too large: the limit is {limit} bytes.", "request_too_large"
        )

    def _too_slow_response(self, received: int) -> Response:
        assert self.deadline is not None
        return error_response(
            408,
            f"Request body too slow: {received} bytes arrived in "
            f"{self.deadline.seconds_for(received):.0f} s. A body may take "
            f"{self.deadline.grace_s:g} s plus 1 s per {self.deadline.min_bytes_per_s:g} bytes; "
            "send it faster, or in smaller requests.",
            "request_timeout",
            # The rest of the body may still be on its way: this connection is done.
            headers={"Connection": "close"},
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
        body_done = False
        started: float | None = None  # when the app first asked for the body
        cut_off: Response | None = None  # what the client gets instead of the app's answer
        response_started = False

        async def timed_receive() -> Message:
            nonlocal started
            if body_done or self.deadline is None:
                return await receive()  # after the body: waiting for a disconnect, untimed
            if started is None:
                started = time.monotonic()
            left = started + self.deadline.seconds_for(received) - time.monotonic()
            with anyio.move_on_after(max(left, 0)) as waiting:
                return await receive()
            assert waiting.cancelled_caught
            return {"type": "loramux.body_timeout"}

        async def limited_receive() -> Message:
            nonlocal received, body_done, cut_off
            message = await timed_receive()
            if message["type"] == "loramux.body_timeout":
                cut_off = self._too_slow_response(received)
                raise _BodyCutOff()
            if message["type"] == "http.request" and not body_done:
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > limit:
                    cut_off = self._too_large_response(limit)
                    raise _BodyCutOff()
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal response_started
            # Once the body was cut off, whatever the app answers (it may turn the error
            # into a 400 "could not parse the body") is replaced by the cut-off response.
            if cut_off is not None:
                return
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if cut_off is None:
                raise
        if cut_off is not None and not response_started:
            await cut_off(scope, receive, send)
