"""Pinning an adapter on the device over HTTP: a tenant pins within the quota an operator
set, the pinned version survives a flood of other adapters that evicts everything else (the
flood's requests made with the ``openai`` client), the engine panel and the tenant's pin
route say how the pin stands, an operator's pin is the operator's to lift, and another
tenant reaches none of it."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from sqlalchemy import select

from loramux.engine.memory.arena import RowLayout
from loramux.engine.model.config import ModelConfig
from loramux.platform.app import create_app
from loramux.platform.db.models import AdapterVersion
from tests.fixtures.browser import ServerThread
from tests.platform.api.conftest import (
    assert_openai_error,
    platform_context,
    store_ready_adapter,
    upload_adapter,
)
from tests.platform.db.factories import add_tenant

FLOOD = [f"flood-{i}" for i in range(5)]


@pytest.fixture
def small_device(tmp_path, tiny_model_dir, postgres_database_url):
    """A platform whose engine has device room for four rank-4 adapters (16 rows)."""
    config = ModelConfig.from_pretrained(tiny_model_dir)
    row_bytes = 2 * config.num_layers * RowLayout.for_model(config, 1, 16).row_width * 4
    engine = {"cache": {"adapter_device_bytes": 16 * row_bytes}}
    with (
        platform_context(tmp_path, tiny_model_dir, postgres_database_url, engine=engine) as ctx,
        ServerThread(create_app(ctx)) as server,
    ):
        assert ctx.engine.engine.lora_pool.capacity == 16
        yield ctx, server


def _tenant(ctx, server, name: str, **fields) -> tuple[openai.OpenAI, str]:
    admin = {"Authorization": f"Bearer {ctx.admin_token}"}
    tenant = httpx.post(f"{server.url}/admin/tenants", json={"name": name, **fields}, headers=admin)
    assert tenant.status_code == 201, tenant.text
    key = httpx.post(f"{server.url}/admin/tenants/{tenant.json()['id']}/api-keys", headers=admin)
    client = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=key.json()["key"], max_retries=0, timeout=60
    )
    return client, tenant.json()["id"]


def _call(client, method: str, path: str, server, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {client.api_key}"}
    return httpx.request(method, f"{server.url}{path}", headers=headers, timeout=60, **kwargs)


def _device_of(ctx, server, version_id: str) -> tuple[str, str | None]:
    admin = {"Authorization": f"Bearer {ctx.admin_token}"}
    panel = httpx.get(f"{server.url}/admin/engine", headers=admin).json()
    row = next(a for a in panel["adapters"] if a["engine_name"] == version_id)
    return row["tier"], row["pin"]


def test_a_pinned_adapter_survives_a_flood_that_evicts_everything_else(
    small_device, make_adapter, tiny_model_dir
):
    ctx, server = small_device
    client, tenant_id = _tenant(ctx, server, "pinner")
    folders = {
        name: make_adapter(tiny_model_dir, rank=4, targets=("q_proj", "v_proj"), seed=70 + i)
        for i, name in enumerate(["critical", *FLOOD])
    }
    uploaded = {name: upload_adapter(server, client, name, f) for name, f in folders.items()}
    size = uploaded["critical"]["size_bytes"]

    # No quota yet: a tenant pins nothing.
    refused = _call(client, "PUT", "/v1/adapters/critical/pin", server, json={})
    assert assert_openai_error(refused, 409)["code"] == "pin_quota_exceeded"
    admin = {"Authorization": f"Bearer {ctx.admin_token}"}
    patched = httpx.patch(
        f"{server.url}/admin/tenants/{tenant_id}", json={"pin_quota_bytes": size}, headers=admin
    )
    assert patched.status_code == 200 and patched.json()["pin_quota_bytes"] == size
    pinned = _call(client, "PUT", "/v1/adapters/critical/pin", server, json={})
    assert pinned.status_code == 200, pinned.text
    assert pinned.json() | {"state": None} == {
        "object": "adapter.pin",
        "adapter": "critical",
        "version": 1,
        "pinned_by": "tenant",
        "size_bytes": size,
        "state": None,
        "quota_bytes": size,
        "pinned_bytes": size,
    }
    version_id = _version_id(ctx, uploaded["critical"]["id"])
    _wait_pinned(client, server)
    assert _device_of(ctx, server, version_id) == ("device", "pinned")
    # A second pin would pass the quota.
    over = _call(client, "PUT", f"/v1/adapters/{FLOOD[0]}/pin", server, json={})
    assert assert_openai_error(over, 409)["code"] == "pin_quota_exceeded"

    # The flood: every other adapter, three rounds, from four threads; room for three.
    errors: list[BaseException] = []

    def flood(names):
        try:
            for _ in range(3):
                for name in names:
                    client.completions.create(model=name, prompt="Hi", max_tokens=2)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=flood, args=(FLOOD[i:] + FLOOD[:i],)) for i in range(4)]
    for thread in threads:
        thread.start()
    seen = []
    while any(thread.is_alive() for thread in threads):
        seen.append(_device_of(ctx, server, version_id))
    for thread in threads:
        thread.join()
    assert not errors, errors
    panel = httpx.get(f"{server.url}/admin/engine", headers=admin).json()
    assert panel["residency"]["adapter_evictions"] >= 10  # the flood evicted the others
    assert seen and all(state == ("device", "pinned") for state in seen), set(seen)
    assert client.completions.create(model="critical", prompt="Hi", max_tokens=2).choices

    # Lifted, the version is one more idle adapter.
    assert _call(client, "DELETE", "/v1/adapters/critical/pin", server).status_code == 204
    after = _call(client, "GET", "/v1/adapters/critical/pin", server).json()
    assert (after["version"], after["state"], after["pinned_bytes"]) == (None, None, 0)
    assert _device_of(ctx, server, version_id)[1] is None


def _version_id(ctx, adapter_id: str) -> str:
    with ctx.sessions() as session:
        return session.scalar(
            select(AdapterVersion.id).where(AdapterVersion.adapter_id == adapter_id)
        )


def _wait_pinned(client, server, name: str = "critical") -> dict:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pin = _call(client, "GET", f"/v1/adapters/{name}/pin", server).json()
        if pin["state"] == "pinned":
            return pin
        time.sleep(0.05)
    raise AssertionError(f"never pinned: {pin}")


def test_an_operators_pin_and_what_others_reach(small_device, make_adapter, tiny_model_dir):
    ctx, server = small_device
    owner, _ = _tenant(ctx, server, "owner", pin_quota_bytes=1 << 30)
    stranger, _ = _tenant(ctx, server, "stranger", pin_quota_bytes=1 << 30)
    folder = make_adapter(tiny_model_dir, rank=4, targets=("q_proj", "v_proj"), seed=80)
    adapter = upload_adapter(server, owner, "kept", folder)
    admin = {"Authorization": f"Bearer {ctx.admin_token}"}
    url = f"{server.url}/admin/adapters/{adapter['id']}/pin"
    by_operator = httpx.put(url, json={"version": 1}, headers=admin)
    assert by_operator.status_code == 200, by_operator.text
    assert by_operator.json()["pinned_by"] == "operator"
    assert by_operator.json()["pinned_bytes"] == 0  # outside the tenant's quota
    _wait_pinned(owner, server, "kept")
    # The tenant can neither move nor lift an operator's pin.
    for method in ("PUT", "DELETE"):
        answer = _call(owner, method, "/v1/adapters/kept/pin", server, json={})
        assert assert_openai_error(answer, 409)["code"] == "pinned_by_operator", method
    # Another tenant reaches nothing of it, however it names it.
    for method, path, status, code in (
        ("GET", "/v1/adapters/kept/pin", 404, "adapter_not_found"),
        ("PUT", "/v1/adapters/kept/pin", 404, "adapter_not_found"),
        ("DELETE", "/v1/adapters/kept/pin", 404, "adapter_not_found"),
        ("PUT", f"/admin/adapters/{adapter['id']}/pin", 401, "invalid_api_key"),
        ("DELETE", f"/admin/adapters/{adapter['id']}/pin", 401, "invalid_api_key"),
    ):
        answer = _call(stranger, method, path, server, json={})
        assert assert_openai_error(answer, status)["code"] == code, (method, path)
    # Refusals name the problem.
    for body, status, code in (
        ({"version": 2}, 404, "adapter_version_not_found"),
        ({"version": 0}, 422, "invalid_parameters"),
        ({"version": "1"}, 422, "invalid_parameters"),
    ):
        assert assert_openai_error(httpx.put(url, json=body, headers=admin), status)["code"] == code
    missing = httpx.put(f"{server.url}/admin/adapters/nope/pin", json={}, headers=admin)
    assert assert_openai_error(missing, 404)["code"] == "adapter_not_found"
    assert httpx.delete(url, headers=admin).status_code == 204
    again = httpx.delete(url, headers=admin)
    assert assert_openai_error(again, 404)["code"] == "pin_not_found"


def test_a_starting_platform_pins_what_is_stored(
    tmp_path, tiny_model_dir, postgres_database_url, make_adapter
):
    """Engines hold pins in memory only: the platform pins the stored ones as it starts."""
    folder = make_adapter(tiny_model_dir, rank=4, targets=("q_proj", "v_proj"), seed=90)
    with platform_context(tmp_path, tiny_model_dir, postgres_database_url) as ctx:
        with ctx.sessions.begin() as session:
            tenant_id = add_tenant(session).id
        version_id = store_ready_adapter(ctx, tenant_id, "stored", folder)
        with ctx.sessions.begin() as session:
            session.get(AdapterVersion, version_id).pinned_by = "operator"
        with ServerThread(create_app(ctx)) as server:
            deadline = time.monotonic() + 30
            while _device_of(ctx, server, version_id) != ("device", "pinned"):
                assert time.monotonic() < deadline, _device_of(ctx, server, version_id)
                time.sleep(0.05)
