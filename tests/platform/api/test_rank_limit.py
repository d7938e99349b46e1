"""One rank limit for uploads and the engine (LORAMUX_MAX_ADAPTER_RANK), met over HTTP.

It used to be two: with the upload limit raised to 128, a rank-128 upload was validated
and marked ready, and then every request for it failed with a 503, since the engine's own
limit had stayed at 64. Now raising the one setting makes such an adapter servable, and at
the default it is refused at upload with a 422 that names the limit.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from loramux.platform.app import create_app
from loramux.platform.context import PlatformContext
from loramux.platform.db.models import AdapterStatus
from tests.platform.api.conftest import assert_openai_error, platform_context

RANK = 128
FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(scope="module")
def rank_128_adapter(make_adapter, tiny_model_dir):
    return make_adapter(tiny_model_dir, rank=RANK, targets=("q_proj", "v_proj"), seed=7)


def _upload(client, headers, adapter_dir):
    files = [("files", (name, (adapter_dir / name).read_bytes())) for name in FILES]
    return client.post("/v1/adapters", data={"name": "wide"}, files=files, headers=headers)


def _tenant_key(client, context) -> dict[str, str]:
    admin = {"Authorization": f"Bearer {context.admin_token}"}
    tenant = client.post("/admin/tenants", json={"name": "wide-tenant"}, headers=admin).json()
    key = client.post(f"/admin/tenants/{tenant['id']}/api-keys", headers=admin).json()["key"]
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def raised_context(tmp_path, tiny_model_dir, postgres_database_url) -> Iterator[PlatformContext]:
    with platform_context(
        tmp_path, tiny_model_dir, postgres_database_url, max_adapter_rank=RANK
    ) as context:
        yield context


def test_a_rank_128_adapter_is_served_with_the_limit_raised(raised_context, rank_128_adapter):
    with TestClient(create_app(raised_context)) as client:
        auth = _tenant_key(client, raised_context)
        upload = _upload(client, auth, rank_128_adapter)
        assert upload.status_code == 201, upload.text
        assert upload.json()["status"] == AdapterStatus.READY.value
        assert upload.json()["rank"] == RANK
        body = {"model": "wide", "prompt": "Hello", "max_tokens": 5, "ignore_eos": True}
        response = client.post("/v1/completions", json=body, headers=auth)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 5


def test_at_the_default_limit_a_rank_128_upload_is_refused(
    client, context, tenant_key, rank_128_adapter
):
    assert context.settings.max_adapter_rank == 64
    error = assert_openai_error(_upload(client, tenant_key(), rank_128_adapter), 422)
    assert "128" in error["message"] and "64" in error["message"]
