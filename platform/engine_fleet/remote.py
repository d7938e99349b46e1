"""One ``loramux engine`` process, reached over its internal HTTP API (``server``).

Errors map onto the in-process engine's by the code of the engine's answer, never by its
words: a refused request or call raises ``EngineError``; :class:`AdapterNotRegistered` (an
``UnknownAdapter``) when the engine does not know the adapter (e.g. after a restart), and
``AdapterInUse`` when requests still use the adapter it was asked to remove. An engine
that did not answer a request (refused the connection, or dropped it before any response:
it died a moment ago) raises :class:`EngineUnreachable`, and one that goes away after it
answered :class:`EngineLost` — both ``AsyncEngineError``, which the API answers with 503.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from loramux.engine import (
    AdapterInUse,
    AsyncEngineError,
    EngineError,
    EngineStats,
    RequestOutput,
    UnknownAdapter,
)
from loramux.platform.engine_fleet.client import EngineRequest
from loramux.platform.engine_fleet.stored_adapter import StoredAdapter
from loramux.platform.engine_fleet.wire import output_from_json, params_to_json, stats_from_json

# Connecting must be quick (a dead engine is skipped for another); a stream may wait long
# between tokens on a busy engine.
TIMEOUT = httpx.Timeout(10.0, connect=3.0, read=600.0)
_UNREACHABLE = (httpx.ConnectError, httpx.ConnectTimeout)
_LOST = (httpx.TransportError,)


class EngineUnavailable(AsyncEngineError):
    """An engine process could not serve a call (base of the two below); ``engine_id``
    names it (None when no engine was involved)."""

    def __init__(self, message: str, *, engine_id: str | None = None):
        super().__init__(message)
        self.engine_id = engine_id


class EngineUnreachable(EngineUnavailable):
    """The engine did not answer: it refused the connection, or dropped it before any
    response (a process dying as the request arrived). Nothing came back, and an engine
    aborts what a dropped connection asked for, so a retry elsewhere is safe."""


class EngineLost(EngineUnavailable):
    """The engine went away (or broke the stream) after it answered the request."""


class AdapterNotRegistered(UnknownAdapter):
    """The engine does not know the adapter (it restarted since it was registered, or it
    never was)."""


# The error codes of the engine's refusals that name a type (``server`` answers with them);
# any other code is a plain EngineError.
_REFUSALS: dict[str, type[EngineError]] = {
    "unknown_adapter": AdapterNotRegistered,
    "adapter_in_use": AdapterInUse,
}


class RemoteEngine:
    """Calls to one engine process; ``client`` is shared by all of them."""

    def __init__(self, client: httpx.AsyncClient, engine_id: str, url: str, secret: str):
        self.engine_id, self.url = engine_id, url.rstrip("/")
        self._client = client
        self._headers = {"Authorization": f"Bearer {secret}"}

    def _url(self, path: str) -> str:
        return f"{self.url}/v1/engine{path}"

    async def _call(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        try:
            response = await self._client.request(
                method, self._url(path), json=body, headers=self._headers, timeout=TIMEOUT
            )
        except _UNREACHABLE as exc:
            raise self._unreachable(exc) from exc
        except _LOST as exc:
            raise EngineLost(
                f"engine {self.engine_id} at {self.url}: {_describe(exc)}",
                engine_id=self.engine_id,
            ) from exc
        if response.status_code >= 500 or response.status_code == 401:
            raise EngineUnavailable(
                f"engine {self.engine_id}: {_message(response)}", engine_id=self.engine_id
            )
        return response

    async def stream(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine streams them; closing early drops the
        connection, which aborts the request on the engine."""
        prompt = request.prompt
        body = {
            "request_id": request.request_id,
            "prompt": prompt if isinstance(prompt, str) else list(prompt),
            "params": params_to_json(request.params),
            "adapter": request.adapter,
            "priority": request.priority,
            "tenant": request.tenant,
            "mix": None if request.mix is None else [list(part) for part in request.mix],
        }
        finished = answered = False
        try:
            async with self._client.stream(
                "POST", self._url("/generate"), json=body, headers=self._headers, timeout=TIMEOUT
            ) as response:
                answered = True
                if response.status_code != 200:
                    await response.aread()
                    _raise_refusal(response, self.engine_id)
                async for line in response.aiter_lines():
                    if line:
                        out = output_from_json(json.loads(line))
                        finished = out.finished
                        yield out
        except _UNREACHABLE as exc:
            raise self._unreachable(exc) from exc
        except _LOST as exc:
            if not answered:  # dropped before any response: it did not take the request
                raise self._unreachable(exc) from exc
            raise EngineLost(
                f"engine {self.engine_id} stopped during request {request.request_id}: "
                f"{_describe(exc)}",
                engine_id=self.engine_id,
            ) from exc
        if not finished:
            raise EngineLost(
                f"engine {self.engine_id} ended request {request.request_id} unfinished",
                engine_id=self.engine_id,
            )

    def _unreachable(self, exc: Exception) -> EngineUnreachable:
        return EngineUnreachable(
            f"engine {self.engine_id} at {self.url} did not answer: {_describe(exc)}",
            engine_id=self.engine_id,
        )

    async def abort(self, request_id: str) -> RequestOutput | None:
        """Abort the request; its final output (reason ``abort``, with its metrics), or None
        when the engine runs no such request (or is from before abort answered with it)."""
        response = await self._call("POST", f"/requests/{request_id}/abort")
        if response.status_code == 200:
            return output_from_json(response.json())
        if response.status_code != 204:
            raise _refusal(response)
        return None

    async def register_adapter(self, name: str, adapter: StoredAdapter) -> None:
        response = await self._call(
            "PUT",
            f"/adapters/{name}",
            {
                "config_key": adapter.config_key,
                "weights_key": adapter.weights_key,
                "sha256": adapter.sha256,
                "description": adapter.description,
            },
        )
        if response.status_code != 204:
            raise _refusal(response)

    async def keep_adapter(self, name: str, keep: bool = True) -> None:
        """Pin ``name`` on the engine's device, or unpin it: :class:`AdapterNotRegistered`
        if the engine does not have it."""
        response = await self._call("PUT", f"/adapters/{name}/keep", {"keep": keep})
        if response.status_code != 204:
            raise _refusal(response)

    async def remove_adapter(self, name: str) -> None:
        """Unregister ``name``: :class:`AdapterNotRegistered` (an ``UnknownAdapter``) if the
        engine does not have it, ``AdapterInUse`` while requests use it."""
        response = await self._call("DELETE", f"/adapters/{name}")
        if response.status_code != 204:
            raise _refusal(response)

    async def set_tenant(
        self, tenant: str, *, weight: float | None = None, priority: int | None = None
    ) -> int:
        response = await self._call(
            "PUT", f"/tenants/{tenant}", {"weight": weight, "priority": priority}
        )
        if response.status_code != 200:
            raise _refusal(response)
        return int(response.json()["reprioritized"])

    async def stats(self) -> EngineStats:
        return stats_from_json((await self._call("GET", "/stats")).json())

    async def pinned_adapters(self) -> dict[str, str]:
        return (await self.stats()).pinned_adapters

    async def residency(self) -> dict[str, str]:
        return dict((await self._call("GET", "/residency")).json())


def _describe(exc: Exception) -> str:
    """An httpx error in words (a reset connection's message is often empty)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {response.text[:200]}"


def _refusal_class(code: object) -> type[EngineError]:
    return _REFUSALS.get(code, EngineError) if isinstance(code, str) else EngineError


def _refusal(response: httpx.Response) -> EngineError:
    """The engine's refusal of a call, as the class its error code names."""
    code = None
    with contextlib.suppress(ValueError, KeyError, TypeError):
        code = response.json()["error"]["code"]
    return _refusal_class(code)(_message(response))


def _raise_refusal(response: httpx.Response, engine_id: str) -> None:
    error: Any = {}
    with contextlib.suppress(ValueError):
        error = response.json().get("error", {})
    message = str(error.get("message") or f"HTTP {response.status_code}")
    if response.status_code == 400:
        raise _refusal_class(error.get("code"))(message)
    raise EngineUnavailable(f"engine {engine_id}: {message}", engine_id=engine_id)
