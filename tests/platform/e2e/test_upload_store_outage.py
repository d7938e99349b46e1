"""An adapter upload during an S3 outage (PostgreSQL, S3 on a private moto server).

The upload answers a JSON 503 ``store_unavailable`` that says to try again, and leaves
nothing: no version row, no adapter row, no object in the bucket (not even a pending
multipart upload or a ``tmp/`` object), nothing in the upload scratch folder. Once the
store is back, the same upload succeeds.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from loramux.platform.db.models import Adapter, AdapterVersion
from loramux.platform.services.upload_workspace import SCRATCH_DIR
from loramux.platform.settings import Settings
from tests.fixtures.moto_server import RestartableMotoServer
from tests.platform.e2e.conftest import Platform, start_platform

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture
def platform(tmp_path, tiny_model_dir, postgres_database_url, store_server, bucket):
    settings = Settings(
        data_dir=tmp_path / "data",
        model=str(tiny_model_dir),
        database_url=postgres_database_url,
        **store_server.endpoint.store_settings(bucket),
    )
    with start_platform(settings) as running:
        yield running


def _bucket_contents(server: RestartableMotoServer, bucket: str) -> dict[str, list]:
    client = server.endpoint.client()
    objects = client.list_objects_v2(Bucket=bucket).get("Contents", [])
    uploads = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    return {"objects": [o["Key"] for o in objects], "multipart": [u["Key"] for u in uploads]}


def _rows(platform: Platform) -> tuple[int, int]:
    with platform.context.sessions() as session:
        return (
            session.scalar(select(func.count()).select_from(Adapter)),
            session.scalar(select(func.count()).select_from(AdapterVersion)),
        )


def test_an_upload_during_a_store_outage_answers_503_and_leaves_nothing(
    platform, store_server, bucket, make_adapter, tiny_model_dir
):
    adapter_dir: Path = make_adapter(tiny_model_dir, rank=4, targets=("v_proj",), seed=21)
    files = [("files", (f, (adapter_dir / f).read_bytes())) for f in ADAPTER_FILES]
    tenant = platform.new_tenant()

    def upload() -> httpx.Response:
        return httpx.post(
            f"{platform.url}/v1/adapters",
            data={"name": "stormy"},
            files=files,
            headers=tenant.headers,
            timeout=60,
        )

    store_server.stop()
    refused = upload()
    assert refused.status_code == 503, refused.text
    assert refused.headers["content-type"] == "application/json"
    error = refused.json()["error"]
    assert error["code"] == "store_unavailable", error
    assert error["type"] == "server_error"
    assert "try again" in error["message"].lower(), error
    assert store_server.endpoint.endpoint_url not in error["message"], error

    assert _rows(platform) == (0, 0)
    missing = httpx.get(f"{platform.url}/v1/adapters/stormy", headers=tenant.headers)
    assert missing.status_code == 404
    scratch = platform.context.settings.data_dir / SCRATCH_DIR
    assert list(scratch.iterdir()) == []

    store_server.start()
    assert _bucket_contents(store_server, bucket) == {"objects": [], "multipart": []}
    accepted = upload()
    assert accepted.status_code == 201, accepted.text
    assert accepted.json()["version"] == 1
    assert _rows(platform) == (1, 1)
