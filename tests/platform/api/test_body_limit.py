"""Request bodies over the cap are refused with 413, declared or streamed; uploads have their own."""

from __future__ import annotations

import json
from collections.abc import Iterator

from fastapi.testclient import TestClient

from loramux.platform.api.middleware.body_limit import DEFAULT_MAX_BODY_BYTES
from loramux.platform.app import create_app
from tests.platform.api.conftest import assert_openai_error

MiB = 1024 * 1024


def _big_json(size: int = 2 * MiB) -> bytes:
    body = json.dumps({"model": "x", "prompt": "a" * size, "name": "b" * 8}).encode()
    assert len(body) > DEFAULT_MAX_BODY_BYTES
    return body


def _chunks(body: bytes, size: int = 64 * 1024) -> Iterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start : start + size]


def _assert_too_large(response) -> None:
    error = assert_openai_error(response, 413)
    assert error["code"] == "request_too_large"
    assert error["type"] == "invalid_request_error"
    assert str(DEFAULT_MAX_BODY_BYTES) in error["message"]


def test_declared_length_over_the_cap_is_refused(client, admin):
    headers = {**admin, "Content-Type": "application/json"}
    for path in ("/v1/completions", "/admin/tenants"):
        response = client.post(path, content=_big_json(), headers=headers)
        assert response.request.headers["content-length"] == str(len(_big_json()))
        _assert_too_large(response)


def test_chunked_body_over_the_cap_is_refused(client, admin):
    headers = {**admin, "Content-Type": "application/json"}
    for path in ("/v1/completions", "/admin/tenants"):
        # A generator body goes out chunked, with no Content-Length to check up front.
        response = client.post(path, content=_chunks(_big_json()), headers=headers)
        assert "content-length" not in response.request.headers
        assert response.request.headers["transfer-encoding"] == "chunked"
        _assert_too_large(response)


def test_bodies_under_the_cap_still_work(client, admin):
    headers = {**admin, "Content-Type": "application/json"}
    declared = client.post("/admin/tenants", json={"name": "small"}, headers=admin)
    assert declared.status_code == 201, declared.text
    body = json.dumps({"name": "streamed"}).encode()
    streamed = client.post("/admin/tenants", content=_chunks(body, 4), headers=headers)
    assert streamed.status_code == 201, streamed.text
    assert streamed.json()["name"] == "streamed"


def test_adapter_uploads_have_the_upload_cap(client, context, admin):
    # Over the JSON cap but under the upload cap: the route answers (here: no tenant key).
    response = client.post("/v1/adapters", content=_big_json(), headers=admin)
    assert_openai_error(response, 401)
    over = context.settings.max_upload_bytes + 1
    headers = {**admin, "Content-Length": str(over)}
    refused = client.post("/v1/adapters/", content=b"x", headers=headers)
    error = assert_openai_error(refused, 413)
    assert str(context.settings.max_upload_bytes) in error["message"]


def test_the_cap_is_an_app_parameter(context, admin):
    with TestClient(create_app(context, max_body_bytes=64)) as small:
        body = json.dumps({"name": "a-tenant-name-long-enough-to-pass-64-bytes-" + "x" * 30})
        headers = {**admin, "Content-Type": "application/json"}
        refused = small.post("/admin/tenants", content=body, headers=headers)
        assert refused.status_code == 413
        assert "64 bytes" in refused.json()["error"]["message"]
        accepted = small.post("/admin/tenants", json={"name": "short"}, headers=admin)
        assert accepted.status_code == 201, accepted.text
