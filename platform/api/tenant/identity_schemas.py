"""Response body of ``GET /v1/me``: who the bearer token belongs to."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class IdentityOut(BaseModel):
    """The operator (admin token), or a tenant (API key) with its id and name."""

    role: Literal["operator", "tenant"]
    tenant_id: str | None = Field(default=None, description="Set for a tenant.")
    tenant_name: str | None = Field(default=None, description="Set for a tenant.")
