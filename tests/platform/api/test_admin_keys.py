"""Tenants' API keys over ``/admin``: shown once, stored hashed, listed safely, revocable."""

from __future__ import annotations

import hashlib

import pytest
from sqlalchemy import select

from loramux.platform.api.deps import current_tenant
from loramux.platform.api.errors import APIError
from loramux.platform.db.models import ApiKey
from tests.platform.api.conftest import assert_openai_error

LISTED_FIELDS = {"id", "prefix", "name", "created_at", "last_used_at", "revoked_at"}


@pytest.fixture
def tenant(new_tenant) -> dict:
    return new_tenant(name="acme")


def _create_key(client, admin, tenant_id: str, **body) -> dict:
    response = client.post(f"/admin/tenants/{tenant_id}/api-keys", json=body or None, headers=admin)
    assert response.status_code == 201, response.text
    return response.json()


def _authenticate(context, key: str):
    """What the ``current_tenant`` dependency makes of ``key``."""
    with context.sessions() as session:
        return current_tenant(session, key)


def test_create_returns_the_key_once(client, admin, tenant):
    created = _create_key(client, admin, tenant["id"], name="ci")
    assert set(created) == {"id", "key", "prefix", "name", "created_at"}
    assert created["key"].startswith("lmx-")
    assert len(created["key"]) >= 40
    assert created["prefix"] == created["key"][:12]
    assert created["name"] == "ci"

    listing = client.get(f"/admin/tenants/{tenant['id']}/api-keys", headers=admin)
    assert listing.status_code == 200, listing.text
    (listed,) = listing.json()
    assert set(listed) == LISTED_FIELDS
    assert listed["id"] == created["id"]
    assert listed["prefix"] == created["prefix"]
    assert listed["name"] == "ci"
    assert listed["created_at"] == created["created_at"]
    assert listed["last_used_at"] is None and listed["revoked_at"] is None
    assert created["key"] not in listing.text
    assert hashlib.sha256(created["key"].encode()).hexdigest() not in listing.text


def test_body_is_optional(client, admin, tenant):
    created = _create_key(client, admin, tenant["id"])
    assert created["name"] is None
    empty = client.post(f"/admin/tenants/{tenant['id']}/api-keys", json={}, headers=admin)
    assert empty.status_code == 201, empty.text


def test_keys_differ_and_are_listed_oldest_first(client, admin, tenant):
    keys = [_create_key(client, admin, tenant["id"], name=f"k{i}") for i in range(3)]
    assert len({k["key"] for k in keys}) == 3
    listed = client.get(f"/admin/tenants/{tenant['id']}/api-keys", headers=admin).json()
    assert [k["id"] for k in listed] == [k["id"] for k in keys]


def test_lists_are_per_tenant(client, admin, new_tenant):
    one, two = new_tenant(), new_tenant()
    key = _create_key(client, admin, one["id"])
    assert client.get(f"/admin/tenants/{two['id']}/api-keys", headers=admin).json() == []
    listed = client.get(f"/admin/tenants/{one['id']}/api-keys", headers=admin).json()
    assert [k["id"] for k in listed] == [key["id"]]


def test_create_rejects_bad_bodies(client, admin, context, tenant, subtests):
    url = f"/admin/tenants/{tenant['id']}/api-keys"
    for body in ({"name": ""}, {"name": "x" * 201}, {"nope": 1}, {"name": 5}, [1]):
        with subtests.test(body=body):
            assert_openai_error(client.post(url, json=body, headers=admin), 422)
            with context.sessions() as session:
                assert session.scalars(select(ApiKey)).all() == []


def test_only_the_hash_is_stored(client, admin, context, tenant):
    created = _create_key(client, admin, tenant["id"], name="secret-holder")
    with context.sessions() as session:
        (row,) = session.scalars(select(ApiKey)).all()
        assert row.id == created["id"]
        assert row.key_hash == hashlib.sha256(created["key"].encode()).hexdigest()
        assert row.prefix == created["key"][:12]
        stored = [str(getattr(row, column.key)) for column in ApiKey.__table__.columns]
    assert all(created["key"] not in value for value in stored), stored


def test_a_live_key_authenticates_its_tenant(client, admin, context, tenant):
    created = _create_key(client, admin, tenant["id"])
    assert _authenticate(context, created["key"]).id == tenant["id"]


def test_revoked_key_is_rejected(client, admin, context, tenant):
    revoked = _create_key(client, admin, tenant["id"])
    kept = _create_key(client, admin, tenant["id"])

    response = client.delete(f"/admin/api-keys/{revoked['id']}", headers=admin)
    assert response.status_code == 204
    assert response.content == b""

    with pytest.raises(APIError) as caught:
        _authenticate(context, revoked["key"])
    assert caught.value.status_code == 401
    assert _authenticate(context, kept["key"]).id == tenant["id"]

    listed = {
        k["id"]: k
        for k in client.get(f"/admin/tenants/{tenant['id']}/api-keys", headers=admin).json()
    }
    assert listed[revoked["id"]]["revoked_at"] is not None
    assert listed[kept["id"]]["revoked_at"] is None


def test_revoking_twice_keeps_the_first_time(client, admin, tenant):
    key = _create_key(client, admin, tenant["id"])
    assert client.delete(f"/admin/api-keys/{key['id']}", headers=admin).status_code == 204
    url = f"/admin/tenants/{tenant['id']}/api-keys"
    (first,) = client.get(url, headers=admin).json()
    assert client.delete(f"/admin/api-keys/{key['id']}", headers=admin).status_code == 204
    (second,) = client.get(url, headers=admin).json()
    assert second["revoked_at"] == first["revoked_at"]


def test_revoking_an_unknown_key_is_404(client, admin):
    error = assert_openai_error(client.delete("/admin/api-keys/" + "0" * 32, headers=admin), 404)
    assert error["type"] == "not_found_error"


def test_deleting_the_tenant_rejects_its_keys(client, admin, context, tenant):
    key = _create_key(client, admin, tenant["id"])
    assert client.delete(f"/admin/tenants/{tenant['id']}", headers=admin).status_code == 204
    with pytest.raises(APIError) as caught:
        _authenticate(context, key["key"])
    assert caught.value.status_code == 401


def test_a_tenant_key_is_not_an_admin_token(client, tenant, admin):
    key = _create_key(client, admin, tenant["id"])
    response = client.get("/admin/tenants", headers={"Authorization": f"Bearer {key['key']}"})
    assert_openai_error(response, 401)
