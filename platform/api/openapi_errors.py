"""The error responses of each route, declared in ``/openapi.json`` from what the route is.

FastAPI documents a route's success and, for routes with parameters, a 422 in its own
``{"detail": [...]}`` shape, which this API never sends. Every error here is
``{"error": {"message", "type", "code"}}`` (:class:`~loramux.platform.api.errors.ErrorBody`),
so :func:`install_error_docs` rewrites the document once it is built, route by route:

- a route reading the bearer token (any auth dependency) can answer 401;
- a route using the database (a session, or an API key to look up) can answer 503 when
  the database is unreachable (``database_unavailable``);
- a route with a path parameter can answer 404 (no such resource, or not the caller's);
- a route with parameters or a body can answer 422 (this API's shape replaces FastAPI's);
- a route with a body can answer 400 (not JSON), 408 (too slow) and 413 (too large);
- inference routes (tag ``inference``) can answer 400, 402 (budget), 404 (model),
  429 (rate limit, queue full), 500 (the request's adapter failed while it ran, alone),
  503 (engine; a deadline it cannot meet) and 504 (past its deadline);
- a few routes have statuses only their services know (``ROUTE_STATUSES``).

Derived from the dependency graph, a new route is documented without anyone remembering to.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

import fastapi.routing
from fastapi import FastAPI
from fastapi.routing import APIRoute

from loramux.platform.api.deps import bearer_token, get_session
from loramux.platform.api.errors import ErrorBody

DESCRIPTIONS = {
    400: "The request cannot be served as sent (a body that is not JSON, a sampling "
    "parameter, the messages, a malformed upload form).",
    401: "Missing, invalid or revoked bearer token.",
    402: "The tenant's monthly budget is spent.",
    404: "No such resource, or not the caller's.",
    408: "The request body arrived too slowly.",
    409: "Conflict: the name is taken, or another upload of it is in progress.",
    413: "The request body is too large.",
    422: "Invalid parameters or body; the message names the field.",
    429: "Rate limit exceeded, or too many requests queued (code queue_full); retry after "
    "the Retry-After header's seconds.",
    500: "The request's adapter failed while it ran (code adapter_failed); only it stopped.",
    503: "A backend this request needs (the database, the engine, the limits store, the task "
    "queue) cannot serve now, or the request could not start before its deadline "
    "(deadline_unattainable); the code says which. Retry after the Retry-After header.",
    504: "The request passed its deadline (code deadline_exceeded); a non-streamed body "
    "carries the partial response under `partial`, billed as sent.",
}

TAG_STATUSES: dict[str, frozenset[int]] = {
    "inference": frozenset({400, 402, 404, 429, 500, 503, 504}),
}
"""Statuses every route of a tag (one router) can answer."""

ROUTE_STATUSES: dict[tuple[str, str], frozenset[int]] = {
    ("POST", "/admin/tenants"): frozenset({409}),  # name taken
    ("PATCH", "/admin/tenants/{tenant_id}"): frozenset({409}),  # name taken
    # a malformed form (too many parts, a file part without a file name); name conflict;
    # task queue down
    ("POST", "/v1/adapters"): frozenset({400, 409, 503}),
    ("PUT", "/v1/adapters/{name}/alias"): frozenset({409}),  # the version is not ready
    ("PUT", "/v1/adapters/{name}/grants/{grantee}"): frozenset({409}),  # version not ready
    # the version is not ready; over the pin quota; an operator's pin
    ("PUT", "/v1/adapters/{name}/pin"): frozenset({409}),
    ("DELETE", "/v1/adapters/{name}/pin"): frozenset({409}),  # an operator's pin
    ("PUT", "/admin/adapters/{adapter_id}/pin"): frozenset({409}),  # the version is not ready
    ("GET", "/admin/adapters"): frozenset({404}),  # unknown tenant_id
    ("GET", "/admin/usage"): frozenset({404}),  # unknown tenant_id
    ("GET", "/admin/engine"): frozenset({503}),  # no engine can report
    # a period in the future, over 31 days or backwards; a day not closed yet
    ("POST", "/admin/billing/exports"): frozenset({400}),
    ("POST", "/admin/usage/rollup"): frozenset({400}),
}
"""Statuses only a route's service knows about, by (method, path template)."""

_ERROR_SCHEMA_REF = "#/components/schemas/ErrorBody"
_FASTAPI_VALIDATION_SCHEMAS = ("HTTPValidationError", "ValidationError")


def _dependency_calls(route: APIRoute) -> Iterator[Any]:
    pending = list(route.dependant.dependencies)
    while pending:
        dependant = pending.pop()
        yield dependant.call
        pending.extend(dependant.dependencies)


def _params(route: APIRoute, kind: str) -> list[Any]:
    """The route's ``kind`` parameters ("path_params", ...), its dependencies' included."""
    found = list(getattr(route.dependant, kind))
    pending = list(route.dependant.dependencies)
    while pending:
        dependant = pending.pop()
        found.extend(getattr(dependant, kind))
        pending.extend(dependant.dependencies)
    return found


def _has_body(route: APIRoute) -> bool:
    # The upload route reads its multipart form itself and documents it in openapi_extra.
    return route.body_field is not None or "requestBody" in (route.openapi_extra or {})


def error_statuses(route: APIRoute, method: str) -> set[int]:
    """The error statuses ``route`` can answer to ``method`` (see the module docstring)."""
    statuses: set[int] = set()
    calls = list(_dependency_calls(route))
    if any(call is bearer_token for call in calls):
        statuses.add(401)
    if any(call is bearer_token or call is get_session for call in calls):
        statuses.add(503)
    if _params(route, "path_params"):
        statuses.add(404)
    if _has_body(route):
        statuses |= {400, 408, 413, 422}
    if _params(route, "path_params") or _params(route, "query_params"):
        statuses.add(422)
    for tag in route.tags:
        statuses |= TAG_STATUSES.get(str(tag), frozenset())
    statuses |= ROUTE_STATUSES.get((method, route.path_format), frozenset())
    return statuses


def _documented_routes(routes: Iterable[Any]) -> Iterator[tuple[APIRoute, str]]:
    """Each (API route, method) in the document, routers' prefixes and dependencies applied."""
    # Newer FastAPI keeps included routers whole and resolves their routes in contexts.
    resolve = getattr(fastapi.routing, "iter_route_contexts", None)
    for route in resolve(list(routes)) if resolve else routes:
        original = getattr(route, "original_route", route)
        if isinstance(original, APIRoute) and route.include_in_schema:
            for method in sorted(route.methods):
                yield route, method


def _error_schemas() -> dict[str, Any]:
    schema = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
    definitions = schema.pop("$defs", {})
    return {**definitions, "ErrorBody": schema}


def add_error_responses(spec: dict[str, Any], routes: Iterable[Any]) -> None:
    """Declare each route's error responses in ``spec`` (an OpenAPI document), in place."""
    for route, method in _documented_routes(routes):
        operation = spec["paths"][route.path_format][method.lower()]
        responses = operation.setdefault("responses", {})
        for status in sorted(error_statuses(route, method)):
            responses[str(status)] = {
                "description": DESCRIPTIONS[status],
                "content": {"application/json": {"schema": {"$ref": _ERROR_SCHEMA_REF}}},
            }
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(_error_schemas())
    # FastAPI's validation-error shape was only referenced by the 422s just replaced.
    text = json.dumps(spec["paths"])
    for name in _FASTAPI_VALIDATION_SCHEMAS:
        if f"#/components/schemas/{name}" not in text:
            schemas.pop(name, None)


def _check_route_statuses(routes: Iterable[Any]) -> None:
    """Every ``ROUTE_STATUSES`` entry names a route: a renamed route must not be forgotten."""
    known = {(method, route.path_format) for route, method in _documented_routes(routes)}
    stale = sorted(set(ROUTE_STATUSES) - known)
    if stale:
        raise RuntimeError(f"ROUTE_STATUSES names routes the app does not have: {stale}")


def install_error_docs(app: FastAPI) -> None:
    """Make ``app.openapi()`` declare every route's error responses (see the module)."""
    _check_route_statuses(app.routes)
    build_openapi = app.openapi
    documented: list[dict[str, Any]] = []  # the document last rewritten (FastAPI caches it)

    def openapi() -> dict[str, Any]:
        spec = build_openapi()
        if not documented or documented[0] is not spec:
            add_error_responses(spec, app.routes)
            documented[:] = [spec]
        return spec

    app.openapi = openapi  # type: ignore[method-assign]
