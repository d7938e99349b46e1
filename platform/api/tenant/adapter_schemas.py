"""Response bodies of the tenant adapter API (``/v1/adapters``), apart from the ORM models."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel

from loramux.platform.services.adapters import AdapterView


class AdapterOut(BaseModel):
    """An adapter as its latest version describes it (``rank`` etc. are ``None`` until ready)."""

    id: str
    object: str = "adapter"
    name: str
    version: int | None
    status: str | None
    failure_reason: str | None = None  # why a failed version was refused
    rank: int | None
    target_modules: list[str] | None
    size_bytes: int | None
    sha256: str | None
    base_model: str | None
    created_at: datetime

    @classmethod
    def from_view(cls, view: AdapterView) -> AdapterOut:
        version = view.version
        return cls(
            id=view.adapter.id,
            name=view.adapter.name,
            version=None if version is None else version.version,
            status=None if version is None else version.status,
            failure_reason=None if version is None else version.failure_reason,
            rank=None if version is None else version.rank,
            target_modules=None if version is None else version.target_modules,
            size_bytes=None if version is None else version.size_bytes,
            sha256=None if version is None else version.sha256,
            base_model=None if version is None else version.base_model,
            created_at=view.adapter.created_at,
        )


class AdapterList(BaseModel):
    object: str = "list"
    data: list[AdapterOut]
