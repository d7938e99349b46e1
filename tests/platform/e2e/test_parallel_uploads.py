"""Parallel first uploads of one new adapter name, over HTTP, on SQLite and PostgreSQL.

Every upload (each of its own weights) gets a clean answer and both databases behave the
same: each becomes a version of the one adapter, numbered 1, 2, 3… in the order the uploads were recorded (a 409
``adapter_upload_conflict`` is allowed only if the database stays busy past the retries,
which eight uploads never reach). Never a 500.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from loramux.platform.db.models import Adapter, AdapterVersion
from loramux.platform.settings import Settings
from tests.platform.e2e.conftest import Platform, Tenant, start_platform

PARALLEL_UPLOADS = 8
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(params=["sqlite", "postgresql"])
def platform(request, tmp_path, tiny_model_dir) -> Platform:
    database = {}
    if request.param == "postgresql":
        database = {"database_url": request.getfixturevalue("postgres_database_url")}
    settings = Settings(data_dir=tmp_path / "data", model=str(tiny_model_dir), **database)
    with start_platform(settings) as running:
        yield running


def _upload(platform: Platform, tenant: Tenant, name: str, files: list) -> httpx.Response:
    return httpx.post(
        f"{platform.url}/v1/adapters",
        data={"name": name},
        files=files,
        headers=tenant.headers,
        timeout=60,
    )


def test_parallel_first_uploads_each_become_a_version(platform, make_adapter, tiny_model_dir):
    # Different weights each: the same bytes as a ready version would be that version.
    folders: list[Path] = [
        make_adapter(tiny_model_dir, rank=4, targets=("q_proj",), seed=7 + k)
        for k in range(PARALLEL_UPLOADS)
    ]
    uploads = [[("files", (f, (d / f).read_bytes())) for f in ADAPTER_FILES] for d in folders]
    tenant = platform.new_tenant()

    with ThreadPoolExecutor(PARALLEL_UPLOADS) as pool:
        answers = list(pool.map(lambda files: _upload(platform, tenant, "twins", files), uploads))

    statuses = sorted(answer.status_code for answer in answers)
    assert statuses == [201] * PARALLEL_UPLOADS, [answer.text for answer in answers]
    bodies = [answer.json() for answer in answers]
    assert len({body["id"] for body in bodies}) == 1  # one adapter
    assert sorted(body["version"] for body in bodies) == list(range(1, PARALLEL_UPLOADS + 1))
    with platform.context.sessions() as session:
        assert len(session.scalars(select(Adapter)).all()) == 1
        versions = session.scalars(select(AdapterVersion)).all()
    assert sorted(v.version for v in versions) == list(range(1, PARALLEL_UPLOADS + 1))
    assert {v.status for v in versions} == {"ready"}
    latest = httpx.get(f"{platform.url}/v1/adapters/twins", headers=tenant.headers)
    assert latest.json()["version"] == PARALLEL_UPLOADS
