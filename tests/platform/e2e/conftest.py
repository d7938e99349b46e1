"""A real platform server over HTTP for end-to-end tests, and helpers to drive it.

``start_platform(settings)`` builds the context (migrations, store, limiter, engine) and runs
the app under uvicorn in a thread; :class:`Platform` wraps the running server with the admin
calls a test needs (tenants, API keys, usage reports) and hands out official ``openai``
clients bound to a tenant's key.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from loramux.platform.app import create_app
from loramux.platform.context import PlatformContext, build_context
from loramux.platform.settings import Settings
from tests.fixtures.browser import ServerThread
from tests.fixtures.moto_server import RestartableMotoServer, private_moto_server
from tests.fixtures.services import _empty_and_delete_bucket


@dataclass
class Tenant:
    """A tenant created over the admin API, with one API key."""

    id: str
    key: str
    prices: dict[str, float] = field(default_factory=dict)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@dataclass
class Platform:
    """A running server and its context."""

    context: PlatformContext
    url: str

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.context.admin_token}"}

    @property
    def base_model(self) -> str:
        return self.context.base_model.model_id

    def new_tenant(self, **fields: Any) -> Tenant:
        body = {"name": f"t-{uuid.uuid4().hex[:8]}", **fields}
        created = httpx.post(f"{self.url}/admin/tenants", json=body, headers=self.admin)
        assert created.status_code == 201, created.text
        tenant_id = created.json()["id"]
        key = httpx.post(f"{self.url}/admin/tenants/{tenant_id}/api-keys", headers=self.admin)
        assert key.status_code == 201, key.text
        prices = {k: v for k, v in fields.items() if k.endswith("_price_per_mtok")}
        return Tenant(id=tenant_id, key=key.json()["key"], prices=prices)

    def client(self, tenant: Tenant) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=tenant.key, max_retries=0, timeout=120
        )

    def admin_usage(self, **params: Any) -> httpx.Response:
        response = httpx.get(f"{self.url}/admin/usage", params=params, headers=self.admin)
        assert response.status_code == 200, response.text
        return response


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def upload_adapter(url: str, headers: dict[str, str], name: str, adapter_dir: Path) -> dict:
    """Upload the PEFT adapter in ``adapter_dir`` as ``name`` over HTTP (201 expected);
    returns the adapter's record."""
    files = [("files", (f, (adapter_dir / f).read_bytes())) for f in ADAPTER_FILES]
    response = httpx.post(
        f"{url}/v1/adapters", data={"name": name}, files=files, headers=headers, timeout=300
    )
    assert response.status_code == 201, response.text
    return response.json()


@contextlib.contextmanager
def start_platform(settings: Settings) -> Iterator[Platform]:
    """Build the context for ``settings`` and serve it over HTTP until the block ends."""
    context = build_context(settings, log=lambda _: None)
    try:
        with ServerThread(create_app(context)) as server:
            yield Platform(context=context, url=server.url)
    finally:
        context.rate_limiter.close()
        context.sessions.kw["bind"].dispose()


# --- an S3 server of the test's own, which it may stop and start again ------------------------


@pytest.fixture
def store_server() -> Iterator[RestartableMotoServer]:
    with private_moto_server() as server:
        yield server


@pytest.fixture
def bucket(store_server) -> Iterator[str]:
    name = f"loramux-outage-{uuid.uuid4().hex[:12]}"
    store_server.endpoint.client().create_bucket(Bucket=name)
    try:
        yield name
    finally:  # moto's backends are process-wide: leave nothing for other tests
        if not store_server.running:
            store_server.start()
        _empty_and_delete_bucket(store_server.endpoint.client(), name)
