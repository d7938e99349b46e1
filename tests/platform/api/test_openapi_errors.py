"""``/openapi.json`` declares the errors routes really answer, in this API's error shape."""

from __future__ import annotations

import re

import pytest
from fastapi import FastAPI

from loramux.platform.api import openapi_errors
from loramux.platform.api.errors import ErrorBody

ERROR_REF = "#/components/schemas/ErrorBody"
METHODS = ("get", "post", "put", "patch", "delete")


@pytest.fixture
def spec(client) -> dict:
    response = client.get("/openapi.json")
    assert response.status_code == 200, response.text
    return response.json()


def _operations(spec: dict):
    for path, item in spec["paths"].items():
        for method in METHODS:
            if method in item:
                yield path, method, item[method]


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "no-such-thing", path)


def test_every_error_response_uses_the_error_envelope(spec):
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    envelope = spec["components"]["schemas"]["ErrorBody"]
    assert envelope["required"] == ["error"]
    detail = spec["components"]["schemas"]["ErrorDetail"]
    assert set(detail["properties"]) == {"message", "type", "code"}
    for path, method, operation in _operations(spec):
        for status, response in operation["responses"].items():
            if status.startswith("4"):
                schema = response["content"]["application/json"]["schema"]
                assert schema == {"$ref": ERROR_REF}, (method, path, status)
                assert response["description"], (method, path, status)


def test_routes_that_answer_401_document_it_and_the_others_do_not(client, spec):
    for path, method, operation in _operations(spec):
        response = client.request(method.upper(), _concrete(path), json={})
        documented = "401" in operation["responses"]
        assert (response.status_code == 401) == documented, (method, path, response.text)
        if documented:
            ErrorBody.model_validate(response.json())


def test_routes_with_a_path_parameter_document_404_and_422(spec):
    for path, method, operation in _operations(spec):
        if "{" in path:
            assert {"404", "422"} <= set(operation["responses"]), (method, path)


def test_routes_with_a_body_document_400_408_413_and_422(spec):
    for path, method, operation in _operations(spec):
        if "requestBody" in operation:
            assert {"400", "408", "413", "422"} <= set(operation["responses"]), (method, path)


def test_service_specific_statuses_are_documented(spec):
    def statuses(method: str, path: str) -> set[str]:
        return set(spec["paths"][path][method]["responses"])

    inference = (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/adapters/{name}/completions",
        "/v1/responses",
        "/v1/adapters/{name}/responses",
    )
    for path in inference:
        assert {"400", "401", "402", "404", "422", "429", "500", "503"} <= statuses("post", path)
    # Whatever reads the database can find it unreachable (503 database_unavailable).
    for path in ("/admin/tenants", "/v1/adapters", "/v1/usage", "/v1/models"):
        assert "503" in statuses("get", path)
    assert "409" in statuses("post", "/admin/tenants")
    assert "409" in statuses("patch", "/admin/tenants/{tenant_id}")
    assert {"401", "409", "413", "422", "503"} <= statuses("post", "/v1/adapters")
    assert "404" in statuses("get", "/admin/usage")
    # Liveness, readiness and metrics answer anyone.
    for path in ("/health", "/healthz", "/readyz", "/metrics"):
        assert "401" not in statuses("get", path)


def test_real_errors_match_the_declared_ones(client, admin, spec):
    conflict = client.post("/admin/tenants", json={"name": "twice"}, headers=admin)
    assert conflict.status_code == 201
    again = client.post("/admin/tenants", json={"name": "twice"}, headers=admin)
    assert (
        again.status_code == 409 and "409" in spec["paths"]["/admin/tenants"]["post"]["responses"]
    )
    ErrorBody.model_validate(again.json())
    missing = client.get("/admin/tenants/nope", headers=admin)
    assert missing.status_code == 404
    ErrorBody.model_validate(missing.json())


def test_a_stale_route_entry_is_reported(monkeypatch):
    stale = {**openapi_errors.ROUTE_STATUSES, ("POST", "/no/such/route"): frozenset({409})}
    monkeypatch.setattr(openapi_errors, "ROUTE_STATUSES", stale)
    with pytest.raises(RuntimeError, match="/no/such/route"):
        openapi_errors.install_error_docs(FastAPI())
