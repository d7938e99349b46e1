"""Hostile strings are clean 4xx answers, on PostgreSQL (and SQLite, last test): lone surrogates
and NUL characters in JSON bodies, paths, query strings and upload forms; honest text (emoji,
binary uploads) works."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from loramux.platform.app import create_app
from loramux.platform.context import build_context
from loramux.platform.settings import Settings
from tests.platform.api.conftest import assert_openai_error

LONE_SURROGATE = "\ud800"
NUL = "\x00"


def _post_json(client, path: str, body: dict, headers: dict[str, str], method: str = "POST"):
    # json.dumps escapes both as \ud800 and \u0000, as a hostile client's JSON would.
    return client.request(
        method,
        path,
        content=json.dumps(body).encode("ascii"),
        headers={**headers, "Content-Type": "application/json"},
    )


def _assert_refused(response, field: str) -> dict:
    assert 400 <= response.status_code < 500, response.text
    error = assert_openai_error(response, response.status_code)
    assert field in error["message"], error
    return error


@pytest.fixture
def auth(tenant_key) -> dict[str, str]:
    return tenant_key()


@pytest.fixture
def base(context) -> str:
    return context.base_model.model_id


# --- JSON bodies -----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [LONE_SURROGATE, f"a{NUL}b"], ids=["surrogate", "nul"])
def test_inference_bodies_with_bad_strings_are_refused(client, auth, base, bad):
    cases = [
        ("/v1/completions", {"model": base, "prompt": f"Hi {bad}", "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"model": bad, "prompt": "Hi", "max_tokens": 1}, "model"),
        (
            "/v1/chat/completions",
            {"model": base, "messages": [{"role": "user", "content": bad}], "max_tokens": 1},
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            {
                "model": base,
                "messages": [{"role": "user", "content": [{"type": "text", "text": bad}]}],
                "max_tokens": 1,
            },
            "messages.0.content.0.text",
        ),
        (
            "/v1/chat/completions",
            {"model": bad, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
            "model",
        ),
        ("/v1/completions", {"model": base, "prompt": "Hi", "stop": [bad]}, "stop.0"),
    ]
    for path, body, field in cases:
        _assert_refused(_post_json(client, path, body, auth), field)


@pytest.mark.parametrize("bad", [LONE_SURROGATE, f"a{NUL}b"], ids=["surrogate", "nul"])
def test_admin_bodies_with_bad_strings_are_refused(client, admin, new_tenant, bad):
    _assert_refused(_post_json(client, "/admin/tenants", {"name": bad}, admin), "name")
    tenant = new_tenant()
    path = f"/admin/tenants/{tenant['id']}"
    _assert_refused(_post_json(client, path, {"name": bad}, admin, method="PATCH"), "name")
    _assert_refused(_post_json(client, f"{path}/api-keys", {"name": bad}, admin), "name")
    # A bad key is refused like a bad value.
    _assert_refused(_post_json(client, "/admin/tenants", {"name": "x", bad: 1}, admin), "body")


def test_a_body_that_is_not_json_is_a_400_saying_where(client, auth, base):
    # FastAPI's own answer was a 422 "5491: JSON decode error": an offset, no reason.
    lines = ["{", f'  "model": "{base}",', '  "prompt": "Hi"', '  "max_tokens": 1', "}"]
    body = "\n".join(lines)  # the comma after "Hi" is missing
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        response = client.post(
            path, content=body, headers={**auth, "Content-Type": "application/json"}
        )
        error = assert_openai_error(response, 400)
        assert error["code"] == "malformed_request"
        where = body.index('"max_tokens"')
        assert error["message"] == (
            "The body is not valid JSON: Expecting ',' delimiter at line 4, column 3 "
            f"(character {where})."
        ), error


def test_honest_non_ascii_text_still_works(client, auth, base):
    # A surrogate *pair* is one character (an emoji), not a lone surrogate.
    body = {"model": base, "prompt": "Hi \ud83d\ude00 caf\u00e9", "max_tokens": 1}
    response = _post_json(client, "/v1/completions", body, auth)
    assert response.status_code == 200, response.text


# --- paths and query strings -----------------------------------------------------------------


def test_nul_in_paths_is_not_found(client, admin, auth, base):
    cases = [
        ("GET", "/v1/adapters/a%00b", auth),
        ("DELETE", "/v1/adapters/a%00b", auth),
        ("GET", "/admin/tenants/a%00b", admin),
        ("PATCH", "/admin/tenants/a%00b", admin),
        ("DELETE", "/admin/tenants/a%00b", admin),
        ("GET", "/admin/tenants/a%00b/api-keys", admin),
        ("POST", "/admin/tenants/a%00b/api-keys", admin),
        ("DELETE", "/admin/api-keys/a%00b", admin),
    ]
    for method, path, headers in cases:
        response = client.request(method, path, headers=headers, json={})
        assert_openai_error(response, 404)
    adapter_completion = _post_json(
        client, "/v1/adapters/a%00b/completions", {"prompt": "Hi", "max_tokens": 1}, auth
    )
    assert_openai_error(adapter_completion, 404)


def test_nul_in_query_strings_is_refused(client, admin, auth):
    for path, headers in (
        ("/admin/adapters?tenant_id=a%00b", admin),
        ("/admin/usage?tenant_id=a%00b", admin),
        ("/v1/usage?group_by=day%00", auth),
        ("/v1/usage?x%00=1", auth),
    ):
        _assert_refused(client.get(path, headers=headers), "query")


# --- upload forms ----------------------------------------------------------------------------


def _multipart(name: bytes, filename: bytes) -> tuple[bytes, str]:
    boundary = "hardening-boundary"
    body = b"".join(
        [
            f"--{boundary}\r\n".encode(),
            b'Content-Disposition: form-data; name="name"\r\n\r\n',
            name + b"\r\n",
            f"--{boundary}\r\n".encode(),
            b'Content-Disposition: form-data; name="files"; filename="' + filename + b'"\r\n',
            b"Content-Type: application/octet-stream\r\n\r\n",
            b"\x00\xff binary \xed\xa0\x80 bytes\r\n",
            f"--{boundary}--\r\n".encode(),
        ]
    )
    return body, f"multipart/form-data; boundary={boundary}"


@pytest.mark.parametrize(
    ("name", "filename"),
    [
        (b"a\x00b", b"adapter.tar.gz"),
        (b"a\xed\xa0\x80b", b"adapter.tar.gz"),  # a surrogate encoded as UTF-8 bytes
        (b"ok-name", b"adapter\x00.tar.gz"),
    ],
    ids=["nul-name", "surrogate-name", "nul-filename"],
)
def test_bad_upload_form_text_is_refused(client, auth, name, filename):
    body, content_type = _multipart(name, filename)
    response = client.post(
        "/v1/adapters", content=body, headers={**auth, "Content-Type": content_type}
    )
    assert 400 <= response.status_code < 500, response.text
    assert_openai_error(response, response.status_code)


# --- the embedded default --------------------------------------------------------------------


def test_sqlite_refuses_the_same(tmp_path, tiny_model_dir):
    settings = Settings(data_dir=tmp_path, model=str(tiny_model_dir), admin_token=None)
    context = build_context(settings, log=lambda _: None, with_engine=False)
    admin = {"Authorization": f"Bearer {context.admin_token}"}
    try:
        with TestClient(create_app(context)) as client:
            body = {"name": f"a{NUL}b"}
            _assert_refused(_post_json(client, "/admin/tenants", body, admin), "name")
            assert_openai_error(client.get("/admin/tenants/a%00b", headers=admin), 404)
            query = client.get("/admin/adapters?tenant_id=a%00b", headers=admin)
            _assert_refused(query, "query")
    finally:
        context.sessions.kw["bind"].dispose()
