"""Response bodies of the tenant adapter API (``/v1/adapters``), apart from the ORM models."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from loramux.platform.db.models import AdapterVersion
from loramux.platform.services.adapter_grants import GrantView
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
    alias_version: int | None = Field(
        default=None,
        description="The version the bare name reaches (`PUT /v1/adapters/{name}/alias`); "
        "null: the newest ready one.",
    )

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
            alias_version=view.adapter.alias_version,
        )


class AdapterList(BaseModel):
    object: str = "list"
    data: list[AdapterOut]


VERSION_MAX = 2**31 - 1  # the database's INTEGER
# A version number a request body names (the alias, a grant, a pin).
VersionNumber = Annotated[int, Field(ge=1, le=VERSION_MAX)]


class AliasIn(BaseModel):
    """``PUT /v1/adapters/{name}/alias``: which ready version the bare name reaches."""

    model_config = ConfigDict(extra="forbid", strict=True)

    version: VersionNumber | None = Field(
        description="A ready version's number; null: follow the newest ready version.",
    )


class VersionOut(BaseModel):
    """One upload of an adapter; call it as ``name@<version>`` or ``name@sha256:<prefix>``."""

    object: str = "adapter.version"
    version: int
    status: str
    failure_reason: str | None = None
    rank: int | None
    target_modules: list[str] | None
    size_bytes: int | None
    sha256: str | None = Field(description="SHA-256 of the weights file: the version's digest.")
    created_at: datetime

    @classmethod
    def of(cls, version: AdapterVersion) -> VersionOut:
        fields = ("version", "status", "failure_reason", "rank", "target_modules")
        fields += ("size_bytes", "sha256", "created_at")
        return cls(**{name: getattr(version, name) for name in fields})


class VersionList(BaseModel):
    object: str = "list"
    alias_version: int | None
    data: list[VersionOut]


class GrantIn(BaseModel):
    """``PUT /v1/adapters/{name}/grants/{grantee}``: which versions the grantee may call."""

    model_config = ConfigDict(extra="forbid", strict=True)

    version: VersionNumber | None = Field(
        default=None,
        description="One ready version alone (the bare `owner/name` then reaches it); null "
        "or absent: every version, the bare name reaching what the owner's does.",
    )


class GrantOut(BaseModel):
    """Leave for ``grantee`` to call the adapter as ``<owner>/<name>``."""

    object: str = "adapter.grant"
    adapter: str
    grantee: str = Field(description="The tenant granted, by name.")
    version: int | None = Field(description="The one version granted; null: every version.")
    model: str = Field(description="What the grantee sends as `model`.")
    created_at: datetime
    updated_at: datetime

    @classmethod
    def of(cls, owner_name: str, adapter_name: str, view: GrantView) -> GrantOut:
        return cls(
            adapter=adapter_name,
            grantee=view.grantee.name,
            version=view.grant.version,
            model=f"{owner_name}/{adapter_name}",
            created_at=view.grant.created_at,
            updated_at=view.grant.updated_at,
        )


class GrantList(BaseModel):
    object: str = "list"
    data: list[GrantOut]


class PinIn(BaseModel):
    """``PUT /v1/adapters/{name}/pin``: which version to keep on the device."""

    model_config = ConfigDict(extra="forbid", strict=True)

    version: VersionNumber | None = Field(
        default=None,
        description="A ready version's number; null or absent: the one the bare name reaches now.",
    )


class PinOut(BaseModel):
    """The adapter's pinned version and how the engines hold it, with the tenant's quota."""

    object: str = "adapter.pin"
    adapter: str
    version: int | None = Field(description="The pinned version; null: none.")
    pinned_by: str | None = Field(description="`tenant` or `operator`; null: not pinned.")
    size_bytes: int | None = Field(description="Its weights' bytes, counted against the quota.")
    state: str | None = Field(
        description="`pinned` when every engine holds it on the device, else why not yet "
        "(loading, waiting for memory no request is promised, over the engines' share for "
        "pins); null: not pinned."
    )
    quota_bytes: int = Field(description="Bytes the tenant may pin (set by an operator).")
    pinned_bytes: int = Field(description="Bytes the tenant's own pins hold now.")
