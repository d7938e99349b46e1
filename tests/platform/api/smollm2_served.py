"""The embedded platform on the real SmolLM2 behind uvicorn, with a tenant that uploaded a
PEFT adapter: what the structured-output tests ask real JSON and tool calls of (the tiny
random model would write valid but endless JSON). Test modules wrap :func:`served` in a
module-scoped fixture.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

from loramux.platform.settings import Settings
from tests.platform.e2e.conftest import Platform, Tenant, start_platform, upload_adapter

ADAPTER = "extractor"


@dataclass
class Served:
    platform: Platform
    tenant: Tenant
    client: openai.OpenAI  # the tenant's official client

    @property
    def base(self) -> str:
        return self.platform.base_model

    def usage_rows(self) -> dict[str, dict]:
        """The tenant's usage records by request id."""
        report = self.platform.admin_usage(tenant_id=self.tenant.id, group_by="request")
        return {row["request_id"]: row for row in report.json()["rows"]}

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(
            f"{self.platform.url}/v1{path}", json=body, headers=self.tenant.headers, timeout=300
        )


@contextlib.contextmanager
def served(data_dir: Path, model_dir: Path, adapter_dir: Path) -> Iterator[Served]:
    with start_platform(Settings(data_dir=data_dir, model=str(model_dir))) as platform:
        tenant = platform.new_tenant()
        upload_adapter(platform.url, tenant.headers, ADAPTER, adapter_dir)
        client = openai.OpenAI(
            base_url=f"{platform.url}/v1", api_key=tenant.key, max_retries=0, timeout=300
        )
        yield Served(platform, tenant, client)
