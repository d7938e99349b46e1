"""With a broker configured, uploads are validated by a real Celery worker on Redis.

The upload answers 202 ``validating``; the worker reads the files back from the store and
marks the version ``ready`` (the adapter then serves) or ``failed`` with the reason (its
files are removed, its row stays so the tenant can read why). With the broker unreachable
the upload answers 503 and keeps nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file
from sqlalchemy import select

from loramux.platform.app import create_app
from loramux.platform.context import PlatformContext, build_context
from loramux.platform.db.models import Adapter, AdapterVersion
from loramux.platform.settings import Settings
from tests.platform.tasks.worker_process import running_worker, wait_until, worker_env

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def _files(adapter_dir: Path) -> list[tuple[str, tuple[str, bytes]]]:
    return [("files", (name, (adapter_dir / name).read_bytes())) for name in (CONFIG, WEIGHTS)]


@pytest.fixture
def broker_url(redis_url: str) -> str:
    # A database of its own: no other test's messages reach this worker.
    return redis_url.rsplit("/", 1)[0] + "/3"


def _context(settings: Settings) -> PlatformContext:
    return build_context(settings, log=lambda _: None)


@pytest.fixture
def queued_context(tmp_path, tiny_model_dir, database_url, broker_url) -> Iterator[PlatformContext]:
    settings = Settings(
        data_dir=tmp_path / "data",
        model=str(tiny_model_dir),
        database_url=database_url,
        celery_broker_url=broker_url,
    )
    context = _context(settings)
    try:
        yield context
    finally:
        context.tasks.close()
        context.sessions.kw["bind"].dispose()


def _tenant_headers(client: TestClient, context: PlatformContext) -> dict[str, str]:
    admin = {"Authorization": f"Bearer {context.admin_token}"}
    tenant = client.post("/admin/tenants", json={"name": "queued"}, headers=admin).json()
    key = client.post(f"/admin/tenants/{tenant['id']}/api-keys", headers=admin).json()["key"]
    return {"Authorization": f"Bearer {key}"}


def _status(client: TestClient, headers, name: str) -> dict | None:
    body = client.get(f"/v1/adapters/{name}", headers=headers).json()
    return body if body["status"] in ("ready", "failed") else None


@pytest.fixture
def nan_adapter(make_adapter, tiny_model_dir, tmp_path) -> Path:
    good = make_adapter(tiny_model_dir, rank=4, targets=("v_proj",), seed=5)
    tensors = load_file(str(good / WEIGHTS))
    first = sorted(tensors)[0]
    tensors[first] = tensors[first].clone()
    tensors[first].view(-1)[0] = float("nan")
    out = tmp_path / "nan-adapter"
    out.mkdir()
    save_file(tensors, str(out / WEIGHTS))
    (out / CONFIG).write_bytes((good / CONFIG).read_bytes())
    return out


def test_a_worker_validates_queued_uploads(
    queued_context, make_adapter, tiny_model_dir, nan_adapter, database_url, tmp_path
):
    context = queued_context
    good = make_adapter(tiny_model_dir, rank=8, targets=("q_proj", "v_proj"), seed=1)
    env = worker_env(
        broker_url=context.settings.celery_broker_url,
        database_url=database_url,
        data_dir=context.settings.data_dir,
    )
    log = tmp_path / "worker.log"
    with TestClient(create_app(context)) as client, running_worker(env, log) as worker:
        headers = _tenant_headers(client, context)
        for name, adapter in (("good", good), ("poisoned", nan_adapter)):
            sent = client.post(
                "/v1/adapters", data={"name": name}, files=_files(adapter), headers=headers
            )
            assert sent.status_code == 202, sent.text
            assert sent.json()["status"] == "validating"

        ready = wait_until(lambda: _status(client, headers, "good"), worker, log, "good verdict")
        assert ready["status"] == "ready", ready
        assert ready["rank"] == 8 and ready["target_modules"] == ["q_proj", "v_proj"]
        assert ready["failure_reason"] is None
        completion = client.post(
            "/v1/adapters/good/completions",
            json={"prompt": "Hello", "max_tokens": 3, "temperature": 0},
            headers=headers,
        )
        assert completion.status_code == 200, completion.text
        assert completion.json()["usage"]["completion_tokens"] == 3

        failed = wait_until(
            lambda: _status(client, headers, "poisoned"), worker, log, "poisoned verdict"
        )
        assert failed["status"] == "failed", failed
        assert "NaN" in failed["failure_reason"], failed
        assert failed["failure_reason"].startswith("Adapter rejected: ")
        refused = client.post(
            "/v1/adapters/poisoned/completions", json={"prompt": "x"}, headers=headers
        )
        assert refused.status_code == 404, refused.text

        models = client.get("/v1/models", headers=headers).json()["data"]
        assert "good" in {model["id"] for model in models}
        assert "poisoned" not in {model["id"] for model in models}

    # Only the good adapter's two files are in the store; the failed row has no keys.
    with context.sessions() as session:
        versions = {
            name: version
            for name, version in session.execute(
                select(Adapter.name, AdapterVersion).join(AdapterVersion.adapter)
            )
        }
    assert versions["poisoned"].weights_store_key is None
    assert versions["poisoned"].config_store_key is None
    stored = sorted(p for p in Path(context.store.root).rglob("*") if p.is_file())
    expected = {versions["good"].weights_store_key, versions["good"].config_store_key}
    assert {context.store.path_of(key) for key in expected} == set(stored)


def test_an_unreachable_broker_refuses_the_upload_and_keeps_nothing(
    tmp_path, tiny_model_dir, database_url, make_adapter
):
    settings = Settings(
        data_dir=tmp_path / "data",
        model=str(tiny_model_dir),
        database_url=database_url,
        celery_broker_url="redis://127.0.0.1:9/0",  # the discard port: nothing listens
    )
    context = _context(settings)
    good = make_adapter(tiny_model_dir, rank=4, targets=("q_proj",), seed=2)
    try:
        with TestClient(create_app(context)) as client:
            headers = _tenant_headers(client, context)
            sent = client.post(
                "/v1/adapters", data={"name": "lost"}, files=_files(good), headers=headers
            )
            assert sent.status_code == 503, sent.text
            assert sent.json()["error"]["code"] == "task_queue_unavailable"
            assert client.get("/v1/adapters/lost", headers=headers).status_code == 404
        with context.sessions() as session:
            assert session.scalars(select(AdapterVersion)).all() == []
            assert session.scalars(select(Adapter)).all() == []
        root = Path(context.store.root)
        assert not root.exists() or [p for p in root.rglob("*") if p.is_file()] == []
    finally:
        context.tasks.close()
        context.sessions.kw["bind"].dispose()
