"""``/admin/tenants``: CRUD, validation, money exactness, auth and the engine push."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import func, select

from loramux.platform.db.models import ApiKey, Price, Tenant
from loramux.platform.services import tenants as tenants_service
from tests.platform.api.conftest import assert_openai_error

FULL = {
    "name": "acme",
    "priority": 8,
    "weight": 2.5,
    "requests_per_minute": 600,
    "tokens_per_minute": 100_000,
    "monthly_budget_usd": 1234.56,
    "input_price_per_mtok": 0.15,
    "cached_input_price_per_mtok": 0.075,
    "output_price_per_mtok": 0.6,
}


class _AnyTime:
    """Equal to any ISO timestamp string (for fields a change refreshes)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, str) and "T" in other

    def __repr__(self) -> str:
        return "<any time>"


ANY_TIME = _AnyTime()


def _count(context, model, *where) -> int:
    with context.sessions() as session:
        return session.scalar(select(func.count()).select_from(model).where(*where))


def _prices(context, tenant_id: str) -> list[Price]:
    with context.sessions() as session:
        statement = select(Price).where(Price.tenant_id == tenant_id).order_by(Price.effective_from)
        return list(session.scalars(statement))


# --- create, read ----------------------------------------------------------------------------


def test_create_with_every_field_round_trips(client, admin, context):
    response = client.post("/admin/tenants", json=FULL, headers=admin)
    assert response.status_code == 201, response.text
    created = response.json()
    assert created["id"]
    for field, value in FULL.items():
        assert created[field] == value, field
    assert created["created_at"] and created["updated_at"]

    fetched = client.get(f"/admin/tenants/{created['id']}", headers=admin)
    assert fetched.status_code == 200, fetched.text
    assert fetched.json() == created

    with context.sessions() as session:
        row = session.get(Tenant, created["id"])
        assert row.monthly_budget_micro_usd == 1_234_560_000
    (price,) = _prices(context, created["id"])
    assert price.input_micro_usd_per_mtok == 150_000
    assert price.cached_input_micro_usd_per_mtok == 75_000
    assert price.output_micro_usd_per_mtok == 600_000


def test_create_defaults(new_tenant, context):
    tenant = new_tenant(name="plain")
    assert tenant["priority"] == 5
    assert tenant["weight"] == 1.0
    assert tenant["requests_per_minute"] is None
    assert tenant["tokens_per_minute"] is None
    assert tenant["monthly_budget_usd"] is None
    assert tenant["input_price_per_mtok"] == 0.0
    assert tenant["cached_input_price_per_mtok"] == 0.0
    assert tenant["output_price_per_mtok"] == 0.0
    assert len(_prices(context, tenant["id"])) == 1


def test_cached_input_price_defaults_to_the_input_price(new_tenant, context):
    tenant = new_tenant(input_price_per_mtok=0.3, output_price_per_mtok=1.2)
    assert tenant["cached_input_price_per_mtok"] == 0.3
    (price,) = _prices(context, tenant["id"])
    assert price.cached_input_micro_usd_per_mtok == price.input_micro_usd_per_mtok == 300_000


EXACT_AMOUNTS = [
    (0.15, 150_000),
    (0.3, 300_000),  # 0.1 + 0.2 territory: must not become 299_999
    (0.000001, 1),
    (1234.567891, 1_234_567_891),
    (29.99, 29_990_000),
    (0, 0),
    (7, 7_000_000),
]


def test_dollars_become_exact_micro_dollars(new_tenant, context, subtests):
    for usd, micro in EXACT_AMOUNTS:
        with subtests.test(usd=usd):
            tenant = new_tenant(
                input_price_per_mtok=usd, output_price_per_mtok=usd, monthly_budget_usd=usd
            )
            (price,) = _prices(context, tenant["id"])
            assert price.input_micro_usd_per_mtok == micro
            assert price.output_micro_usd_per_mtok == micro
            with context.sessions() as session:
                assert session.get(Tenant, tenant["id"]).monthly_budget_micro_usd == micro
            assert tenant["input_price_per_mtok"] == usd
            assert tenant["monthly_budget_usd"] == usd


def test_list_shows_live_tenants_only(client, admin, new_tenant):
    first, second, third = new_tenant(), new_tenant(), new_tenant()
    assert client.delete(f"/admin/tenants/{second['id']}", headers=admin).status_code == 204
    response = client.get("/admin/tenants", headers=admin)
    assert response.status_code == 200, response.text
    assert [t["id"] for t in response.json()] == [first["id"], third["id"]]
    assert response.json()[0] == first


def test_list_is_empty_without_tenants(client, admin):
    response = client.get("/admin/tenants", headers=admin)
    assert response.status_code == 200
    assert response.json() == []


# --- validation ------------------------------------------------------------------------------


# Each case is a subtest of one test: one app per test is the slow part of this suite.
BAD_CREATE_VALUES = [
    ("priority", 10),
    ("priority", -1),
    ("priority", "5"),
    ("priority", 5.5),
    ("weight", 0),
    ("weight", -1.0),
    ("weight", "2"),
    ("requests_per_minute", 0),
    ("tokens_per_minute", -5),
    ("monthly_budget_usd", -0.01),
    ("input_price_per_mtok", -0.15),
    ("cached_input_price_per_mtok", -1),
    ("output_price_per_mtok", -0.000001),
    ("input_price_per_mtok", 0.1234567),  # finer than a micro-dollar
    ("monthly_budget_usd", 1e-7),
    ("output_price_per_mtok", 1e30),
    ("name", ""),
    ("name", "   "),
    ("name", "x" * 201),
    ("unknown_field", 1),
]


def test_create_rejects_bad_values_naming_the_field(client, admin, context, subtests):
    for field, value in BAD_CREATE_VALUES:
        with subtests.test(field=field, value=value):
            body = {"name": "bad", field: value}
            response = client.post("/admin/tenants", json=body, headers=admin)
            error = assert_openai_error(response, 422)
            assert error["type"] == "invalid_request_error"
            assert field in error["message"]
            assert _count(context, Tenant) == 0


def test_create_requires_a_name(client, admin):
    error = assert_openai_error(client.post("/admin/tenants", json={}, headers=admin), 422)
    assert "name" in error["message"]


def test_duplicate_name_is_409_and_leaves_one_tenant(client, admin, context, new_tenant):
    new_tenant(name="acme")
    response = client.post("/admin/tenants", json={"name": "acme", "priority": 2}, headers=admin)
    error = assert_openai_error(response, 409)
    assert error["type"] == "conflict_error"
    assert "acme" in error["message"]
    assert _count(context, Tenant) == 1
    assert _count(context, Price) == 1


def test_a_name_race_lost_at_the_database_is_409_too(client, admin, context, monkeypatch):
    assert client.post("/admin/tenants", json={"name": "raced"}, headers=admin).status_code == 201
    checks = []
    real_check = tenants_service._name_taken

    def first_check_misses(session, name, **kwargs):
        # The competitor commits between our check and our insert.
        checks.append(name)
        return False if len(checks) == 1 else real_check(session, name, **kwargs)

    monkeypatch.setattr(tenants_service, "_name_taken", first_check_misses)
    response = client.post("/admin/tenants", json={"name": "raced"}, headers=admin)
    assert_openai_error(response, 409)
    assert _count(context, Tenant) == 1
    assert _count(context, Price) == 1


def test_names_are_trimmed(new_tenant, client, admin):
    tenant = new_tenant(name="  spaced  ")
    assert tenant["name"] == "spaced"
    response = client.post("/admin/tenants", json={"name": "spaced"}, headers=admin)
    assert_openai_error(response, 409)


# --- patch -----------------------------------------------------------------------------------


def test_patch_every_field(client, admin, context, new_tenant):
    tenant = new_tenant(name="before", input_price_per_mtok=1, output_price_per_mtok=2)
    changes = {**FULL, "name": "after", "priority": 0, "weight": 0.25}
    response = client.patch(f"/admin/tenants/{tenant['id']}", json=changes, headers=admin)
    assert response.status_code == 200, response.text
    patched = response.json()
    for field, value in changes.items():
        assert patched[field] == value, field
    assert patched["id"] == tenant["id"]
    assert patched["created_at"] == tenant["created_at"]
    assert patched["updated_at"] > tenant["updated_at"]
    assert client.get(f"/admin/tenants/{tenant['id']}", headers=admin).json() == patched


def test_patch_a_subset_keeps_the_rest(client, admin, new_tenant):
    tenant = new_tenant(**{**FULL, "name": "keep"})
    response = client.patch(
        f"/admin/tenants/{tenant['id']}", json={"tokens_per_minute": 5}, headers=admin
    )
    assert response.status_code == 200, response.text
    assert response.json() == {**tenant, "tokens_per_minute": 5, "updated_at": ANY_TIME}


def test_patch_null_clears_limits_and_budget(client, admin, new_tenant):
    tenant = new_tenant(requests_per_minute=10, tokens_per_minute=100, monthly_budget_usd=5)
    body = {"requests_per_minute": None, "tokens_per_minute": None, "monthly_budget_usd": None}
    response = client.patch(f"/admin/tenants/{tenant['id']}", json=body, headers=admin)
    assert response.status_code == 200, response.text
    assert response.json()["requests_per_minute"] is None
    assert response.json()["tokens_per_minute"] is None
    assert response.json()["monthly_budget_usd"] is None


def test_empty_patch_changes_nothing(client, admin, new_tenant, context):
    tenant = new_tenant(**{**FULL, "name": "same"})
    response = client.patch(f"/admin/tenants/{tenant['id']}", json={}, headers=admin)
    assert response.status_code == 200, response.text
    assert response.json() == tenant
    assert len(_prices(context, tenant["id"])) == 1


def test_price_change_adds_a_price_row(client, admin, context, new_tenant):
    tenant = new_tenant(input_price_per_mtok=0.15, output_price_per_mtok=0.6)
    response = client.patch(
        f"/admin/tenants/{tenant['id']}", json={"output_price_per_mtok": 0.9}, headers=admin
    )
    assert response.status_code == 200, response.text
    assert response.json()["output_price_per_mtok"] == 0.9
    assert response.json()["input_price_per_mtok"] == 0.15
    old, new = _prices(context, tenant["id"])
    assert (old.input_micro_usd_per_mtok, old.output_micro_usd_per_mtok) == (150_000, 600_000)
    assert (new.input_micro_usd_per_mtok, new.cached_input_micro_usd_per_mtok) == (
        150_000,
        150_000,
    )
    assert new.output_micro_usd_per_mtok == 900_000
    assert new.effective_from > old.effective_from


def test_input_price_change_moves_the_cached_price_unless_given(client, admin, new_tenant):
    tenant = new_tenant(input_price_per_mtok=1, cached_input_price_per_mtok=0.5)
    url = f"/admin/tenants/{tenant['id']}"
    both = client.patch(url, json={"input_price_per_mtok": 2}, headers=admin).json()
    assert (both["input_price_per_mtok"], both["cached_input_price_per_mtok"]) == (2, 2)
    own = client.patch(
        url, json={"input_price_per_mtok": 3, "cached_input_price_per_mtok": 1}, headers=admin
    ).json()
    assert (own["input_price_per_mtok"], own["cached_input_price_per_mtok"]) == (3, 1)
    cached = client.patch(url, json={"cached_input_price_per_mtok": 0.25}, headers=admin).json()
    assert (cached["input_price_per_mtok"], cached["cached_input_price_per_mtok"]) == (3, 0.25)


def test_quick_successive_price_changes_all_land(client, admin, context, new_tenant):
    tenant = new_tenant()
    url = f"/admin/tenants/{tenant['id']}"
    for cents in range(1, 6):
        body = {"input_price_per_mtok": cents / 100}
        assert client.patch(url, json=body, headers=admin).status_code == 200
    assert client.get(url, headers=admin).json()["input_price_per_mtok"] == 0.05
    assert len(_prices(context, tenant["id"])) == 6


BAD_PATCH_VALUES = [
    ("priority", 10),
    ("weight", 0),
    ("input_price_per_mtok", -1),
    ("monthly_budget_usd", 0.0000001),
    ("name", None),
    ("priority", None),
    ("weight", None),
    ("output_price_per_mtok", None),
    ("id", "other"),
]


def test_patch_rejects_bad_values(client, admin, context, new_tenant, subtests):
    tenant = new_tenant(name="stable")
    url = f"/admin/tenants/{tenant['id']}"
    for field, value in BAD_PATCH_VALUES:
        with subtests.test(field=field, value=value):
            response = client.patch(url, json={field: value, "tokens_per_minute": 9}, headers=admin)
            error = assert_openai_error(response, 422)
            assert field in error["message"]
            assert client.get(url, headers=admin).json() == tenant
            assert len(_prices(context, tenant["id"])) == 1


def test_rename_to_a_taken_name_is_409_and_changes_nothing(client, admin, new_tenant):
    new_tenant(name="taken")
    tenant = new_tenant(name="mine")
    response = client.patch(
        f"/admin/tenants/{tenant['id']}", json={"name": "taken", "priority": 1}, headers=admin
    )
    assert_openai_error(response, 409)
    assert client.get(f"/admin/tenants/{tenant['id']}", headers=admin).json() == tenant


def test_rename_to_its_own_name_is_fine(client, admin, new_tenant):
    tenant = new_tenant(name="mine")
    response = client.patch(f"/admin/tenants/{tenant['id']}", json={"name": "mine"}, headers=admin)
    assert response.status_code == 200, response.text


# --- delete and 404 --------------------------------------------------------------------------


def test_delete_soft_deletes_and_revokes_keys(client, admin, context, new_tenant):
    tenant = new_tenant()
    for _ in range(2):
        created = client.post(f"/admin/tenants/{tenant['id']}/api-keys", headers=admin)
        assert created.status_code == 201, created.text

    response = client.delete(f"/admin/tenants/{tenant['id']}", headers=admin)
    assert response.status_code == 204
    assert response.content == b""

    with context.sessions() as session:
        row = session.get(Tenant, tenant["id"])
        assert row is not None and row.deleted_at is not None
        keys = session.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant["id"])).all()
        assert len(keys) == 2
        assert all(key.revoked_at is not None for key in keys)


TENANT_ROUTES = [
    ("GET", "/admin/tenants/{id}", None),
    ("PATCH", "/admin/tenants/{id}", {"priority": 1}),
    ("DELETE", "/admin/tenants/{id}", None),
    ("POST", "/admin/tenants/{id}/api-keys", {"name": "k"}),
    ("GET", "/admin/tenants/{id}/api-keys", None),
]


def test_unknown_and_deleted_tenants_are_404(client, admin, new_tenant, subtests):
    deleted = new_tenant()
    assert client.delete(f"/admin/tenants/{deleted['id']}", headers=admin).status_code == 204
    for method, path, body in TENANT_ROUTES:
        for tenant_id in ("0" * 32, "not-an-id", deleted["id"]):
            with subtests.test(method=method, path=path, tenant_id=tenant_id):
                url = path.format(id=tenant_id)
                response = client.request(method, url, json=body, headers=admin)
                error = assert_openai_error(response, 404)
                assert error["type"] == "not_found_error"


def test_deleted_name_stays_reserved(client, admin, new_tenant):
    tenant = new_tenant(name="gone")
    client.delete(f"/admin/tenants/{tenant['id']}", headers=admin)
    assert_openai_error(client.post("/admin/tenants", json={"name": "gone"}, headers=admin), 409)


# --- auth ------------------------------------------------------------------------------------

ADMIN_ROUTES = [
    ("POST", "/admin/tenants", {"name": "x"}),
    ("GET", "/admin/tenants", None),
    ("GET", "/admin/tenants/{id}", None),
    ("PATCH", "/admin/tenants/{id}", {"priority": 1}),
    ("DELETE", "/admin/tenants/{id}", None),
    ("POST", "/admin/tenants/{id}/api-keys", {"name": "k"}),
    ("GET", "/admin/tenants/{id}/api-keys", None),
    ("DELETE", "/admin/api-keys/{key_id}", None),
]


@pytest.fixture
def tenant_and_key(client, admin, new_tenant) -> tuple[dict, dict]:
    tenant = new_tenant(name="victim")
    key = client.post(f"/admin/tenants/{tenant['id']}/api-keys", headers=admin).json()
    return tenant, key


@pytest.mark.parametrize(
    ("method", "path", "body"), ADMIN_ROUTES, ids=[f"{m} {p}" for m, p, _ in ADMIN_ROUTES]
)
def test_admin_routes_need_the_admin_token(
    client, context, admin, tenant_and_key, subtests, method, path, body
):
    tenant, key = tenant_and_key
    credentials = {
        "no token": ({}, "missing_api_key"),
        "wrong token": ({"Authorization": "Bearer not-the-admin-token"}, "invalid_api_key"),
        "not bearer": ({"Authorization": f"Basic {context.admin_token}"}, "missing_api_key"),
        "tenant api key": ({"Authorization": f"Bearer {key['key']}"}, "invalid_api_key"),
    }
    url = path.format(id=tenant["id"], key_id=key["id"])
    for label, (headers, code) in credentials.items():
        with subtests.test(credentials=label):
            response = client.request(method, url, json=body, headers=headers)
            error = assert_openai_error(response, 401)
            assert error["type"] == "authentication_error"
            assert error["code"] == code
            assert context.admin_token not in response.text
            # Nothing happened: the tenant and its key are as they were.
            assert client.get(f"/admin/tenants/{tenant['id']}", headers=admin).json() == tenant
            listed = client.get(f"/admin/tenants/{tenant['id']}/api-keys", headers=admin).json()
            assert [k["revoked_at"] for k in listed] == [None]
            assert _count(context, Tenant) == 1


# --- the engine ------------------------------------------------------------------------------


def _wait_for(predicate, timeout: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def test_patch_weight_reaches_the_running_engine(client, admin, context, new_tenant):
    assert context.engine is not None and context.engine.is_running
    tenant = new_tenant(weight=1.5)
    weights = context.engine.engine.scheduler.fair.weights
    assert _wait_for(lambda: weights.get(tenant["id"]) == 1.5)

    response = client.patch(f"/admin/tenants/{tenant['id']}", json={"weight": 4.0}, headers=admin)
    assert response.status_code == 200, response.text
    assert _wait_for(lambda: weights.get(tenant["id"]) == 4.0)


def test_patch_priority_reaches_the_running_engine_after_commit(
    client, admin, context, new_tenant, monkeypatch
):
    tenant = new_tenant(priority=5)
    calls: list[tuple[str, int, int]] = []
    original = context.engine.set_tenant_priority

    async def recording(tenant_id: str, priority: int) -> int:
        # What the database says when the engine is told: the push comes after the commit.
        with context.sessions() as session:
            stored = session.get(Tenant, tenant_id).priority
        calls.append((tenant_id, priority, stored))
        return await original(tenant_id, priority)

    monkeypatch.setattr(context.engine, "set_tenant_priority", recording)
    response = client.patch(f"/admin/tenants/{tenant['id']}", json={"priority": 9}, headers=admin)
    assert response.status_code == 200, response.text
    assert _wait_for(lambda: calls == [(tenant["id"], 9, 9)]), calls


def test_patch_without_scheduling_fields_leaves_the_engine_alone(
    client, admin, context, new_tenant, monkeypatch
):
    tenant = new_tenant()
    calls = []

    async def recording(*args):
        calls.append(args)

    monkeypatch.setattr(context.engine, "set_tenant_priority", recording)
    monkeypatch.setattr(context.engine, "set_tenant_weight", recording)
    response = client.patch(
        f"/admin/tenants/{tenant['id']}", json={"tokens_per_minute": 7}, headers=admin
    )
    assert response.status_code == 200, response.text
    assert calls == []


def test_rejected_patch_does_not_reach_the_engine(client, admin, context, new_tenant):
    tenant = new_tenant(weight=2.0)
    weights = context.engine.engine.scheduler.fair.weights
    response = client.patch(f"/admin/tenants/{tenant['id']}", json={"weight": -3}, headers=admin)
    assert_openai_error(response, 422)
    assert weights[tenant["id"]] == 2.0
