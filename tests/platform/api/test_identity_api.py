"""``GET /v1/me``: who the bearer token belongs to."""

from __future__ import annotations

from tests.platform.api.conftest import assert_openai_error


def test_admin_token_is_the_operator(client, admin):
    response = client.get("/v1/me", headers=admin)
    assert response.status_code == 200, response.text
    assert response.json() == {"role": "operator", "tenant_id": None, "tenant_name": None}


def test_api_key_is_its_tenant(client, admin, new_tenant):
    tenant = new_tenant(name="acme")
    key = client.post(f"/admin/tenants/{tenant['id']}/api-keys", headers=admin).json()["key"]
    response = client.get("/v1/me", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    assert response.json() == {"role": "tenant", "tenant_id": tenant["id"], "tenant_name": "acme"}


def test_unknown_missing_and_revoked_tokens_are_401(client, admin, new_tenant):
    assert_openai_error(client.get("/v1/me"), 401)
    error = assert_openai_error(client.get("/v1/me", headers={"Authorization": "Bearer nope"}), 401)
    assert error["code"] == "invalid_api_key"
    tenant = new_tenant()
    issued = client.post(f"/admin/tenants/{tenant['id']}/api-keys", headers=admin).json()
    client.delete(f"/admin/api-keys/{issued['id']}", headers=admin)
    revoked = client.get("/v1/me", headers={"Authorization": f"Bearer {issued['key']}"})
    assert assert_openai_error(revoked, 401)["message"] == "Invalid or revoked API key."


def test_the_admin_token_on_a_tenant_route_says_what_it_is_and_how_to_get_a_key(
    client, admin, context
):
    # A new operator's first try: the token `loramux serve` printed, on chat completions.
    body = {"model": context.base_model.model_id, "messages": [{"role": "user", "content": "Hi"}]}
    for method, path, json in (
        ("POST", "/v1/chat/completions", body),
        ("POST", "/v1/completions", {"model": "m", "prompt": "Hi"}),
        ("GET", "/v1/adapters", None),
    ):
        error = assert_openai_error(client.request(method, path, json=json, headers=admin), 401)
        assert error["code"] == "invalid_api_key"
        message = error["message"]
        assert message.startswith("This is the operator's admin token:"), message
        assert "POST /admin/tenants/<tenant id>/api-keys" in message
