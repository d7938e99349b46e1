"""``loramux engine``: one engine in its own process, behind a small internal HTTP API.

Unauthenticated: ``GET /healthz`` (the process serves), ``GET /readyz`` (the model is
loaded, the loop runs and the engine is registered), ``GET /metrics`` (the engine's
Prometheus registry). Everything under ``/v1/engine`` needs ``Authorization: Bearer
<LORAMUX_ENGINE_SERVER_SECRET>``:

| route | what |
|---|---|
| ``GET /v1/engine/info`` | id, boot id, model, capacity, context cap |
| ``POST /v1/engine/generate`` | one request; 200 streams one JSON ``RequestOutput`` per line (``wire``), 400 if refused; a dropped connection aborts it |
| ``POST /v1/engine/requests/{id}/abort`` | abort a request: 200 with its final output (``wire``; its metrics say what it cost), 204 if no such request runs |
| ``PUT /v1/engine/adapters/{name}`` | register an adapter version by its store objects (idempotent) |
| ``DELETE /v1/engine/adapters/{name}`` | unregister it; 404 if unknown, 409 while requests use it |
| ``PUT /v1/engine/tenants/{tenant}`` | a tenant's fair-share weight and/or priority |
| ``GET /v1/engine/residency``, ``GET /v1/engine/stats`` | where adapters are; the live snapshot |

While it runs the process publishes its :class:`EngineRecord` to the registry every
heartbeat (load, resident adapters). On SIGTERM it withdraws at once (platforms route new
requests elsewhere), lets its running requests finish for up to ``shutdown_timeout_s``,
then aborts the rest (:meth:`EngineHost.stop_requests`: each stream ends with an output
whose finish reason is ``abort``, so the platform bills what was delivered) and exits
(``loramux.platform.serving``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from loramux.engine import AsyncEngine, AsyncEngineError, EngineError, UnknownAdapter
from loramux.platform.engine_fleet.heartbeat import Heartbeat
from loramux.platform.engine_fleet.registry import EngineRecord, EngineRegistry
from loramux.platform.engine_fleet.stored_adapter import StoredAdapter
from loramux.platform.engine_fleet.wire import output_to_json, params_from_json, stats_to_json
from loramux.platform.store import ObjectStore

logger = logging.getLogger(__name__)
DOWN_POLL_S = 0.25  # how often the host looks whether its engine went down


class EngineHost:
    """What one engine process holds: the engine, the store its adapters come from, and
    its place in the registry."""

    def __init__(
        self,
        engine: AsyncEngine,
        store: ObjectStore,
        registry: EngineRegistry | None,
        *,
        engine_id: str,
        url: str,
        model_id: str,
        secret: str,
    ):
        self.engine, self.store, self.registry = engine, store, registry
        self.engine_id, self.url, self.model_id = engine_id, url, model_id
        self.secret = secret
        self.boot_id = uuid.uuid4().hex  # registrations made before a restart are gone
        self.registered = False
        self.heartbeat = Heartbeat(registry, self.record) if registry is not None else None
        self._adapters: dict[str, StoredAdapter] = {}
        self._beating: asyncio.Task | None = None
        self._watching: asyncio.Task | None = None
        # Called once if the engine goes down for good (a tensor-parallel rank died): the
        # process should end, so that whatever runs it starts a whole engine again.
        self.on_down: Callable[[], None] | None = None
        self.streaming: set[str] = set()  # ids of the requests whose output is being streamed
        self._aborting: set[asyncio.Task] = set()

    @property
    def capacity(self) -> int:
        return self.engine.config.max_num_seqs

    async def start(self) -> None:
        await self.engine.start()
        if self.heartbeat is not None:
            await self.heartbeat.beat(patient=True)
            self._beating = asyncio.create_task(self.heartbeat.run())
        self.registered = True
        self._watching = asyncio.create_task(self._watch_engine())

    async def _watch_engine(self) -> None:
        """Leave the registry at once when the engine goes down (its requests have failed
        already), rather than when its record expires, and tell ``on_down``."""
        while self.engine.down is None:
            await asyncio.sleep(DOWN_POLL_S)
        logger.error(
            "engine %s is down: %s; leaving the registry", self.engine_id, self.engine.down
        )
        await self.withdraw()
        if self.on_down is not None:
            self.on_down()

    async def withdraw(self) -> None:
        """Leave the registry (no new requests are routed here); idempotent."""
        self.registered = False
        beating, self._beating = self._beating, None
        if beating is not None:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating
            if self.registry is not None:
                with contextlib.suppress(Exception):  # Redis gone too: the record expires
                    await self.registry.withdraw(self.engine_id)

    async def stop(self) -> None:
        watching, self._watching = self._watching, None
        if watching is not None and not watching.done():
            watching.cancel()
        await self.withdraw()
        await self.engine.stop()

    def stop_requests(self) -> int:
        """Abort every request being streamed (a shutdown's grace is over); how many.
        Each stream ends with its abort output, so the platform sees how it ended."""
        for request_id in list(self.streaming):
            task = asyncio.ensure_future(self.engine.abort(request_id))
            self._aborting.add(task)
            task.add_done_callback(self._aborting.discard)
        return len(self.streaming)

    async def record(self) -> EngineRecord:
        stats = await self.engine.stats()
        return EngineRecord(
            engine_id=self.engine_id,
            url=self.url,
            model_id=self.model_id,
            boot_id=self.boot_id,
            capacity=self.capacity,
            running=stats.running_requests,
            waiting=stats.waiting_requests,
            max_model_len=self.engine.max_model_len,
            device_adapters=stats.device.adapters,
            host_adapters=stats.host.adapters,
        )

    def not_ready_reason(self) -> str | None:
        """Why platforms cannot send requests here now, or None. An engine whose record has
        expired (its heartbeats fail: Redis is out of reach) is in no platform's routing."""
        if self.engine.down is not None:
            return f"the engine is down: {self.engine.down}"
        if not self.engine.is_running:
            return "the engine loop is not running"
        if not self.registered:
            return "not registered (starting, or shutting down)"
        age = self.heartbeat_age_s()
        if age is not None and self.registry is not None and age > self.registry.ttl_s:
            return (
                f"the last heartbeat Redis took was {age:.1f} s ago (records expire after "
                f"{self.registry.ttl_s:g} s): platforms no longer see this engine"
            )
        return None

    def heartbeat_age_s(self) -> float | None:
        if self.heartbeat is None or self.heartbeat.last_beat is None:
            return None
        return time.monotonic() - self.heartbeat.last_beat

    async def register(self, name: str, adapter: StoredAdapter) -> None:
        known = self._adapters.get(name)
        if known == adapter:
            return
        if known is not None:
            raise EngineError(f"adapter {name!r} is already registered with other files")
        await self.engine.register_adapter(name, adapter.source(self.store))
        self._adapters[name] = adapter

    async def unregister(self, name: str) -> None:
        await self.engine.remove_adapter(name)  # UnknownAdapter, or AdapterInUse
        self._adapters.pop(name, None)


# --- request bodies -----------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerateBody(_Body):
    request_id: str = Field(min_length=1, max_length=200)
    prompt: str | list[int]
    params: dict[str, Any]
    adapter: str | None = None
    priority: int = 0
    tenant: str | None = None
    mix: list[tuple[str, float]] | None = None  # adapters' names and weights


class KeepBody(_Body):
    keep: bool


class AdapterBody(_Body):
    config_key: str
    weights_key: str
    sha256: str
    description: str


class TenantBody(_Body):
    weight: float | None = Field(default=None, gt=0)
    priority: int | None = None


# --- the app ------------------------------------------------------------------------------


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "engine_error", "code": code}}, status_code=status
    )


def _host(request: Request) -> EngineHost:
    return request.app.state.host


HostDep = Annotated[EngineHost, Depends(_host)]


def _require_secret(request: Request, host: HostDep) -> None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token, host.secret):
        raise _Unauthorized()


class _Unauthorized(Exception):
    pass


internal = APIRouter(prefix="/v1/engine", dependencies=[Depends(_require_secret)])


@internal.get("/info")
async def info(host: HostDep) -> dict:
    return {
        "engine_id": host.engine_id,
        "boot_id": host.boot_id,
        "model_id": host.model_id,
        "capacity": host.capacity,
        "max_model_len": host.engine.max_model_len,
    }


@internal.post("/generate", response_model=None)
async def generate(body: GenerateBody, host: HostDep) -> Response:
    try:
        params = params_from_json(body.params)
    except (TypeError, ValueError) as exc:
        return _error(400, f"bad sampling parameters: {exc}", "invalid_request")
    stream = host.engine.generate(
        body.prompt,
        params,
        adapter=body.adapter,
        priority=body.priority,
        tenant=body.tenant,
        request_id=body.request_id,
        mix=body.mix,
    )
    try:  # the first output answers whether the engine took the request
        first = await anext(stream)
    except EngineError as exc:
        await stream.aclose()
        code = "unknown_adapter" if isinstance(exc, UnknownAdapter) else "invalid_request"
        return _error(400, str(exc), code)
    except AsyncEngineError as exc:
        await stream.aclose()
        return _error(503, f"the engine could not run the request: {exc}", "engine_error")
    if not first.finished:
        host.streaming.add(body.request_id)
    return StreamingResponse(
        _lines(host, body.request_id, first, stream), media_type="application/x-ndjson"
    )


async def _lines(
    host: EngineHost, request_id: str, first, stream: AsyncIterator
) -> AsyncIterator[str]:
    # Closed early (the platform dropped the connection): closing the engine's stream
    # aborts the request there.
    try:
        yield json.dumps(output_to_json(first)) + "\n"
        if not first.finished:
            async for out in stream:
                yield json.dumps(output_to_json(out)) + "\n"
    finally:
        host.streaming.discard(request_id)
        await stream.aclose()


@internal.post("/requests/{request_id}/abort", response_model=None)
async def abort(request_id: str, host: HostDep) -> Response:
    out = await host.engine.abort(request_id)
    if out is None:
        return Response(status_code=204)
    # json.dumps as the generate stream writes it (a -inf logprob is not strict JSON).
    return Response(json.dumps(output_to_json(out)), media_type="application/json")


@internal.put("/adapters/{name}", response_model=None)
async def register_adapter(name: str, body: AdapterBody, host: HostDep) -> Response:
    try:
        await host.register(name, StoredAdapter(**body.model_dump()))
    except EngineError as exc:
        return _error(409, str(exc), "adapter_conflict")
    return Response(status_code=204)


@internal.delete("/adapters/{name}", response_model=None)
async def remove_adapter(name: str, host: HostDep) -> Response:
    try:
        await host.unregister(name)
    except UnknownAdapter as exc:
        return _error(404, str(exc), "unknown_adapter")
    except EngineError as exc:  # AdapterInUse, its only other refusal
        return _error(409, str(exc), "adapter_in_use")
    return Response(status_code=204)


@internal.put("/adapters/{name}/keep", response_model=None)
async def keep_adapter(name: str, body: KeepBody, host: HostDep) -> Response:
    try:
        await host.engine.keep_adapter(name, body.keep)
    except UnknownAdapter as exc:
        return _error(404, str(exc), "unknown_adapter")
    return Response(status_code=204)


@internal.put("/tenants/{tenant}")
async def set_tenant(tenant: str, body: TenantBody, host: HostDep) -> dict:
    reprioritized = 0
    if body.weight is not None:
        await host.engine.set_tenant_weight(tenant, body.weight)
    if body.priority is not None:
        reprioritized = await host.engine.set_tenant_priority(tenant, body.priority)
    return {"reprioritized": reprioritized}


@internal.get("/residency")
async def residency(host: HostDep) -> dict[str, str]:
    return {name: str(tier) for name, tier in (await host.engine.adapter_residency()).items()}


@internal.get("/stats")
async def stats(host: HostDep) -> dict:
    return stats_to_json(await host.engine.stats())


def build_engine_host(settings, *, log=print) -> EngineHost:
    """The engine process ``settings`` describe: the base model (converted once if it is
    a GGUF), the engine, the store, and the registry when Redis is configured."""
    import socket

    import redis.asyncio

    from loramux.engine import Engine
    from loramux.platform.base_model import resolve_base_model
    from loramux.platform.data_dir import make_data_dir_private
    from loramux.platform.engine_fleet.registry import EngineRegistry
    from loramux.platform.engine_settings import engine_config
    from loramux.platform.store import build_store

    make_data_dir_private(settings.data_dir, log=log)
    base_model = resolve_base_model(settings, log=log)
    hostname = socket.gethostname()
    registry = None
    if settings.redis_url:
        registry = EngineRegistry(
            redis.asyncio.from_url(settings.redis_url), settings.engine_heartbeat_s
        )
    return EngineHost(
        AsyncEngine(Engine(engine_config(settings, base_model))),
        build_store(settings),
        registry,
        engine_id=settings.engine_id or f"{hostname}-{settings.engine_port}",
        url=settings.engine_advertise_url or f"http://{hostname}:{settings.engine_port}",
        model_id=base_model.model_id,
        secret=settings.engine_secret.get_secret_value(),
    )


def create_engine_app(host: EngineHost) -> FastAPI:
    """The engine process's app over ``host`` (started and stopped with the app)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await host.start()
        try:
            yield
        finally:
            await host.stop()

    app = FastAPI(lifespan=lifespan, title="loramux engine", version="0.1.0")
    app.state.host = host

    @app.exception_handler(_Unauthorized)
    async def _unauthorized(_: Request, __: _Unauthorized) -> JSONResponse:
        return _error(
            401, "missing or wrong engine secret (LORAMUX_ENGINE_SERVER_SECRET)", "unauthorized"
        )

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        reason = host.not_ready_reason()
        body: dict[str, Any] = {"status": "ready" if reason is None else "unavailable"}
        if reason is not None:
            body["reason"] = reason
        age = host.heartbeat_age_s()  # read after the reason's: never below the age it judged
        if age is not None:
            body["heartbeat_age_s"] = age  # unrounded: 0.64 s must not read as a TTL's 0.6
        return JSONResponse(body, status_code=200 if reason is None else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        registry = host.engine.metrics_registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(internal)
    return app
