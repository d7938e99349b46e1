"""``GET /v1/models``: the operator sees the base model; a tenant also sees its ready adapters."""

from __future__ import annotations

import pytest

from tests.platform.api.conftest import assert_openai_error

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def good_adapter(make_adapter, tiny_model_dir):
    return make_adapter(tiny_model_dir, rank=8, targets=("q_proj", "v_proj"), seed=1)


def _upload(client, headers, name, adapter_dir):
    files = [("files", (n, (adapter_dir / n).read_bytes())) for n in (CONFIG, WEIGHTS)]
    response = client.post("/v1/adapters", data={"name": name}, files=files, headers=headers)
    assert response.status_code == 201, response.text


def test_tenant_sees_base_model_and_its_ready_adapters(
    client, context, tenant_key, good_adapter, admin
):
    mine, theirs = tenant_key(), tenant_key()
    _upload(client, mine, "alpha", good_adapter)
    _upload(client, theirs, "beta", good_adapter)
    base = context.base_model.model_id

    response = client.get("/v1/models", headers=mine)
    assert response.status_code == 200, response.text
    cards = response.json()["data"]
    assert [card["id"] for card in cards] == [base, "alpha"]
    adapter_card = cards[1]
    assert adapter_card["object"] == "model"
    assert adapter_card["owned_by"] == "tenant"
    assert adapter_card["root"] == base and adapter_card["parent"] == base

    assert [c["id"] for c in client.get("/v1/models", headers=theirs).json()["data"]] == [
        base,
        "beta",
    ]
    # The operator sees the base model only.
    assert [c["id"] for c in client.get("/v1/models", headers=admin).json()["data"]] == [base]


def test_tenant_without_adapters_sees_the_base_model(client, context, tenant_key):
    cards = client.get("/v1/models", headers=tenant_key()).json()["data"]
    assert [card["id"] for card in cards] == [context.base_model.model_id]


def test_deleted_adapter_is_not_listed(client, context, tenant_key, good_adapter):
    key = tenant_key()
    _upload(client, key, "gone", good_adapter)
    assert client.delete("/v1/adapters/gone", headers=key).status_code == 204
    cards = client.get("/v1/models", headers=key).json()["data"]
    assert [card["id"] for card in cards] == [context.base_model.model_id]


def test_revoked_or_unknown_key_is_401(client):
    error = assert_openai_error(
        client.get("/v1/models", headers={"Authorization": "Bearer lmx-unknown"}), 401
    )
    assert error["code"] == "invalid_api_key"
    error = assert_openai_error(client.get("/v1/models"), 401)
    assert error["code"] == "missing_api_key"
