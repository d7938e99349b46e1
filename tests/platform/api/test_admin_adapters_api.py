"""``GET /admin/adapters``: every tenant's adapters for operators."""

from __future__ import annotations

import pytest

from tests.platform.api.conftest import assert_openai_error

FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(scope="module")
def adapter_dir(make_adapter, tiny_model_dir):
    return make_adapter(tiny_model_dir, rank=4, targets=("q_proj", "v_proj"), seed=21)


def _upload(client, headers, name, adapter_dir) -> dict:
    files = [("files", (f, (adapter_dir / f).read_bytes())) for f in FILES]
    response = client.post("/v1/adapters", data={"name": name}, files=files, headers=headers)
    assert response.status_code == 201, response.text
    return response.json()


def _key(client, admin, tenant) -> dict[str, str]:
    key = client.post(f"/admin/tenants/{tenant['id']}/api-keys", headers=admin).json()["key"]
    return {"Authorization": f"Bearer {key}"}


def test_lists_every_tenants_adapters_with_owner(client, admin, new_tenant, adapter_dir):
    acme, zeta = new_tenant(name="acme"), new_tenant(name="zeta")
    _upload(client, _key(client, admin, zeta), "writer", adapter_dir)
    acme_key = _key(client, admin, acme)
    _upload(client, acme_key, "support", adapter_dir)
    _upload(client, acme_key, "billing", adapter_dir)

    response = client.get("/admin/adapters", headers=admin)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list"
    listed = [(a["tenant_name"], a["name"], a["status"], a["rank"]) for a in body["data"]]
    assert listed == [
        ("acme", "billing", "ready", 4),
        ("acme", "support", "ready", 4),
        ("zeta", "writer", "ready", 4),
    ]
    assert {a["tenant_id"] for a in body["data"][:2]} == {acme["id"]}
    # The same view of an adapter the tenant gets, plus its owner.
    own = client.get("/v1/adapters/support", headers=acme_key).json()
    assert {
        k: v for k, v in body["data"][1].items() if k not in ("tenant_id", "tenant_name")
    } == own


def test_filters_by_tenant_and_leaves_out_deleted(client, admin, new_tenant, adapter_dir):
    acme, zeta = new_tenant(name="acme"), new_tenant(name="zeta")
    acme_key = _key(client, admin, acme)
    _upload(client, acme_key, "keep", adapter_dir)
    _upload(client, acme_key, "drop", adapter_dir)
    _upload(client, _key(client, admin, zeta), "other", adapter_dir)
    assert client.delete("/v1/adapters/drop", headers=acme_key).status_code == 204

    only_acme = client.get("/admin/adapters", params={"tenant_id": acme["id"]}, headers=admin)
    assert [a["name"] for a in only_acme.json()["data"]] == ["keep"]
    assert client.delete(f"/admin/tenants/{zeta['id']}", headers=admin).status_code == 204
    everyone = client.get("/admin/adapters", headers=admin).json()["data"]
    assert [a["name"] for a in everyone] == ["keep"]  # a deleted tenant's adapters go too


def test_unknown_tenant_is_404_and_tenants_may_not_look(client, admin, tenant_key):
    error = assert_openai_error(
        client.get("/admin/adapters", params={"tenant_id": "nope"}, headers=admin), 404
    )
    assert error["code"] == "tenant_not_found"
    assert_openai_error(client.get("/admin/adapters", headers=tenant_key()), 401)
    assert_openai_error(client.get("/admin/adapters"), 401)
