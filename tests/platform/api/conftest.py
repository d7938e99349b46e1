"""The app over a real context on PostgreSQL (engine started by the lifespan), and helpers."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from loramux.engine.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from loramux.platform.app import create_app
from loramux.platform.context import PlatformContext, build_context
from loramux.platform.db.models import AdapterStatus, Tenant
from loramux.platform.settings import Settings
from tests.fixtures.browser import ServerThread
from tests.fixtures.models import build_tiny_model
from tests.platform.api.slowed_platform import slow_steps
from tests.platform.db.factories import add_adapter, add_adapter_version


@contextmanager
def platform_context(
    data_dir, model_dir, database_url, **settings: Any
) -> Iterator[PlatformContext]:
    """A context over ``model_dir`` and the database; ``settings`` set the rest."""
    context = build_context(
        Settings(
            data_dir=data_dir,
            model=str(model_dir),
            database_url=database_url,
            admin_token=None,
            **settings,
        ),
        log=lambda _: None,
    )
    try:
        yield context
    finally:
        context.sessions.kw["bind"].dispose()


@pytest.fixture
def context(tmp_path, tiny_model_dir, postgres_database_url) -> Iterator[PlatformContext]:
    with platform_context(tmp_path, tiny_model_dir, postgres_database_url) as context:
        yield context


@pytest.fixture
def client(context) -> Iterator[TestClient]:
    with TestClient(create_app(context)) as test_client:
        yield test_client


@pytest.fixture
def admin(context) -> dict[str, str]:
    """Headers carrying the operator token."""
    return {"Authorization": f"Bearer {context.admin_token}"}


@pytest.fixture
def new_tenant(client, admin):
    """``new_tenant(**fields)`` creates a tenant over HTTP and returns its JSON."""
    count = 0

    def create(**fields: Any) -> dict:
        nonlocal count
        count += 1
        body = {"name": f"tenant-{count}", **fields}
        response = client.post("/admin/tenants", json=body, headers=admin)
        assert response.status_code == 201, response.text
        return response.json()

    return create


@pytest.fixture
def tenant_key(client, admin, new_tenant):
    """``tenant_key()`` creates a tenant with an API key; returns its auth headers."""

    def create() -> dict[str, str]:
        tenant = new_tenant()
        response = client.post(f"/admin/tenants/{tenant['id']}/api-keys", headers=admin)
        assert response.status_code == 201, response.text
        return {"Authorization": f"Bearer {response.json()['key']}"}

    return create


@pytest.fixture
def server(context) -> Iterator[ServerThread]:
    """The app on a real uvicorn server (for the official clients)."""
    with ServerThread(create_app(context)) as running:
        yield running


@pytest.fixture
def make_client(server, context) -> Callable[..., tuple[openai.OpenAI, str]]:
    """``make_client(**tenant_fields)`` -> (an OpenAI client with a new tenant's key, its id)."""
    admin = {"Authorization": f"Bearer {context.admin_token}"}

    def make(**fields) -> tuple[openai.OpenAI, str]:
        body = {"name": f"t-{uuid.uuid4().hex[:8]}", **fields}
        tenant = httpx.post(f"{server.url}/admin/tenants", json=body, headers=admin)
        assert tenant.status_code == 201, tenant.text
        tenant_id = tenant.json()["id"]
        key = httpx.post(f"{server.url}/admin/tenants/{tenant_id}/api-keys", headers=admin)
        assert key.status_code == 201, key.text
        client = openai.OpenAI(
            base_url=f"{server.url}/v1", api_key=key.json()["key"], max_retries=0, timeout=60
        )
        return client, tenant_id

    return make


@pytest.fixture
def base(context) -> str:
    """The base model's id (its ``model`` name)."""
    return context.base_model.model_id


def usage_rows(server, context, tenant_id: str) -> list[dict]:
    """The tenant's usage records, one row per request (``/admin/usage?group_by=request``)."""
    admin = {"Authorization": f"Bearer {context.admin_token}"}
    params = {"tenant_id": tenant_id, "group_by": "request"}
    report = httpx.get(f"{server.url}/admin/usage", params=params, headers=admin)
    assert report.status_code == 200, report.text
    return report.json()["rows"]


def upload_adapter(server, client: openai.OpenAI, name: str, folder) -> dict:
    """Upload the PEFT folder as ``client``'s tenant's adapter ``name`` over HTTP: the new
    ready version's body."""
    files = [("files", (f, (folder / f).read_bytes())) for f in (CONFIG_FILE, WEIGHTS_FILE)]
    response = httpx.post(
        f"{server.url}/v1/adapters",
        data={"name": name},
        files=files,
        headers={"Authorization": f"Bearer {client.api_key}"},
        timeout=60,
    )
    assert response.status_code == 201, response.text
    assert response.json()["status"] == "ready"
    return response.json()


def assert_openai_error(response, status: int) -> dict:
    """The response is ``status`` with an OpenAI-style error body; returns the error."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    return error


def store_ready_adapter(context: PlatformContext, tenant_id: str, name: str, adapter_dir) -> str:
    """The PEFT folder ``adapter_dir`` as the tenant's ready adapter ``name``: its files in
    the store and its rows in the database, as a validated upload leaves them. Returns the
    version's id."""
    config = context.store.put_file(adapter_dir / CONFIG_FILE)
    weights = context.store.put_file(adapter_dir / WEIGHTS_FILE)
    with context.sessions.begin() as session:
        adapter = add_adapter(session, session.get(Tenant, tenant_id), name=name)
        version = add_adapter_version(
            session,
            adapter,
            status=AdapterStatus.READY.value,
            config_store_key=config.key,
            weights_store_key=weights.key,
        )
        return version.id


@pytest.fixture
def speculating(tmp_path, tiny_model_dir, postgres_database_url):
    """(client, context) of an app whose engine speculates with n-gram proposals (the tiny
    model's greedy text falls into loops, so proposals are made and some accepted)."""
    with (
        platform_context(
            tmp_path,
            tiny_model_dir,
            postgres_database_url,
            speculative_method="ngram",
            num_speculative_tokens=4,
            ngram_min_n=1,
        ) as context,
        TestClient(create_app(context)) as client,
    ):
        yield client, context


@pytest.fixture
def drafting(tmp_path, tiny_model_dir, tokenizer_dir, postgres_database_url):
    """(client, context) of an app whose engine speculates with a draft model: a random
    model a quarter of the tiny one's width (its head, the bulk of both, is a quarter as
    large), set through the settings as an operator would."""
    draft = build_tiny_model(
        tmp_path / "draft-model",
        tokenizer_dir,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=1,
    )
    with (
        platform_context(
            tmp_path,
            tiny_model_dir,
            postgres_database_url,
            speculative_method="draft",
            draft_model=draft,
            draft_kv_cache_bytes=1 << 20,
        ) as context,
        TestClient(create_app(context)) as client,
    ):
        yield client, context


def speculation_totals(client, context) -> dict:
    """The engines' speculative decoding, all adapters added up (``GET /admin/engine``)."""
    admin = {"Authorization": f"Bearer {context.admin_token}"}
    response = client.get("/admin/engine", headers=admin)
    assert response.status_code == 200, response.text
    return response.json()["speculation"]["total"]


@pytest.fixture
def slowed_platform(tmp_path, tiny_model_dir, postgres_database_url):
    """``slowed_platform(**settings)``: a client of a fresh app whose engine steps are
    slowed (``slowed_platform.slow_steps``), and its context."""
    opened = []

    def start(**settings):
        manager = platform_context(tmp_path, tiny_model_dir, postgres_database_url, **settings)
        context = manager.__enter__()
        client = TestClient(create_app(context))
        client.__enter__()
        client.background = []  # threads of post_in_background
        opened.append((manager, client))
        slow_steps(context)
        return client, context

    yield start
    for manager, client in reversed(opened):
        for thread in client.background:
            thread.join(30)
        client.__exit__(None, None, None)
        manager.__exit__(None, None, None)
