"""``GET /metrics``: Prometheus text of the engine's registry plus the platform's own.

The platform registry (HTTP requests and their latency, by route template; failures to
reach the database, Redis and the store) is built per app in
:func:`loramux.platform.app.create_app`, never at import. In remote mode the routing
client adds its own (routing decisions by kind, engine failures, retries). ``/metrics`` needs no
token: serve it on an internal network only (scrapers), never expose it publicly.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loramux.platform.api.deps import ContextDep
from loramux.platform.context import PlatformContext
from loramux.platform.db.session import ConnectionErrors

UNMATCHED_ROUTE = "<unmatched>"  # one label for every path no route matched (bounded labels)


class PlatformMetrics:
    """The platform's Prometheus metrics, in a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.http_requests = Counter(
            "loramux_http_requests",
            "HTTP requests served, by method, route template and status code.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.http_request_seconds = Histogram(
            "loramux_http_request_duration_seconds",
            "Time from a request's arrival to the end of its response.",
            ["method", "route"],
            registry=self.registry,
        )

    def watch_dependencies(self, context: PlatformContext) -> None:
        """Export ``loramux_dependency_errors`` from the context's database, Redis and
        store (each counts its own failures to reach its backend)."""
        self.registry.register(_DependencyErrors(context))

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        self.http_requests.labels(method, route, str(status)).inc()
        self.http_request_seconds.labels(method, route).observe(seconds)


class _DependencyErrors(Collector):
    """Failures to reach the database, Redis and the adapter store, read from the parts
    that count them when scraped."""

    def __init__(self, context: PlatformContext):
        self._database = ConnectionErrors(context.sessions.kw["bind"])
        self._context = context

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "loramux_dependency_errors",
            "Operations that could not reach a dependency (database connections refused or "
            "dropped, Redis unreachable, the adapter store unavailable).",
            labels=["dependency"],
        )
        family.add_metric(["database"], self._database.count)
        family.add_metric(["redis"], getattr(self._context.rate_limiter, "failures", 0))
        family.add_metric(["store"], self._context.store.failures)
        yield family


def _route_template(scope: Scope) -> str:
    # The router records the matched route in the scope (the template, not the raw path,
    # so /v1/adapters/{name} is one series whatever the names).
    route = scope.get("route")
    return getattr(route, "path", None) or UNMATCHED_ROUTE


class HTTPMetricsMiddleware:
    """Counts every HTTP request and times it until its response ends (or fails: 500)."""

    def __init__(self, app: ASGIApp, metrics: PlatformMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            self.metrics.observe(
                scope["method"], _route_template(scope), status, time.perf_counter() - started
            )


def get_platform_metrics(request: Request) -> PlatformMetrics:
    return request.app.state.platform_metrics


PlatformMetricsDep = Annotated[PlatformMetrics, Depends(get_platform_metrics)]

router = APIRouter(tags=["health"])


@router.get("/metrics", response_class=Response)
def metrics(context: ContextDep, platform_metrics: PlatformMetricsDep) -> Response:
    """Prometheus exposition (unauthenticated: keep it off public networks)."""
    parts = [generate_latest(platform_metrics.registry)]
    registry = None if context.engine is None else context.engine.metrics_registry()
    if registry is not None:  # in-process engine (engine processes serve their own)
        parts.append(generate_latest(registry))
    return Response(b"".join(parts), media_type=CONTENT_TYPE_LATEST)
