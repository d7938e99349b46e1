"""Serving an app under uvicorn with a shutdown that ends in bounded time.

On SIGTERM (or SIGINT) uvicorn stops accepting connections and waits for the running
requests. Left alone it waits as long as they run (a request may generate for minutes),
and its own ``timeout_graceful_shutdown`` merely cancels the request tasks, so a stream
ends without its last chunk. :class:`DrainingServer` adds the step in between:

1. shutdown starts: ``on_shutdown`` runs (an engine leaves the registry), nothing new is
   accepted, running requests go on;
2. after ``grace_s`` seconds: ``stop_requests`` ends every request still running the clean
   way (the engine work is aborted, a stream gets its final chunk with finish reason
   ``abort`` and ``[DONE]``, a non-streamed request its response with what was generated,
   and each is billed for what it delivered);
3. after ``BACKSTOP_S`` more: uvicorn cancels whatever is left (a request's billing still
   runs, shielded), then the app's lifespan stops the engine and the process exits.

So the process exits within about ``grace_s + BACKSTOP_S`` seconds of the signal.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

import uvicorn

logger = logging.getLogger(__name__)

BACKSTOP_S = 5.0
"""How long stopped requests get to send their last bytes and write their usage before
uvicorn cancels them."""


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose shutdown stops running requests after ``grace_s``."""

    def __init__(
        self,
        config: uvicorn.Config,
        *,
        grace_s: float,
        stop_requests: Callable[[], int],
        on_shutdown: Callable[[], Awaitable[None]] | None = None,
    ):
        super().__init__(config)
        self.grace_s = grace_s
        self._stop_requests = stop_requests
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._on_shutdown is not None:
            try:
                await self._on_shutdown()
            except Exception:  # shutting down goes on whatever failed
                logger.exception("the shutdown hook failed")
        timer = asyncio.get_running_loop().call_later(self.grace_s, self._grace_over)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def request_exit(self) -> None:
        """Shut down as on SIGTERM, from the server's own event loop (the process then
        exits with the status its caller returns, not as killed by a signal)."""
        self.should_exit = True

    def _grace_over(self) -> None:
        stopped = self._stop_requests()
        if stopped:
            logger.warning(
                "shutdown: %d request(s) still running after %.0f s; stopping them",
                stopped,
                self.grace_s,
            )


def serve(
    app,
    *,
    shutdown_timeout_s: float,
    stop_requests: Callable[[], int],
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    take_exit: Callable[[Callable[[], None]], None] | None = None,
    **uvicorn_options,
) -> None:
    """Run ``app`` until a signal, then shut down within ``shutdown_timeout_s`` (+ the
    backstop): ``uvicorn.run`` with :class:`DrainingServer`'s bounded drain. ``take_exit``
    is handed a function that starts the same shutdown from inside the app."""
    config = uvicorn.Config(
        app, timeout_graceful_shutdown=shutdown_timeout_s + BACKSTOP_S, **uvicorn_options
    )
    server = DrainingServer(
        config,
        grace_s=shutdown_timeout_s,
        stop_requests=stop_requests,
        on_shutdown=on_shutdown,
    )
    if take_exit is not None:
        take_exit(server.request_exit)
    server.run()
